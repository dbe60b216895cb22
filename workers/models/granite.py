"""Granite 3: the Llama decoder with IBM's multipliers: `embedding_multiplier` on the embeddings,
`residual_multiplier` on each branch before the residual add, `attention_multiplier` as the
attention scale, and the logits divided by `logits_scaling`."""

from __future__ import annotations

from dataclasses import replace

from workers.models import llama
from workers.models.args import ModelArgs
from workers.models.decoder import DecoderSpec


def decoder_spec(args: ModelArgs) -> DecoderSpec:
    hf = args.hf_config
    return replace(
        llama.decoder_spec(args),
        attn_scale=hf.get("attention_multiplier", args.head_dim**-0.5),
        embed_scale=hf.get("embedding_multiplier", 1.0),
        residual_scale=hf.get("residual_multiplier", 1.0),
        logits_divisor=hf.get("logits_scaling", 1.0),
    )

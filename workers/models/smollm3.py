"""SmolLM3: the Llama decoder in which every layer whose `no_rope_layers` entry is 0 has no rotary
embedding (NoPE: position comes from causality alone)."""

from __future__ import annotations

from dataclasses import replace

from workers.models import llama
from workers.models.args import ModelArgs
from workers.models.decoder import DecoderSpec, layer_kinds


def decoder_spec(args: ModelArgs) -> DecoderSpec:
    hf = args.hf_config
    uses_rope = hf.get("no_rope_layers") or [1] * args.num_hidden_layers
    if len(uses_rope) != args.num_hidden_layers:
        raise ValueError(f"no_rope_layers must have {args.num_hidden_layers} entries")
    layers = tuple(
        kind if rope else replace(kind, rope=None)
        for kind, rope in zip(layer_kinds(args), uses_rope)
    )
    return replace(llama.decoder_spec(args), layers=layers)

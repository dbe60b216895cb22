"""Phi-3 and Phi-4-mini: the Llama decoder whose checkpoints store q/k/v as one `qkv_proj` and gate/up
as one `gate_up_proj` (the weight loader splits them), with partial rotation
(`partial_rotary_factor`, 0.75 on Phi-4-mini), longrope scaling and, where the config sets one below
max_position_embeddings, a sliding window on every layer."""

from __future__ import annotations

from workers.models.args import ModelArgs
from workers.models.decoder import DecoderSpec, layer_kinds


def decoder_spec(args: ModelArgs) -> DecoderSpec:
    return DecoderSpec(
        layers=layer_kinds(args), activation=args.hf_config.get("hidden_act", "silu")
    )

"""Qwen2: the Llama decoder with a bias on the q/k/v projections (none on o_proj); sliding windows on
the layers from `max_window_layers` on when `use_sliding_window` is set."""

from __future__ import annotations

from workers.models.decoder import DecoderSpec, layer_kinds
from workers.models.registry import ModelArgs


def decoder_spec(args: ModelArgs) -> DecoderSpec:
    return DecoderSpec(
        layers=layer_kinds(args),
        qkv_bias=True,
        activation=args.hf_config.get("hidden_act", "silu"),
    )

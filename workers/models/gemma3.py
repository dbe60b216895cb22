"""Gemma 3 (text): Gemma 2's layer (gemma2.py) with per-head q/k norms (1 + weight) instead of
attention softcapping, five sliding-window layers to one global (`layer_types`, else
`sliding_window_pattern`), and a rope base per layer type (`rope_parameters` per type, or
`rope_local_base_freq` for the local layers in older configs)."""

from __future__ import annotations

from workers.models.args import ModelArgs
from workers.models.decoder import DecoderSpec, layer_kinds
from workers.models.gemma2 import gemma_spec


def decoder_spec(args: ModelArgs) -> DecoderSpec:
    pattern = args.hf_config.get("sliding_window_pattern", 6)
    by_pattern = [
        "sliding_attention" if (i + 1) % pattern else "full_attention"
        for i in range(args.num_hidden_layers)
    ]
    return gemma_spec(args, layer_kinds(args, by_pattern), qk_norm="head")

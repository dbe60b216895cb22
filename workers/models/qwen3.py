"""Qwen3: the Llama decoder with per-head RMSNorm on q and k before RoPE.

head_dim comes from config.json (it need not be hidden_size / num_attention_heads); q/k/v/o carry a
bias only when `attention_bias` says so; windows as Qwen2's.
"""

from __future__ import annotations

from workers.models.decoder import DecoderSpec, layer_kinds
from workers.models.registry import ModelArgs


def decoder_spec(args: ModelArgs) -> DecoderSpec:
    bias = args.attention_bias
    return DecoderSpec(
        layers=layer_kinds(args),
        qkv_bias=bias,
        o_bias=bias,
        qk_norm="head",
        activation=args.hf_config.get("hidden_act", "silu"),
    )

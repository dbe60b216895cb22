"""Qwen3: the Llama decoder with per-head RMSNorm on q and k before RoPE.

head_dim comes from config.json (it need not be hidden_size / num_attention_heads); q/k/v/o carry a
bias only when `attention_bias` says so.
"""

from __future__ import annotations

from workers.models.llama import DecoderVariant
from workers.models.registry import ModelArgs


def decoder_variant(args: ModelArgs) -> DecoderVariant:
    if args.use_sliding_window:
        raise ValueError("Qwen3 sliding-window attention is not supported")
    bias = args.attention_bias
    return DecoderVariant(qkv_bias=bias, o_bias=bias, qk_norm=True)

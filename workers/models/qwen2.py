"""Qwen2: the Llama decoder with a bias on the q/k/v projections (none on o_proj)."""

from __future__ import annotations

from workers.models.llama import DecoderVariant
from workers.models.registry import ModelArgs


def decoder_variant(args: ModelArgs) -> DecoderVariant:
    if args.use_sliding_window:
        raise ValueError("Qwen2 sliding-window attention is not supported")
    return DecoderVariant(qkv_bias=True, o_bias=False)

"""Qwen3: the Llama decoder with per-head RMSNorm on q and k before RoPE.

head_dim comes from config.json (it need not be hidden_size / num_attention_heads); q/k/v/o carry a
bias only when `attention_bias` says so; windows as Qwen2's.
"""

from __future__ import annotations

from dataclasses import replace

from workers.models import llama
from workers.models.args import ModelArgs
from workers.models.decoder import DecoderSpec


def decoder_spec(args: ModelArgs) -> DecoderSpec:
    return replace(llama.decoder_spec(args), qk_norm="head")

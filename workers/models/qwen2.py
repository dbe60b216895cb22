"""Qwen2: the Llama decoder with a bias on the q/k/v projections (none on o_proj); sliding windows on
the layers from `max_window_layers` on when `use_sliding_window` is set."""

from __future__ import annotations

from dataclasses import replace

from workers.models import llama
from workers.models.args import ModelArgs
from workers.models.decoder import DecoderSpec


def decoder_spec(args: ModelArgs) -> DecoderSpec:
    return replace(llama.decoder_spec(args), qkv_bias=True, o_bias=False)

"""Llama (and the families that are Llama with another config.json: Mistral, Ministral): the shared
decoder as is, biases on q/k/v/o when `attention_bias` says so, sliding windows where the config sets
them (Mistral: every layer; Ministral: by `layer_types`)."""

from __future__ import annotations

from workers.models.args import ModelArgs
from workers.models.decoder import DecoderSpec, layer_kinds


def decoder_spec(args: ModelArgs) -> DecoderSpec:
    bias = args.attention_bias
    return DecoderSpec(
        layers=layer_kinds(args),
        qkv_bias=bias,
        o_bias=bias,
        activation=args.hf_config.get("hidden_act", "silu"),
    )

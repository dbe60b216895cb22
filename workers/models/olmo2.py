"""OLMo 2: norms after attention and after the MLP (none before), RMSNorm on the whole q and k
projections (over every head: under tensor parallelism the ranks add their squares), every norm
multiplying its weight in float32 before the cast back."""

from __future__ import annotations

from workers.models.args import ModelArgs
from workers.models.decoder import DecoderSpec, layer_kinds


def decoder_spec(args: ModelArgs) -> DecoderSpec:
    bias = args.attention_bias
    return DecoderSpec(
        layers=layer_kinds(args),
        norms={"attn_out": "post_attention_layernorm", "mlp_out": "post_feedforward_layernorm"},
        norm_weight_in_float32=True,
        qkv_bias=bias,
        o_bias=bias,
        qk_norm="full",
        activation=args.hf_config.get("hidden_act", "silu"),
    )

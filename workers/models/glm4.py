"""GLM-4 (0414): sandwich norms (after attention and after the MLP as well as before each), q/k/v
biases (`attention_bias`), partial rotation of pairs (interleaved, `partial_rotary_factor` 0.5), and
checkpoints that store gate/up as one `gate_up_proj` (the weight loader splits it)."""

from __future__ import annotations

from workers.models.args import ModelArgs
from workers.models.decoder import DecoderSpec, layer_kinds


def decoder_spec(args: ModelArgs) -> DecoderSpec:
    return DecoderSpec(
        layers=layer_kinds(args),
        norms={
            "input": "input_layernorm",
            "attn_out": "post_self_attn_layernorm",
            "pre_mlp": "post_attention_layernorm",
            "mlp_out": "post_mlp_layernorm",
        },
        qkv_bias=args.attention_bias,
        activation=args.hf_config.get("hidden_act", "silu"),
        rope_interleaved=True,
    )

"""Gemma 2: sandwich norms of the form 1 + weight (before and after attention and the MLP), the
GELU-tanh gate, embeddings scaled by sqrt(hidden), attention scaled by `query_pre_attn_scalar`
** -0.5 with its logits softcapped (`attn_logit_softcapping`), the final logits softcapped
(`final_logit_softcapping`), and sliding-window layers alternating with global ones (even layers
slide in configs written before `layer_types`)."""

from __future__ import annotations

from workers.models.args import ModelArgs
from workers.models.decoder import DecoderSpec, layer_kinds

GEMMA_NORMS = {
    "input": "input_layernorm",
    "attn_out": "post_attention_layernorm",
    "pre_mlp": "pre_feedforward_layernorm",
    "mlp_out": "post_feedforward_layernorm",
}


def decoder_spec(args: ModelArgs) -> DecoderSpec:
    alternating = [
        "sliding_attention" if i % 2 == 0 else "full_attention"
        for i in range(args.num_hidden_layers)
    ]
    return gemma_spec(args, layer_kinds(args, alternating), qk_norm=None)


def gemma_spec(args: ModelArgs, layers: tuple, qk_norm: str | None) -> DecoderSpec:
    """What Gemma 2 and 3 share."""
    hf = args.hf_config
    bias = args.attention_bias
    return DecoderSpec(
        layers=layers,
        norms=dict(GEMMA_NORMS),
        norm_offset=1.0,
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=qk_norm,
        activation=hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh",
        attn_scale=hf.get("query_pre_attn_scalar", args.head_dim) ** -0.5,
        attn_softcap=hf.get("attn_logit_softcapping"),
        final_softcap=hf.get("final_logit_softcapping"),
        embed_scale=args.hidden_size**0.5,
    )

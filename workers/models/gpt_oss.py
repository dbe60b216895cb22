"""gpt-oss: attention with a bias on q/k/v/o and a learned sink per head (a logit in each query's
softmax with no value), sliding-window and full layers alternating (`layer_types`), yarn rotation,
norms that multiply in float32, and a mixture of experts as every layer's MLP: a router with a
bias whose top `num_experts_per_tok` logits are softmaxed, experts with biases and a clamped
SwiGLU (`swiglu_limit`, `swiglu_alpha`), stored gate/up-interleaved and transposed; the released
checkpoints' experts are MXFP4, dequantized as they load (workers/weight_loader.py)."""

from __future__ import annotations

from workers.layers.moe import MoESpec, num_experts_of
from workers.models.args import ModelArgs
from workers.models.decoder import DecoderSpec, layer_kinds


def decoder_spec(args: ModelArgs) -> DecoderSpec:
    hf = args.hf_config
    moe = MoESpec(
        num_experts=num_experts_of(hf),
        top_k=hf["num_experts_per_tok"],
        intermediate_size=args.intermediate_size,
        norm_topk_prob=False,
        router_bias=True,
        topk_then_softmax=True,
        expert_bias=True,
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
        layout="gpt_oss",
    )
    bias = bool(hf.get("attention_bias", True))
    spec = DecoderSpec(
        layers=layer_kinds(args),
        norm_weight_in_float32=True,
        qkv_bias=bias,
        o_bias=bias,
        attn_sinks=True,
    )
    return spec.with_experts(moe, [True] * args.num_hidden_layers)

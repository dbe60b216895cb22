"""OLMoE (OLMoE-1B-7B): Llama's layer layout with RMSNorm on the whole q and k projections and a
mixture of experts as every layer's MLP (`intermediate_size` each, top `num_experts_per_tok`,
renormalised when `norm_topk_prob`). `clip_qkv` (clamping q, k and v) is not served."""

from __future__ import annotations

from dataclasses import replace

from workers.layers.moe import MoESpec, num_experts_of
from workers.models import llama
from workers.models.args import ModelArgs
from workers.models.decoder import DecoderSpec


def decoder_spec(args: ModelArgs) -> DecoderSpec:
    hf = args.hf_config
    if hf.get("clip_qkv") is not None:
        raise ValueError("OLMoE's clip_qkv (clamping q, k and v) is not supported")
    moe = MoESpec(
        num_experts=num_experts_of(hf),
        top_k=hf["num_experts_per_tok"],
        intermediate_size=args.intermediate_size,
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
    )
    spec = replace(llama.decoder_spec(args), qk_norm="full")
    return spec.with_experts(moe, [True] * args.num_hidden_layers)

"""Qwen3.5-MoE (Qwen3.5-35B-A3B ...): Qwen3.5's hybrid layers (Gated DeltaNet and gated full
attention, workers/models/qwen3_5.py) with a mixture of experts as every layer's MLP: top
`num_experts_per_tok` of `num_experts` experts of `moe_intermediate_size`, always renormalised,
beside a shared expert (`shared_expert_intermediate_size`) scaled by sigmoid(shared_expert_gate)."""

from __future__ import annotations

from workers.layers.moe import MoESpec, num_experts_of
from workers.models import qwen3_5
from workers.models.args import ModelArgs
from workers.models.decoder import DecoderSpec


def decoder_spec(args: ModelArgs) -> DecoderSpec:
    hf = args.hf_config
    moe = MoESpec(
        num_experts=num_experts_of(hf),
        top_k=hf["num_experts_per_tok"],
        intermediate_size=hf["moe_intermediate_size"],
        norm_topk_prob=True,
        shared_expert_size=hf["shared_expert_intermediate_size"],
    )
    return qwen3_5.decoder_spec(args).with_experts(moe, [True] * args.num_hidden_layers)

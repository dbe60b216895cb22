"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's decoder with Qwen3-MoE's expert layers
plus a shared expert every token takes (`shared_expert_intermediate_size`), scaled by
sigmoid(shared_expert_gate(x))."""

from __future__ import annotations

from workers.models import qwen2, qwen3_moe
from workers.models.args import ModelArgs
from workers.models.decoder import DecoderSpec


def decoder_spec(args: ModelArgs) -> DecoderSpec:
    moe = qwen3_moe.moe_spec(args, args.hf_config["shared_expert_intermediate_size"])
    return qwen2.decoder_spec(args).with_experts(moe, qwen3_moe.sparse_layers(args))

"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's decoder with a mixture of experts as the MLP
of every `decoder_sparse_step`-th layer not in `mlp_only_layers` (those keep a dense MLP of
`intermediate_size`); experts of `moe_intermediate_size`, top `num_experts_per_tok` of
`num_experts`, renormalised when `norm_topk_prob`.

Qwen3-VL-MoE's language model is this decoder rotating by interleaved M-RoPE (workers/layers/
rotary.py), its router always renormalising, its checkpoints' experts stacked and transposed
(`layout="transposed"`, workers/layers/moe.py)."""

from __future__ import annotations

from workers.layers.moe import MoESpec, num_experts_of
from workers.models import qwen3
from workers.models.args import ModelArgs
from workers.models.decoder import DecoderSpec


def sparse_layers(args: ModelArgs) -> list[bool]:
    """Qwen's rule for which layers have experts (Qwen2-MoE, Qwen3-MoE)."""
    hf = args.hf_config
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
    return [
        i not in dense and num_experts_of(hf) > 0 and (i + 1) % step == 0
        for i in range(args.num_hidden_layers)
    ]


QWEN3_VL_MOE = "Qwen3VLMoeForConditionalGeneration"


def moe_spec(args: ModelArgs, shared_expert_size: int = 0) -> MoESpec:
    hf = args.hf_config
    vl = args.architecture == QWEN3_VL_MOE
    return MoESpec(
        num_experts=num_experts_of(hf),
        top_k=hf["num_experts_per_tok"],
        intermediate_size=hf["moe_intermediate_size"],
        norm_topk_prob=vl or bool(hf.get("norm_topk_prob", False)),
        shared_expert_size=shared_expert_size,
        layout="transposed" if vl else "hf",
    )


def decoder_spec(args: ModelArgs) -> DecoderSpec:
    return qwen3.decoder_spec(args).with_experts(moe_spec(args), sparse_layers(args))

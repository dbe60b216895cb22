"""Qwen2ForCausalLM: the Llama decoder with a bias on the q/k/v projections (none on o_proj)."""

from __future__ import annotations

from workers.distributed import ParallelContext
from workers.models.llama import LlamaForCausalLM
from workers.models.registry import ModelArgs


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, args: ModelArgs, ctx: ParallelContext) -> None:
        if args.use_sliding_window:
            raise ValueError("Qwen2 sliding-window attention is not supported")
        super().__init__(args, ctx, qkv_bias=True, o_bias=False)

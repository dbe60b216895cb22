"""Qwen3ForCausalLM: the Llama decoder with per-head RMSNorm on q and k before RoPE.

head_dim comes from config.json (it need not be hidden_size / num_attention_heads); q/k/v/o carry a
bias only when `attention_bias` says so.
"""

from __future__ import annotations

from workers.distributed import ParallelContext
from workers.models.llama import LlamaForCausalLM
from workers.models.registry import ModelArgs


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, args: ModelArgs, ctx: ParallelContext) -> None:
        if args.use_sliding_window:
            raise ValueError("Qwen3 sliding-window attention is not supported")
        super().__init__(args, ctx, qk_norm=True)

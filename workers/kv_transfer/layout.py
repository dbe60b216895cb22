"""What one rank's KV blocks are (KVLayout): two servers exchange blocks only where equal."""

from __future__ import annotations

import torch

from enginecore.config import Config
from enginecore.messages import KVLayout
from workers.models.args import ModelArgs


def kv_layout(
    config: Config,
    args: ModelArgs,
    block_shape: list[int],
    dtype: torch.dtype,
    rank: int,
    draft: str = "",
) -> KVLayout:
    """block_shape: one block of the rank's cache tensor (workers/runner/kv_cache.py); draft:
    the draft model's KV (Drafter.kv_layout)."""
    model = (
        f"{args.architecture} layers={args.num_hidden_layers} hidden={args.hidden_size} "
        f"kv_heads={args.num_key_value_heads} head_dim={args.head_dim} vocab={args.vocab_size}"
    )
    p = config.parallel
    return KVLayout(
        model=model,
        dtype=str(dtype).removeprefix("torch."),
        block_size=config.cache.block_size,
        tp=p.tensor_parallel_size,
        pp=p.pipeline_parallel_size,
        rank=rank,
        block_shape=block_shape,
        draft=draft,
    )


def describe(layout: KVLayout) -> str:
    return (
        f"{layout.model}, {layout.dtype}, block size {layout.block_size}, tp {layout.tp} x pp "
        f"{layout.pp} (rank {layout.rank}: blocks of {layout.block_shape})"
    )

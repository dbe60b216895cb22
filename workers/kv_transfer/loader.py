"""Writes the blocks a consumer pulled into this rank's KV cache, before the step's forward pass."""

from __future__ import annotations

import os

import torch

from enginecore.messages import ScheduledRequest


def load_pulled_blocks(kv_cache: torch.Tensor, reqs: list[ScheduledRequest], rank: int) -> None:
    """Each request's KVLoad: this rank's file holds (slots, 2, n, block_size, Hkv, row) of the
    cache's dtype; its blocks `src` go to the cache's blocks `dst`. The file goes once read."""
    for req in reqs:
        load = req.kv_load
        if load is None:
            continue
        path = load.paths[rank]
        slots, two, _, block_size, heads, row = kv_cache.shape
        data = torch.from_file(path, size=os.path.getsize(path), dtype=torch.uint8)
        os.unlink(path)
        blocks = data.view(kv_cache.dtype).view(slots, two, -1, block_size, heads, row)
        src = torch.tensor(load.src, dtype=torch.long)
        dst = torch.tensor(load.dst, dtype=torch.long, device=kv_cache.device)
        kv_cache.index_copy_(2, dst, blocks.index_select(2, src).to(kv_cache.device))

"""Writes the blocks a consumer pulled into this rank's KV cache, before the step's forward pass."""

from __future__ import annotations

import os

import torch

from enginecore.messages import ScheduledRequest


def load_pulled_blocks(
    kv_cache: torch.Tensor,
    reqs: list[ScheduledRequest],
    rank: int,
    draft_kv_cache: torch.Tensor | None = None,
) -> None:
    """Each request's KVLoad: this rank's file holds (slots, 2, n, block_size, Hkv, row) of the
    cache's dtype, then (KVLoad.num_draft_blocks) the draft model's n blocks as its cache holds
    them; block `src[i]` goes to the cache's block `dst[i]`. The file goes once read."""
    for req in reqs:
        load = req.kv_load
        if load is None:
            continue
        path = load.paths[rank]
        data = torch.from_file(path, size=os.path.getsize(path), dtype=torch.uint8)
        os.unlink(path)
        caches = [kv_cache]
        if load.num_draft_blocks:
            if draft_kv_cache is None:
                raise ValueError("pulled draft-model blocks, but this rank runs no draft model")
            caches.append(draft_kv_cache)
        block_bytes = [c[:, :, 0].numel() * c.element_size() for c in caches]
        n = data.numel() // sum(block_bytes)
        if n * sum(block_bytes) != data.numel():
            raise ValueError(f"{path} holds {data.numel()} bytes, not whole blocks")
        src = torch.tensor(load.src, dtype=torch.long)
        dst = torch.tensor(load.dst, dtype=torch.long, device=kv_cache.device)
        offset = 0
        for i, cache in enumerate(caches):
            part = data[offset : offset + n * block_bytes[i]]
            offset += n * block_bytes[i]
            shape = list(cache.shape)
            shape[2] = n
            blocks = part.view(cache.dtype).view(shape)
            pairs = len(load.src) if i == 0 else load.num_draft_blocks
            cache.index_copy_(2, dst[:pairs], blocks.index_select(2, src[:pairs]).to(cache.device))

"""How the attention layers share the paged KV cache when their windows differ.

A model whose layers all see every earlier key (or all the same window) keeps one block table per
request, and a block holds one block_size run of tokens for every attention layer. A model that
mixes windows (Gemma 2 / 3: sliding and full layers) would then keep a sliding layer's old keys as
long as the full layers need theirs. Instead its attention layers are split into KV-cache groups of
equal size, each group of one window: a request holds one block table per group, a block belongs
to one group at a time, and the scheduler gives a sliding group's blocks back to the pool once they
fall out of its window. Every layer's cache is then a view of the same (slots, 2, num_blocks, ...)
tensor: the i-th layer of any group uses slot i, through its own group's block table. Groups hold
as many layers as the least common window has (the last group of a window may be short), so a
block is the same size whatever group it serves.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroup:
    window: int | None  # keys q - window < k <= q; None: every earlier key
    layers: tuple[int, ...]  # global layer indices, in order


def plan_kv_cache_groups(windows: Mapping[int, int | None]) -> list[KVCacheGroup]:
    """Groups of the attention layers `windows` names (global index -> window); full attention
    first, so that a model with one window keeps a single group 0."""
    by_window: dict[int | None, list[int]] = {}
    for layer in sorted(windows):
        by_window.setdefault(windows[layer], []).append(layer)
    if len(by_window) <= 1:
        return [KVCacheGroup(w, tuple(layers)) for w, layers in by_window.items()] or [
            KVCacheGroup(None, ())
        ]
    size = min(len(layers) for layers in by_window.values())
    order = sorted(by_window, key=lambda w: (w is not None, w or 0))
    return [
        KVCacheGroup(w, tuple(by_window[w][i : i + size]))
        for w in order
        for i in range(0, len(by_window[w]), size)
    ]


def cache_slots(
    groups: list[KVCacheGroup], stage_layers: Collection[int]
) -> dict[int, tuple[int, int]]:
    """Layer -> (group, slot) for the attention layers of this pipeline stage: its slot is its
    rank among the stage's layers of its group."""
    out = {}
    for g, group in enumerate(groups):
        local = [layer for layer in group.layers if layer in stage_layers]
        for slot, layer in enumerate(local):
            out[layer] = (g, slot)
    return out

"""The block pool makes its blocks when first taken: it hands out the same blocks, evicts the same
cached prefixes and counts the same free blocks as the free list of every block made up front
(the eager model below, the pool as it was), under a random sequence of requests."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from enginecore.block_pool import BlockPool


class EagerPool:
    """Every block made at start, all in the free list in id order."""

    def __init__(self, num_blocks: int) -> None:
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.refs = [0] * num_blocks
        self.hash_of: dict[int, bytes] = {}
        self.cached: dict[bytes, int] = {}

    def take_new(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            h = self.hash_of.pop(block, None)
            if h is not None and self.cached.get(h) == block:
                del self.cached[h]
            self.refs[block] = 1
            out.append(block)
        return out

    def touch(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.refs[b] == 0:
                del self.free[b]
            self.refs[b] += 1

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free[b] = None

    def cache(self, block: int, h: bytes) -> None:
        if block in self.hash_of or h in self.cached:
            return
        self.hash_of[block] = h
        self.cached[h] = block


@pytest.mark.parametrize("seed", range(5))
def test_lazy_pool_behaves_as_the_eager_free_list(seed: int) -> None:
    rng = random.Random(seed)
    num_blocks = 64
    pool, eager = BlockPool(num_blocks, enable_caching=True), EagerPool(num_blocks)
    held: list[list] = []  # each request's blocks (the pool's), in order
    for _ in range(2000):
        assert pool.num_free_blocks == len(eager.free)
        op = rng.random()
        if op < 0.45 and pool.num_free_blocks:
            n = rng.randint(1, min(6, pool.num_free_blocks))
            blocks = pool.take_new(n)
            assert [b.block_id for b in blocks] == eager.take_new(n)
            for b in blocks:
                if rng.random() < 0.6:
                    h = bytes([rng.randrange(40)])  # few hashes: prefixes collide and evict
                    pool.cache(b, h)
                    eager.cache(b.block_id, h)
            held.append(blocks)
        elif op < 0.7 and held:
            blocks = held.pop(rng.randrange(len(held)))
            pool.release(list(reversed(blocks)))
            eager.release([b.block_id for b in reversed(blocks)])
        else:
            h = bytes([rng.randrange(40)])
            hit = pool.lookup(h)
            assert (hit.block_id if hit else None) == eager.cached.get(h)
            if hit is not None:
                pool.touch([hit])
                eager.touch([hit.block_id])
                held.append([hit])
    assert pool.num_cached_blocks == len(eager.cached)


def test_a_large_pool_starts_at_once_and_resets() -> None:
    pool = BlockPool(10_000_000, enable_caching=True)
    assert pool.num_free_blocks == 10_000_000
    blocks = pool.take_new(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    pool.cache(blocks[0], b"h")
    assert not pool.reset_prefix_cache()  # blocks in use
    pool.release(blocks)
    assert pool.num_free_blocks == 10_000_000
    assert pool.reset_prefix_cache() and pool.lookup(b"h") is None

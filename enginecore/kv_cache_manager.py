"""Per-request block tables on top of the block pool, and the prefix cache's hash chain.

The scheduler uses four verbs: `find_cached_prefix`, `allocate_slots`, `free`, `block_ids`. Reference
counts, hashing and eviction stay behind them.

A full block is identified by a chained hash: hash(parent block's hash, the block's token ids), so a
block matches only when the whole prefix before it matches too.
"""

from __future__ import annotations

import hashlib
from array import array

from enginecore.block_pool import BlockPool, KVBlock
from enginecore.request import Request


def hash_block(parent: bytes | None, token_ids: list[int]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self._req_blocks: dict[str, list[KVBlock]] = {}
        # How many leading blocks of each request are registered in the prefix cache.
        self._num_hashed_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._req_blocks.get(request_id, [])]

    def find_cached_prefix(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest run of cached full blocks at the start of the request, and its length in tokens.

        At least one token is always left to compute, since the step that computes it also yields the
        logits the next token is sampled from."""
        if not self.enable_prefix_caching:
            return [], 0
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counts a lookup once its request is actually scheduled (a blocked request looks up again)."""
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_blocks: list[KVBlock] | None = None
    ) -> list[int] | None:
        """Reserves room for num_new_tokens more tokens after request.num_computed_tokens (plus the cached
        prefix, for a request starting now). Returns the ids of the blocks added to the request's table
        (cached ones first), or None when the pool cannot supply them — then nothing changes."""
        cached_blocks = cached_blocks or []
        blocks = self._req_blocks.get(request.request_id, [])
        num_cached_tokens = len(cached_blocks) * self.block_size
        num_total_tokens = request.num_computed_tokens + num_cached_tokens + num_new_tokens
        num_needed = -(-num_total_tokens // self.block_size) - len(blocks) - len(cached_blocks)
        # Reused blocks with no other user sit in the free list: touching them takes them out of it.
        num_reused_free = sum(1 for b in cached_blocks if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_reused_free:
            return None
        self.pool.touch(cached_blocks)
        new_blocks = self.pool.take_new(max(num_needed, 0))
        blocks = blocks + cached_blocks + new_blocks
        self._req_blocks[request.request_id] = blocks
        self._cache_full_blocks(request, blocks, num_total_tokens)
        return [b.block_id for b in cached_blocks + new_blocks]

    def free(self, request: Request) -> None:
        blocks = self._req_blocks.pop(request.request_id, [])
        self._num_hashed_blocks.pop(request.request_id, None)
        self.pool.release(list(reversed(blocks)))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def invalidate_prefix_cache(self) -> None:
        """After a weight update or sleep: no block computed so far may be reused. Requests keep their
        own blocks; their hashed-block counters stay, so those blocks are never registered again."""
        self.pool.invalidate_cached()

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        """Registers the blocks that are full once this step's tokens are written."""
        if not self.enable_prefix_caching:
            return
        # Only tokens the engine already knows can be hashed; a decode step's input token is known.
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        self._update_block_hashes(request)
        start = self._num_hashed_blocks.get(request.request_id, 0)
        for i in range(start, num_full):
            self.pool.cache(blocks[i], request.block_hashes[i])
        self._num_hashed_blocks[request.request_id] = max(start, num_full)

    def _update_block_hashes(self, request: Request) -> None:
        hashes = request.block_hashes
        num_full = request.num_tokens // self.block_size
        while len(hashes) < num_full:
            i = len(hashes)
            start = i * self.block_size
            tokens = request.all_token_ids[start : start + self.block_size]
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens))

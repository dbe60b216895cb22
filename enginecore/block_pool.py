"""The pool of KV-cache blocks: reference counts, the free list in eviction order, and the prefix-cache map.

A block is free when no request references it. A free block may still hold a cached prefix (it keeps its
hash until it is handed out again), which is what makes LRU eviction free: the free list is ordered by
the time blocks were released, and new blocks are always taken from its front.

Blocks never handed out are made when first taken, in id order and before any released block (as if
the free list began with them all): a pool of a million blocks costs nothing to start (a tiny
model's 1 GiB cache is ~130,000 blocks: ~1 s to make them all up front).
"""

from __future__ import annotations

from collections import OrderedDict


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # The blocks handed out at least once, by id; ids from len(self._made) on were never taken
        # and are free, uncached and ahead of every released block in the free order.
        self._made: list[KVBlock] = []
        # NOTE: holds exactly the made blocks with ref_cnt == 0, least recently released first.
        self._free: OrderedDict[int, KVBlock] = OrderedDict()
        self._cached: dict[bytes, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - len(self._made) + len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self._cached.get(block_hash)

    def take_new(self, n: int) -> list[KVBlock]:
        """Hands out n free blocks (evicting the least recently used cached prefixes among them)."""
        assert n <= self.num_free_blocks, "caller must check num_free_blocks"
        out = []
        for _ in range(n):
            if len(self._made) < self.num_blocks:
                block = KVBlock(len(self._made))
                self._made.append(block)
            else:
                _, block = self._free.popitem(last=False)
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Takes a reference on cached blocks reused by a request."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: list[KVBlock]) -> None:
        """Drops a reference. Callers pass a request's blocks tail first, so that the tail of a prefix
        (least likely to be shared) is evicted before its head."""
        for block in blocks:
            assert block.ref_cnt > 0, block
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache(self, block: KVBlock, block_hash: bytes) -> None:
        """Marks a full block as holding the prefix identified by block_hash."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # another block already holds this prefix; this one stays private
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix. Refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self._made:
            block.block_hash = None
        self._cached.clear()
        return True

    def invalidate_cached(self) -> None:
        """Forgets every cached prefix, in use or not (the weights that computed them changed).
        Blocks in use stay with their requests but are never shared again."""
        for block in self._made:
            block.block_hash = None
        self._cached.clear()

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None

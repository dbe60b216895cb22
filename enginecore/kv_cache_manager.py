"""Per-request block tables on top of the block pool, and the prefix cache's hash chain.

The scheduler uses three verbs: `find_cached_prefix`, `allocate_slots`, `free`. Reference
counts, hashing and eviction stay behind them.

A full block is identified by a chained hash: hash(parent block's hash, the block's token ids, the
content hashes of the images whose placeholders it holds), so a block matches only when the whole
prefix before it matches too, images included.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from enginecore.block_pool import BlockPool, KVBlock
from enginecore.request import Request
from enginecore.routing import RoutingCache
from enginecore.state_checkpoints import StateCheckpoints


def hash_block(parent: bytes | None, token_ids: list[int], mm_hashes: Sequence[str] = ()) -> bytes:
    """`mm_hashes`: the images whose placeholders the block holds: the same placeholder ids
    standing for another image are another block."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(array("q", token_ids).tobytes())
    for mm_hash in mm_hashes:
        h.update(mm_hash.encode())
    return h.digest()


class KVCacheManager:
    """Block tables of the running requests, one per KV-cache group of the model
    (workers/models/kv_cache_groups.py): a group of sliding-window layers gives its blocks back to the
    pool once no query can see them any more, so its share of a long request stays bounded by
    the window. Positions whose block went back read as None here and block 0 on the workers:
    window masks keep every query off them. A producer's lent prompt (prefill/decode
    disaggregation: `kv_lease_id`) keeps all of them: its consumer pulls every group's blocks.

    On a hybrid model (`checkpoints`), a cached prefix must also end where its linear-attention
    states were checkpointed; when routing is recorded (`routing`), it must cover blocks whose
    routing rows are kept."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        group_windows: Sequence[int | None] = (None,),
        checkpoints: StateCheckpoints | None = None,
        routing: RoutingCache | None = None,
        whole_image_spans: bool = False,
    ) -> None:
        """whole_image_spans: a cached prefix never ends inside an image's placeholders (models
        that attend inside them in both directions: model_task.WHOLE_IMAGE_SPAN_ARCHITECTURES)."""
        self.block_size = block_size
        self.whole_image_spans = whole_image_spans
        self.enable_prefix_caching = enable_prefix_caching
        self.checkpoints = checkpoints
        self.routing = routing
        self.group_windows = list(group_windows)
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self._req_blocks: dict[str, list[list[KVBlock | None]]] = {}
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

    def find_cached_prefix(self, request: Request) -> tuple[list[list[KVBlock | None]], int]:
        """The longest cached prefix of the request in whole blocks, each group's blocks of it,
        and its length in tokens. Full-attention groups need every block of it cached, sliding
        groups only those their window still sees from the first token left to compute.

        At least one token is always left to compute, since the step that computes it also yields the
        logits the next token is sampled from."""
        if not self.enable_prefix_caching:
            return [], 0
        self._update_block_hashes(request)
        hashes = request.block_hashes[: (request.num_tokens - 1) // self.block_size]
        n = len(hashes)
        if self.routing is not None:
            n = next((i for i, h in enumerate(hashes) if not self.routing.has(h)), n)
        for g, window in enumerate(self.group_windows):
            if window is None:
                n = next(
                    (i for i, h in enumerate(hashes[:n]) if self.pool.lookup(_key(g, h)) is None),
                    n,
                )
        checkpoints = self.checkpoints
        while n > 0 and not (
            all(
                self.pool.lookup(_key(g, h)) is not None
                for g, window in enumerate(self.group_windows)
                if window is not None
                for h in hashes[self._first_visible_block(n * self.block_size, window) : n]
            )
            and (checkpoints is None or checkpoints.is_ready(hashes[n - 1]))
            and not (self.whole_image_spans and request.image_span_at(n * self.block_size))
        ):
            n -= 1
        hits = []
        for g, window in enumerate(self.group_windows):
            first = 0 if window is None else self._first_visible_block(n * self.block_size, window)
            hits.append([None] * first + [self.pool.lookup(_key(g, h)) for h in hashes[first:n]])
        return hits, n * self.block_size

    def restore_checkpoint(self, request: Request, num_cached_tokens: int) -> int:
        """The state checkpoint a request whose first num_cached_tokens come from the prefix
        cache starts from (-1: none needed)."""
        if self.checkpoints is None or num_cached_tokens == 0:
            return -1
        slot = self.checkpoints.lookup(
            request.block_hashes[num_cached_tokens // self.block_size - 1]
        )
        assert slot is not None, "find_cached_prefix ends hits at checkpoints"
        return slot

    def checkpoints_to_save(self, request: Request, start: int, end: int) -> list[list[int]]:
        """[tokens after `start`, checkpoint] where the chunk [start, end) of a request crosses a
        boundary whose states are to be kept and are not yet."""
        if self.checkpoints is None:
            return []
        bs, interval = self.block_size, self.checkpoints.interval
        last_prompt_block = (request.num_prompt_tokens - 1) // bs * bs
        saves = []
        for pos in range((start // bs + 1) * bs, end + 1, bs):
            if pos % interval and pos != last_prompt_block:
                continue
            prefix_hash = request.block_hashes[pos // bs - 1]
            if self.checkpoints.is_ready(prefix_hash) or self.checkpoints.is_pending(prefix_hash):
                continue
            slot = self.checkpoints.reserve(prefix_hash)
            if slot is not None:
                saves.append([pos - start, slot])
        return saves

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counts a lookup once its request is actually scheduled (a blocked request looks up again)."""
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        cached_blocks: list[list[KVBlock | None]] | None = None,
    ) -> list[list[int]] | None:
        """Reserves room for num_new_tokens more tokens after request.num_computed_tokens (plus the cached
        prefix, for a request starting now). Returns, per group, the ids of the blocks added to the
        request's table (cached ones first; 0 where a block is out of the window), or None when the
        pool cannot supply them — then nothing changes but blocks no window sees any more."""
        num_groups = len(self.group_windows)
        cached_blocks = cached_blocks or [[] for _ in range(num_groups)]
        tables = self._req_blocks.get(request.request_id) or [[] for _ in range(num_groups)]
        num_cached_tokens = len(cached_blocks[0]) * self.block_size
        first_pos = request.num_computed_tokens + num_cached_tokens  # this step's first query
        if request.kv_lease_id is None:  # a producer's lent prompt keeps every block
            self._release_out_of_window(tables, first_pos)
        num_total_tokens = first_pos + num_new_tokens
        num_blocks = -(-num_total_tokens // self.block_size)
        needed = [max(num_blocks - len(t) - len(c), 0) for t, c in zip(tables, cached_blocks)]
        reused = [b for blocks in cached_blocks for b in blocks if b is not None]
        # Reused blocks with no other user sit in the free list: touching them takes them out of it.
        num_reused_free = sum(1 for b in reused if b.ref_cnt == 0)
        if sum(needed) > self.pool.num_free_blocks - num_reused_free:
            return None
        self.pool.touch(reused)
        new_ids = []
        for g, n in enumerate(needed):
            new_blocks = self.pool.take_new(n)
            tables[g] = tables[g] + cached_blocks[g] + new_blocks
            new_ids.append([0 if b is None else b.block_id for b in cached_blocks[g] + new_blocks])
        self._req_blocks[request.request_id] = tables
        self._cache_full_blocks(request, tables, num_total_tokens)
        return new_ids

    def block_ids(self, request: Request, group: int = 0) -> list[int]:
        """The request's blocks of KV-cache group `group`, in order (those in its window)."""
        tables = self._req_blocks.get(request.request_id)
        return [b.block_id for b in tables[group] if b is not None] if tables else []

    def free(self, request: Request) -> None:
        tables = self._req_blocks.pop(request.request_id, [])
        self._num_hashed_blocks.pop(request.request_id, None)
        for table in tables:
            self.pool.release([b for b in reversed(table) if b is not None])

    def reset_prefix_cache(self) -> bool:
        if not self.pool.reset_prefix_cache():
            return False
        if self.checkpoints is not None:
            self.checkpoints.clear()
        if self.routing is not None:
            self.routing.clear()
        return True

    def invalidate_prefix_cache(self) -> None:
        """After a weight update or sleep: no block computed so far may be reused. Requests keep their
        own blocks; their hashed-block counters stay, so those blocks are never registered again."""
        self.pool.invalidate_cached()
        if self.checkpoints is not None:
            self.checkpoints.clear()
        if self.routing is not None:
            self.routing.clear()

    def _first_visible_block(self, first_pos: int, window: int) -> int:
        """The first block a query at first_pos or later can see through `window`."""
        return max(first_pos - window + 1, 0) // self.block_size

    def _release_out_of_window(self, tables: list[list[KVBlock | None]], first_pos: int) -> None:
        for window, table in zip(self.group_windows, tables):
            if window is None:
                continue
            end = min(self._first_visible_block(first_pos, window), len(table))
            gone = [b for b in table[:end] if b is not None]
            if gone:
                table[:end] = [None] * end
                self.pool.release(gone)

    def _cache_full_blocks(
        self, request: Request, tables: list[list[KVBlock | None]], num_tokens: int
    ) -> None:
        """Registers the blocks that are full once this step's tokens are written."""
        if not self.enable_prefix_caching:
            return
        # Only tokens the engine already knows can be hashed; a decode step's input token is known.
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        self._update_block_hashes(request)
        start = self._num_hashed_blocks.get(request.request_id, 0)
        for g, table in enumerate(tables):
            for i in range(start, num_full):
                if table[i] is not None:
                    self.pool.cache(table[i], _key(g, request.block_hashes[i]))
        self._num_hashed_blocks[request.request_id] = max(start, num_full)

    def _update_block_hashes(self, request: Request) -> None:
        hashes = request.block_hashes
        num_full = request.num_tokens // self.block_size
        while len(hashes) < num_full:
            i = len(hashes)
            start = i * self.block_size
            tokens = request.all_token_ids[start : start + self.block_size]
            # A request on a LoRA adapter chains from the adapter's own root: its blocks are
            # never another adapter's (or the base model's).
            root = request.lora.cache_root if request.lora is not None else None
            mm_hashes = (
                request.mm_hashes_in(start, start + self.block_size) if request.mm_items else ()
            )
            hashes.append(hash_block(hashes[-1] if hashes else root, tokens, mm_hashes))


def servable_len(
    model_len: int,
    num_blocks: int,
    block_size: int,
    windows: Sequence[int | None],
    max_step_tokens: int,
) -> int:
    """The longest sequence one request can reach in `num_blocks` blocks: a full-attention group
    holds all of it, a sliding group at most its window and one step's tokens."""

    def blocks_for(length: int) -> int:
        step = min(length, max_step_tokens)
        return sum(
            -(-length // block_size) if w is None else -(-(w - 1 + step) // block_size) + 1
            for w in windows
        )

    lo, hi = 0, model_len  # blocks_for grows with the length: the longest that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if blocks_for(mid) <= num_blocks else (lo, mid - 1)
    return lo


def _key(group: int, block_hash: bytes) -> bytes:
    """The prefix-cache key of a block of `group` holding the prefix `block_hash` names."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")

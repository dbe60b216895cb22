"""Routing replay for RL on mixture-of-experts models (--enable-return-routed-experts).

A trainer that recomputes a rollout's logprobs must route each token to the experts the rollout
used, or the two policies drift apart. The workers report, for every token a step computes, the
top-k experts of every MoE layer (ModelRunnerOutput.routed_experts); each request keeps the rows
of its positions in order (`RequestRouting`), and each of its outputs carries the rows added since
the one before (EngineCoreOutput.routed_experts). The frontend joins them and answers the rows of
every token the model computed for the tokens it returns: the prompt and the outputs but the
last, (tokens - 1, layers, top_k); a stop string cuts them where it cuts the tokens.

A position's row is the first one computed for it: after a preemption the recomputed prefix keeps
the rows the request's tokens were generated with. A prefix-cache hit computes nothing for its
positions, so the rows of cached blocks are kept beside them (`RoutingCache`, keyed by the block's
prefix hash, least recently used first out) and a hit ends where they run out: rows are copied,
never invented.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from enginecore.messages import RoutedExperts, RoutingShape


class RoutingCache:
    """The routing rows of cached prefix blocks, by block hash."""

    def __init__(self, capacity: int, block_size: int, row_bytes: int) -> None:
        self.capacity = capacity
        self.block_bytes = block_size * row_bytes
        self._rows: OrderedDict[bytes, bytes] = OrderedDict()

    def has(self, block_hash: bytes) -> bool:
        return block_hash in self._rows

    def get(self, block_hash: bytes) -> bytes:
        self._rows.move_to_end(block_hash)
        return self._rows[block_hash]

    def put(self, block_hash: bytes, rows: bytes) -> None:
        assert len(rows) == self.block_bytes
        self._rows[block_hash] = rows
        self._rows.move_to_end(block_hash)
        while len(self._rows) > self.capacity:
            self._rows.popitem(last=False)

    def clear(self) -> None:
        self._rows.clear()


class RequestRouting:
    """One request's rows, position by position."""

    def __init__(self, shape: RoutingShape) -> None:
        self.shape = shape
        self.rows = bytearray()
        self.num_cached_blocks = 0  # leading blocks whose rows are in the RoutingCache
        self._num_sent = 0  # bytes of rows already handed to an output

    @property
    def num_rows(self) -> int:
        return len(self.rows) // self.shape.row_bytes

    def add(self, start: int, data: bytes) -> None:
        """Rows of positions start, start + 1, ...: those not known yet are kept."""
        have = self.num_rows
        assert start <= have, f"routing from position {start}, {have} known"
        skip = (have - start) * self.shape.row_bytes
        if skip < len(data):
            self.rows += data[skip:]

    def rows_of(self, start: int, end: int) -> bytes:
        """The rows of positions [start, end)."""
        n = self.shape.row_bytes
        return bytes(self.rows[start * n : end * n])

    def cache_blocks(self, cache: RoutingCache, block_hashes: Sequence[bytes], block_size: int):
        """Hands the rows of its full blocks to the cache."""
        num_full = min(self.num_rows // block_size, len(block_hashes))
        for i in range(self.num_cached_blocks, num_full):
            start = i * cache.block_bytes
            cache.put(block_hashes[i], bytes(self.rows[start : start + cache.block_bytes]))
        self.num_cached_blocks = max(self.num_cached_blocks, num_full)

    def take_new(self) -> RoutedExperts:
        """The rows added since the last call, for the request's next output."""
        s, data = self.shape, bytes(self.rows[self._num_sent :])
        self._num_sent = len(self.rows)
        return RoutedExperts(data, s.num_layers, s.top_k, s.num_experts)

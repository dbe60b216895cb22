"""A producer's lent blocks: the prompts it computed for consumers, held until they are released.

A producing request that finishes normally keeps its blocks (its table, prompt and outputs) under
its lease instead of freeing them; the consumer releases the lease once it has pulled them, and a
lease nobody releases ends after lease_s (a consumer that died or gave up; vLLM frees a NIXL
producer's blocks after VLLM_NIXL_ABORT_REQUEST_TIMEOUT the same way).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from enginecore.request import Request


class KVLeases:
    def __init__(self, lease_s: float, free: Callable[[Request], None]) -> None:
        """free: gives a request's blocks back to the pool (KVCacheManager.free)."""
        self.lease_s = lease_s
        self._free = free
        self._held: dict[str, tuple[Request, float]] = {}  # lease id -> (request, deadline)
        self.num_lent_total = 0

    def __len__(self) -> int:
        return len(self._held)

    def lend(self, lease_id: str, request: Request) -> None:
        if lease_id in self._held:  # a lease id used twice: the older blocks go
            self.release(lease_id)
        self._held[lease_id] = (request, time.monotonic() + self.lease_s)
        self.num_lent_total += 1

    def holds(self, lease_id: str | None) -> bool:
        return lease_id in self._held

    def release(self, lease_id: str) -> bool:
        held = self._held.pop(lease_id, None)
        if held is None:
            return False
        self._free(held[0])
        return True

    def expire(self, now: float | None = None) -> list[str]:
        """Ends the leases whose time is up; returns their ids. Called every step: it looks at
        the oldest leases only (held in lending order, which is deadline order: one lease_s)."""
        if not self._held:
            return []
        now = time.monotonic() if now is None else now
        ended = []
        for lease_id, (_, deadline) in self._held.items():
            if deadline > now:
                break
            ended.append(lease_id)
        for lease_id in ended:
            self.release(lease_id)
        return ended

    def release_all(self) -> None:
        """Before the prefix cache is invalidated or the pool reset (sleep, weight update):
        lent blocks were computed with the weights that are going."""
        for lease_id in list(self._held):
            self.release(lease_id)

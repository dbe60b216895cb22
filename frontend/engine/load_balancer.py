"""Which replica serves a request (--dp > 1): the least loaded one, unless a replica that probably
holds the prompt's prefix in its KV cache is nearly as free.

Load is what the frontend knows without asking: first the requests it has in flight on the replica
(waiting + running: exact and current, where the engine's own counts are up to 0.5 s old), then the
replica's KV-cache usage from its last SchedulerStats (long prompts fill it before the count shows
it), then a rotating index, so that idle replicas take turns.

Prefix affinity. The first MAX_AFFINITY_BLOCKS full blocks of a prompt are hashed as a chain (the
hash of block i covers blocks 0..i and the images whose placeholders they hold, as the KV cache's
own block hashes do: the same placeholder ids standing for another image are another prefix), and
each hash remembers which replicas were sent a prompt starting so (an LRU of MAX_ENTRIES hashes).
A new prompt goes to the least loaded replica among those holding its longest remembered prefix,
if that one has at most AFFINITY_SLACK more requests in flight than the least loaded replica of
all; otherwise to the least loaded, which then holds the prefix too (a popular prefix spreads
over the replicas as load requires). What a replica evicted from its cache is unknown here: the
memory is a guess, right often enough to pay (scripts/bench_dp.py --shared-prefix measures the
hit rate) and harmless when wrong (the prompt is computed). It is forgotten for a replica that dies, and for every replica when
their caches are reset (weight updates, reset_prefix_cache, sleep).
This module knows nothing about processes or sockets.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from enginecore.messages import MultiModalItem

MAX_AFFINITY_BLOCKS = 64
MAX_ENTRIES = 1 << 16
# In requests in flight: how much busier than the least loaded replica the one holding a prompt's
# prefix may be and still get it. A cached block saves a block of prefill; a queue of AFFINITY_SLACK
# more requests costs them a share of a step each, so the slack stays small.
AFFINITY_SLACK = 4
REASONS = ("prefix", "load")


@dataclass(frozen=True)
class ReplicaLoad:
    num_in_flight: int
    kv_cache_usage: float  # 0..1, from the replica's last SchedulerStats


class LoadBalancer:
    def __init__(self, num_replicas: int, block_size: int, slack: int = AFFINITY_SLACK) -> None:
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.slack = slack
        # Routing decisions per replica and reason: metrics (frontend/common/metrics.py) and the benchmark.
        self.num_routed = [dict.fromkeys(REASONS, 0) for _ in range(num_replicas)]
        self._holders: OrderedDict[int, int] = OrderedDict()  # prefix hash -> bitmask of replicas
        self._turn = 0

    def choose(
        self,
        prompt_token_ids: Sequence[int],
        loads: Sequence[ReplicaLoad | None],
        images: Sequence[MultiModalItem] = (),
    ) -> int:
        """The replica for a prompt (and its images); `loads[i]` is None for a replica that cannot
        serve (dead)."""
        alive = [i for i, load in enumerate(loads) if load is not None]
        if not alive:
            raise ValueError("no replica can serve")
        self._turn = (self._turn + 1) % self.num_replicas

        def key(i: int) -> tuple[int, float, int]:
            load = loads[i]
            assert load is not None
            return load.num_in_flight, round(load.kv_cache_usage, 2), (i - self._turn) % len(loads)

        least = min(alive, key=key)
        hashes = self._prefix_hashes(prompt_token_ids, images)
        chosen, reason = least, "load"
        alive_mask = sum(1 << i for i in alive)
        for h in reversed(hashes):  # the longest remembered prefix first
            mask = self._holders.get(h, 0) & alive_mask
            if not mask:
                continue
            best = min((i for i in alive if mask >> i & 1), key=key)
            if key(best)[0] <= key(least)[0] + self.slack:
                chosen, reason = best, "prefix"
            break
        self._remember(hashes, chosen)
        self.num_routed[chosen][reason] += 1
        return chosen

    def forget(self, replica: int | None = None) -> None:
        """Drops what is remembered of one replica's cache (it died), or of every one's (reset)."""
        if replica is None:
            self._holders.clear()
            return
        keep = ~(1 << replica)
        for h in list(self._holders):
            mask = self._holders[h] & keep
            if mask:
                self._holders[h] = mask
            else:
                del self._holders[h]

    def _prefix_hashes(
        self, token_ids: Sequence[int], images: Sequence[MultiModalItem] = ()
    ) -> list[int]:
        n = min(len(token_ids) // self.block_size, MAX_AFFINITY_BLOCKS)
        hashes, h = [], 0
        for b in range(n):
            lo, hi = b * self.block_size, (b + 1) * self.block_size
            held = tuple(
                item.content_hash
                for item in images
                if any(start < hi and lo < start + length for start, length in item.spans)
            )
            h = hash((h, tuple(token_ids[lo:hi]), held))
            hashes.append(h)
        return hashes

    def _remember(self, hashes: list[int], replica: int) -> None:
        bit = 1 << replica
        for h in hashes:
            self._holders[h] = self._holders.get(h, 0) | bit
            self._holders.move_to_end(h)
        while len(self._holders) > MAX_ENTRIES:
            self._holders.popitem(last=False)

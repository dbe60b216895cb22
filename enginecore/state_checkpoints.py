"""Linear-attention state checkpoints: what lets a hybrid model's prefix cache skip a prefix.

A cached KV block restores a prefix's attention, not its linear-attention layers' per-sequence
state (Gated DeltaNet's conv and recurrent states), which sums up every token before it. So the
workers copy a sequence's states, as they stand after a block boundary, into one of
`num_slots` checkpoint rows, and a prefix-cache hit may end only where such a checkpoint exists:
the worker copies it into the request's own state row before computing the rest.

Checkpoints are taken at multiples of `interval` tokens (a multiple of the block size, chosen by
the workers so one checkpoint costs about the KV cache of the tokens it saves recomputing) and at
the last block boundary before a prompt's last token, where a repeated prompt (n > 1, a GRPO
group, a retry) or the next turn of a conversation finds it.

They are keyed like blocks, by the chained hash of the prefix they end, and evicted least
recently used first, except those pinned: a producer's (prefill/decode disaggregation) lease
pins the checkpoint its consumer pulls until the lease ends. A checkpoint becomes visible only
once the step that writes it has run: a request scheduled in that same step would otherwise read
it before it is written.
"""

from __future__ import annotations

from collections import OrderedDict


class StateCheckpoints:
    def __init__(self, num_slots: int, interval: int) -> None:
        self.num_slots = num_slots
        self.interval = interval
        # Checkpoints written, least recently used first; and those the running step writes.
        self._ready: OrderedDict[bytes, int] = OrderedDict()
        self._pending: dict[bytes, int] = {}
        self._free = list(reversed(range(num_slots)))
        self._pins: dict[bytes, int] = {}  # pinned checkpoints: how many leases hold each

    @property
    def num_used(self) -> int:
        return len(self._ready) + len(self._pending)

    def lookup(self, prefix_hash: bytes) -> int | None:
        """The slot holding the state after the prefix `prefix_hash` names (marked used)."""
        slot = self._ready.get(prefix_hash)
        if slot is not None:
            self._ready.move_to_end(prefix_hash)
        return slot

    def is_ready(self, prefix_hash: bytes) -> bool:
        return prefix_hash in self._ready

    def is_pending(self, prefix_hash: bytes) -> bool:
        return prefix_hash in self._pending

    def reserve(self, prefix_hash: bytes) -> int | None:
        """A slot for the running step to write the state after `prefix_hash` into, evicting the
        least recently used checkpoint; None when every slot is being written this step."""
        if self._free:
            slot = self._free.pop()
        else:
            unpinned = next((h for h in self._ready if h not in self._pins), None)
            if unpinned is None:
                return None
            slot = self._ready.pop(unpinned)
        self._pending[prefix_hash] = slot
        return slot

    def pin(self, prefix_hash: bytes) -> int | None:
        """The slot of a written checkpoint, kept from eviction until unpin; None if there is
        none."""
        slot = self._ready.get(prefix_hash)
        if slot is not None:
            self._pins[prefix_hash] = self._pins.get(prefix_hash, 0) + 1
        return slot

    def unpin(self, prefix_hash: bytes) -> None:
        count = self._pins.pop(prefix_hash, 0) - 1
        if count > 0:
            self._pins[prefix_hash] = count

    def publish(self) -> None:
        """The step that wrote the pending checkpoints has run: they may be restored."""
        self._ready.update(self._pending)
        self._pending.clear()

    def clear(self) -> None:
        """Forgets every checkpoint (the weights that computed them changed, or the states were
        freed). Called between steps: no slot is being written."""
        self._ready.clear()
        self._pending.clear()
        self._pins.clear()
        self._free = list(reversed(range(self.num_slots)))

"""LoRA adapters on the engine core: which are served, which worker slot holds each, and which
requests run on which version.

An adapter is served under a name; loading a name again makes a new version: requests that arrive
from then on run on it, those already queued or running finish on the version they started with
(each keeps its `Adapter`, whose slot stays taken until its last request ends). Unloading a name
works the same way: new requests can no longer name it, the ones in flight finish first.

The workers hold `LoraConfig.num_slots` adapters (--max-cpu-loras, default --max-loras); an
adapter without a slot (evicted, least recently used first, while no running request used it) is
loaded again from its source — a path, or the tensors it was pushed with — before a request on it
is admitted. At most --max-loras distinct adapters run in one step (the scheduler's rule).
Each load has its own `uid`: the prefix cache keys a request's blocks by it, so a block computed
with one adapter (or version) is never reused under another.

`adapter_spec` reads PEFT's adapter_config.json; what tern cannot serve exactly is refused here.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from enginecore.config import LoraConfig
from enginecore.messages import ControlCall, LoadLora

logger = logging.getLogger("tern.engine")

# The projections tern's layers apply adapters to (PEFT's module names; Phi-3's fused ones too).
SERVED_MODULES = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
     "qkv_proj", "gate_up_proj"}
)  # fmt: skip


class LoraError(ValueError):
    """An adapter tern cannot serve, or a name it does not know."""


class NoFreeSlot(LoraError):
    """Every slot holds an adapter that running requests use."""


def read_adapter_config(path: str) -> dict[str, Any]:
    file = Path(path) / "adapter_config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise LoraError(f"cannot read {file} (a PEFT adapter directory has one): {e}") from None
    if not isinstance(config, dict):
        raise LoraError(f"{file} is not a JSON object")
    return config


def adapter_spec(config: dict[str, Any], max_rank: int = 256) -> tuple[int, float]:
    """(rank, scaling) of a PEFT adapter_config.json; LoraError naming what tern cannot serve."""
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"peft_type {config.get('peft_type')!r} is not LoRA")
    if config.get("use_dora"):
        raise LoraError("DoRA adapters (use_dora) are not supported")
    if config.get("bias", "none") != "none":
        raise LoraError(f"adapters that train biases (bias={config['bias']!r}) are not supported")
    if config.get("modules_to_save"):
        raise LoraError(f"modules_to_save {config['modules_to_save']} are not supported")
    for key in ("rank_pattern", "alpha_pattern", "layers_to_transform", "layer_replication"):
        if config.get(key):
            raise LoraError(f"{key} is not supported")
    if config.get("fan_in_fan_out"):
        raise LoraError("fan_in_fan_out adapters (Conv1D layers) are not supported")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - SERVED_MODULES)
        if unknown:
            raise LoraError(
                f"target modules {unknown} are not served with LoRA "
                f"(tern applies adapters to {sorted(SERVED_MODULES)})"
            )
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoraError(f"r must be a positive integer, not {rank!r}")
    if rank > max_rank:
        raise LoraError(f"the adapter's rank {rank} exceeds --max-lora-rank {max_rank}")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, int | float):
        raise LoraError(f"lora_alpha must be a number, not {alpha!r}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling)


@dataclass(eq=False)
class Adapter:
    name: str
    version: str
    uid: int
    source: LoadLora  # its load call, the slot left to fill in
    slot: int = -1
    requests: int = 0  # queued or running on this version
    retired: bool = False  # replaced by a newer version, or unloaded
    pinned: bool = False  # never evicted
    last_used: float = field(default_factory=time.monotonic)

    @property
    def cache_root(self) -> bytes:
        return f"lora:{self.uid}".encode()


class LoraRegistry:
    def __init__(self, config: LoraConfig, run: Callable[[ControlCall], None]) -> None:
        """`run` sends a call to every worker rank and raises LoraError when one fails."""
        self.config = config
        self._run = run
        self.current: dict[str, Adapter] = {}
        self.staged: dict[str, Adapter] = {}  # loaded, not yet served (load with stage=True)
        self.slots: list[Adapter | None] = [None] * config.num_slots
        self._uids = itertools.count(1)
        self._versions: dict[str, int] = {}

    # ------------------------------------------------------------------ served names

    def load(
        self,
        name: str,
        source: LoadLora,
        version: str | None,
        busy: Iterable[Adapter],
        replace: bool = True,
        pinned: bool = False,
        stage: bool = False,
    ) -> Adapter:
        """Serves `source` as `name` (a new version when the name is served already and
        `replace`), loaded into a slot now so that a bad adapter fails here, not in a request.
        `stage`: loaded but not served until finish_staged (--dp: every replica loads, then all
        serve it, or none)."""
        if name in self.current and not replace:
            raise LoraError(
                f"the LoRA adapter {name!r} has already been loaded (load_inplace=true replaces it)"
            )
        if source.rank > self.config.max_lora_rank:
            raise LoraError(
                f"the adapter's rank {source.rank} exceeds --max-lora-rank "
                f"{self.config.max_lora_rank}"
            )
        # NOTE: a broadcast cannot be received twice: such an adapter is never evicted.
        pinned = pinned or source.broadcast is not None
        number = self._versions.get(name, 0) + 1
        adapter = Adapter(name, version or str(number), next(self._uids), source, pinned=pinned)
        self._place(adapter, set(busy))
        self._versions[name] = number
        if stage:
            if (earlier := self.staged.pop(name, None)) is not None:
                self._retire(earlier)
            self.staged[name] = adapter
        else:
            self._serve(adapter)
        return adapter

    def finish_staged(self, name: str, commit: bool) -> Adapter:
        """Serves the adapter staged as `name` (commit), or drops it."""
        adapter = self.staged.pop(name, None)
        if adapter is None:
            raise LoraError(f"no load of LoRA adapter {name!r} is staged")
        if commit:
            self._serve(adapter)
        else:
            self._retire(adapter)
        return adapter

    def _serve(self, adapter: Adapter) -> None:
        old = self.current.get(adapter.name)
        self.current[adapter.name] = adapter
        if old is not None:
            self._retire(old)
        logger.info(
            "LoRA adapter %r version %s in slot %d", adapter.name, adapter.version, adapter.slot
        )

    def unload(self, name: str) -> None:
        adapter = self.current.pop(name, None)
        if adapter is None:
            raise LoraError(f"no LoRA adapter named {name!r} is loaded")
        self._retire(adapter)

    def acquire(self, name: str) -> Adapter:
        """The version a new request on `name` runs on."""
        adapter = self.current.get(name)
        if adapter is None:
            raise LoraError(f"no LoRA adapter named {name!r} is loaded")
        adapter.requests += 1
        adapter.last_used = time.monotonic()
        return adapter

    def release(self, adapter: Adapter) -> None:
        adapter.requests -= 1
        if adapter.retired and adapter.requests == 0:
            self._free(adapter)

    def ensure_loaded(self, adapter: Adapter, running: Iterable[Adapter]) -> bool:
        """Gives an evicted adapter a slot again (evicting an idle one); False when every slot
        holds an adapter a running request uses. LoraError: its source no longer loads."""
        if adapter.slot >= 0:
            return True
        try:
            self._place(adapter, set(running))
        except NoFreeSlot:
            return False
        return True

    def state(self) -> dict[str, dict[str, Any]]:
        return {
            name: {
                "version": a.version,
                "loaded": a.slot >= 0,
                "pinned": a.pinned,
                "path": a.source.path or None,
            }
            for name, a in self.current.items()
        }

    # ------------------------------------------------------------------ slots

    def _place(self, adapter: Adapter, busy: set[Adapter]) -> None:
        slot = next((i for i, a in enumerate(self.slots) if a is None), None)
        if slot is None:
            idle = [
                a
                for a in self.slots
                if a is not None and a not in busy and not (a.pinned and not a.retired)
            ]
            if not idle:
                raise NoFreeSlot(
                    f"all {len(self.slots)} adapter slots hold adapters running requests use "
                    "(raise --max-cpu-loras)"
                )
            # Retired versions first, then those no request waits for, then least recently used.
            victim = min(idle, key=lambda a: (not a.retired, a.requests > 0, a.last_used))
            slot = victim.slot
            self._evict(victim)
        self._run(
            msgspec.structs.replace(adapter.source, slot=slot)
        )  # NOTE: a slot a failed load left half-written is free: nothing reads it
        adapter.slot = slot
        adapter.last_used = time.monotonic()
        self.slots[slot] = adapter

    def _evict(self, adapter: Adapter) -> None:
        self.slots[adapter.slot] = None
        adapter.slot = -1
        logger.info("LoRA adapter %r version %s evicted", adapter.name, adapter.version)

    def _retire(self, adapter: Adapter) -> None:
        adapter.retired = True
        if adapter.requests == 0:
            self._free(adapter)

    def _free(self, adapter: Adapter) -> None:
        if adapter.slot >= 0:
            self._evict(adapter)

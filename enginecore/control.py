"""Control of an engine core for RL trainers: pause/resume, weight updates, sleep and wake-up.

Each utility call from the frontend becomes one or more control calls that every worker rank runs.
The state here decides when the engine may step:
- paused ("keep": nothing runs; "wait"/"abort": running requests finish or are aborted, new ones wait),
- asleep (KV cache and maybe the weights freed: nothing runs until woken),
- weights not valid (woken after sleep level 2, before new weights arrived),
- a bucketed weight update is open (between its first and its `finished` bucket).
Each control operation (an EngineControlOp, enginecore/messages.py) is answered by the handler its
type maps to in `EngineControl.handlers`, which returns the JSON answer of the HTTP route.
A weight update is a transaction on the workers: it commits on every rank or is rolled back on every
rank, so no step ever runs on half-updated weights. After a commit, every cached prefix computed with
the old weights is forgotten and the weight version changes; requests in flight continue with the
new weights unless the caller asked to abort them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgspec

from enginecore.core import EngineCore
from enginecore.lora import Adapter, LoraError
from enginecore.messages import (
    CommitWeights,
    ControlCall,
    DestroyWeightsUpdateGroup,
    EngineControlOp,
    EngineCoreOutput,
    FinishLoraLoad,
    FinishWeightsUpdate,
    GetControlState,
    GetStats,
    InitWeightsUpdateGroup,
    LoadLoraAdapter,
    PauseGeneration,
    ReleaseMemory,
    ResetPrefixCache,
    ResumeGeneration,
    ResumeMemory,
    Sleep,
    UnloadLoraAdapter,
    UpdateWeights,
    UtilityResult,
    WakeUp,
)

logger = logging.getLogger("tern.engine")

# SGLang's names: "in_place" is tern's "keep"; "retract" also frees the running requests' KV cache
# (they are recomputed after the resume and continue).
PAUSE_MODES = ("abort", "wait", "keep", "in_place", "retract")
# What sleep frees and wake-up brings back. tern has no CUDA graphs: "cuda_graph" (SGLang's third
# tag) holds no memory, so releasing or resuming it is done as soon as asked.
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
WAKE_TAGS = MEMORY_TAGS


class ControlError(ValueError):
    """The call failed; the engine is unchanged (or rolled back) and keeps serving."""


class EngineControl:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.pause_mode: str | None = None
        self.asleep_tags: set[str] = set()
        self.weights_valid = True
        self.update_open = False
        self.weight_version = "default"
        self._num_updates = 0
        self._deferred_pauses: list[int] = []  # call ids of "wait" pauses not answered yet
        self.handlers: dict[type, Callable[[Any, list[EngineCoreOutput]], object]] = {
            GetStats: lambda op, aborted: msgspec.to_builtins(self.core.stats()),
            GetControlState: lambda op, aborted: self.state(),
            PauseGeneration: self._pause,
            ResumeGeneration: self._resume,
            ResetPrefixCache: self._reset_prefix_cache,
            UpdateWeights: self._update_weights,
            FinishWeightsUpdate: self._finish_weights_update,
            InitWeightsUpdateGroup: self._init_weights_update_group,
            DestroyWeightsUpdateGroup: self._destroy_weights_update_group,
            ReleaseMemory: self._sleep,
            ResumeMemory: self._wake_up,
            LoadLoraAdapter: self._load_lora_adapter,
            FinishLoraLoad: self._finish_lora_load,
            UnloadLoraAdapter: self._unload_lora_adapter,
        }

    # ------------------------------------------------------------------ what the loop may do

    @property
    def can_run(self) -> bool:
        return (
            self.pause_mode not in ("keep", "in_place", "retract")
            and not self.asleep_tags
            and self.weights_valid
            and not self.update_open
        )

    @property
    def can_admit(self) -> bool:
        return self.can_run and self.pause_mode is None

    def is_busy(self) -> bool:
        s = self.core.scheduler
        if not self.can_run:
            return False
        return s.has_started_requests or (bool(s.waiting) and self.can_admit)

    def poll_deferred(self) -> list[UtilityResult]:
        """Answers "wait" pauses once nothing runs any more."""
        if not self._deferred_pauses or self.core.scheduler.has_started_requests:
            return []
        done, self._deferred_pauses = self._deferred_pauses, []
        return [UtilityResult(call_id, self.state()) for call_id in done]

    def state(self) -> dict[str, Any]:
        return {
            "paused": self.pause_mode,
            "is_sleeping": bool(self.asleep_tags),
            "asleep_tags": sorted(self.asleep_tags),
            "weights_valid": self.weights_valid,
            "update_open": self.update_open,
            "weight_version": self.weight_version,
            "lora_adapters": self.core.loras.state() if self.core.loras is not None else {},
        }

    # ------------------------------------------------------------------ the calls

    def handle(
        self, call_id: int, op: EngineControlOp, aborted: list[EngineCoreOutput]
    ) -> UtilityResult | None:
        """Runs one operation. Requests it aborts go to `aborted`. None: the answer comes later."""
        try:
            result = self.handlers[type(op)](op, aborted)
        except (ControlError, LoraError) as e:
            return UtilityResult(call_id, error=str(e))
        if result is _DEFERRED:
            self._deferred_pauses.append(call_id)
            return None
        return UtilityResult(call_id, result)

    def _abort_all(self, aborted: list[EngineCoreOutput]) -> None:
        s = self.core.scheduler
        ids = [r.request_id for r in list(s.running) + list(s.waiting)]
        aborted.extend(self.core.abort_requests(ids))

    def _pause(self, op: PauseGeneration, aborted: list[EngineCoreOutput]) -> object:
        mode = op.mode
        if mode not in PAUSE_MODES:
            raise ControlError(f"mode must be one of {PAUSE_MODES}, not {mode!r}")
        self.pause_mode = mode
        if mode == "abort":
            self._abort_all(aborted)
        elif mode == "retract":
            retracted = self.core.scheduler.retract_running()
            logger.info("pause (retract): %d running requests retracted", retracted)
        # NOTE: preempted requests count too: resumed after an update, they would end with
        # tokens of two weight versions.
        if mode == "wait" and self.core.scheduler.has_started_requests:
            return _DEFERRED
        return self.state()

    def _resume(self, op: ResumeGeneration, aborted: list[EngineCoreOutput]) -> object:
        self.pause_mode = None
        return self.state()

    def _reset_prefix_cache(self, op: ResetPrefixCache, aborted: list[EngineCoreOutput]) -> object:
        self.core.scheduler.kv.invalidate_prefix_cache()
        return {"success": True, "message": "prefix cache reset"}

    # ------------------------------------------------------------------ weights

    def _run(self, call: ControlCall) -> None:
        errors = self.core.executor.run_control(call)
        if errors:
            raise ControlError("; ".join(errors))

    def _update_weights(self, op: UpdateWeights, aborted: list[EngineCoreOutput]) -> dict:
        if self.asleep_tags & {"weights"}:
            raise ControlError('the weights are asleep: POST /wake_up with tags ["weights"] first')
        options = op.options
        if options.abort_all_requests:
            self._abort_all(aborted)
        try:
            self._run(op.source)
        except ControlError:
            self.update_open = False
            self._run(CommitWeights(commit=False))
            raise
        if not options.finished:
            self.update_open = True  # generation waits for the rest of the buckets
            return {"success": True, "message": "bucket loaded; waiting for finished=true"}
        return self._commit(options.weight_version, options.flush_cache)

    def _commit(self, weight_version: str | None, flush_cache: bool) -> dict:
        self._run(CommitWeights(commit=True))
        self.update_open = False
        self.weights_valid = True
        self._num_updates += 1
        self.weight_version = weight_version or str(self._num_updates)
        # flush_cache=False (SGLang's option) keeps prefixes computed with the old weights.
        if flush_cache:
            self.core.scheduler.end_kv_leases()  # lent blocks hold the old weights' keys
            self.core.scheduler.kv.invalidate_prefix_cache()
        logger.info("weights updated: version %s", self.weight_version)
        return {
            "success": True,
            "message": "weights updated",
            "weight_version": self.weight_version,
        }

    def _finish_weights_update(self, op: FinishWeightsUpdate, aborted: list) -> object:
        """Ends the open update (loaded with finished=false): commit, or roll back to the weights
        before it. Trainers driving several servers prepare on all, then finish on all."""
        if not self.update_open:
            raise ControlError("no weight update is open (send one with finished=false first)")
        if op.commit:
            return self._commit(op.weight_version, op.flush_cache)
        self.update_open = False
        self._run(CommitWeights(commit=False))
        return {"success": True, "message": "weight update rolled back"}

    def _init_weights_update_group(self, op: InitWeightsUpdateGroup, aborted: list) -> object:
        self._run(op)
        return {"success": True, "message": f"joined weight-update group {op.group_name!r}"}

    def _destroy_weights_update_group(self, op: DestroyWeightsUpdateGroup, aborted: list) -> object:
        self._run(op)
        return {"success": True, "message": f"destroyed {op.group_name!r}"}

    # ------------------------------------------------------------------ LoRA adapters

    def _load_lora_adapter(self, op: LoadLoraAdapter, aborted: list) -> object:
        if self.asleep_tags:
            raise ControlError("the server is asleep: wake it up before loading an adapter")
        loras = self.core.adapters()
        running = self.core.scheduler.running_adapters()
        adapter = loras.load(
            op.name, op.source, op.version, running, op.replace, op.pinned, op.stage
        )
        return _adapter_answer(adapter, "staged" if op.stage else "loaded")

    def _finish_lora_load(self, op: FinishLoraLoad, aborted: list) -> object:
        adapter = self.core.adapters().finish_staged(op.name, op.commit)
        return _adapter_answer(adapter, "loaded" if op.commit else "dropped")

    def _unload_lora_adapter(self, op: UnloadLoraAdapter, aborted: list) -> object:
        self.core.adapters().unload(op.name)
        return {"success": True, "message": f"LoRA adapter {op.name!r} unloaded", "name": op.name}

    # ------------------------------------------------------------------ sleep

    def _sleep(self, op: ReleaseMemory, aborted: list) -> object:
        """vLLM's levels: 1 discards the KV cache and keeps the weights' values (in host memory
        on a GPU), 2 discards both. `tags` (SGLang's release_memory_occupation) name what to free
        instead, discarding it: weights freed so come back empty, for a weight update to fill."""
        level = op.level or 1
        if level not in (1, 2):
            raise ControlError(f"level must be 1 or 2, not {level}")
        named = _memory_tags(op.tags)
        tags = named or ["kv_cache", "weights"]
        keep_weights = level == 1 and not named
        self._abort_all(aborted)  # nothing in flight can continue without its cache or weights
        self._run(
            Sleep(level=1 if keep_weights else 2, tags=[t for t in tags if t != "cuda_graph"])
        )
        self.core.scheduler.end_kv_leases()  # their blocks are gone
        self.core.scheduler.kv.invalidate_prefix_cache()
        self.asleep_tags |= set(tags) - {"cuda_graph"}  # it holds nothing: never kept asleep
        if "weights" in tags and not keep_weights:
            self.weights_valid = False
        return {"success": True, "message": f"released {sorted(set(tags))}", **self.state()}

    def _wake_up(self, op: ResumeMemory, aborted: list) -> object:
        tags = _memory_tags(op.tags) or list(WAKE_TAGS)
        self._run(WakeUp(tags=[t for t in tags if t != "cuda_graph"]))
        self.asleep_tags -= set(tags)
        return {"success": True, "message": f"resumed {sorted(set(tags))}", **self.state()}


def _adapter_answer(adapter: Adapter, what: str) -> dict:
    return {
        "success": True,
        "message": f"LoRA adapter {adapter.name!r} {what} (version {adapter.version})",
        "name": adapter.name,
        "version": adapter.version,
    }


def _memory_tags(tags: object) -> list[str]:
    if not tags:
        return []
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise ControlError(f"tags must be a list of {list(MEMORY_TAGS)}")
    unknown = set(tags) - set(MEMORY_TAGS)
    if unknown:
        raise ControlError(f"unknown tags {sorted(unknown)}: use {list(MEMORY_TAGS)}")
    return list(dict.fromkeys(tags))


_DEFERRED = object()

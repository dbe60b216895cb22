"""Control of an engine core for RL trainers: pause/resume, weight updates, sleep and wake-up.

Each utility call from the frontend becomes one or more control calls that every worker rank runs.
The state here decides when the engine may step:
- paused ("keep": nothing runs; "wait"/"abort": running requests finish or are aborted, new ones wait),
- asleep (KV cache and maybe the weights freed: nothing runs until woken),
- weights not valid (woken after sleep level 2, before new weights arrived),
- a bucketed weight update is open (between its first and its `finished` bucket).
Each UtilityMethod is answered by the method of EngineControl named after it (`handle` finds it),
which returns the JSON answer of the HTTP route.
A weight update is a transaction on the workers: it commits on every rank or is rolled back on every
rank, so no step ever runs on half-updated weights. After a commit, every cached prefix computed with
the old weights is forgotten and the weight version changes; requests in flight continue with the
new weights unless the caller asked to abort them.
"""

from __future__ import annotations

import logging
from typing import Any

from enginecore.core import EngineCore
from enginecore.messages import (
    DestroyWeightsUpdateGroup,
    EngineCoreOutput,
    FinishWeightUpdate,
    InitWeightsUpdateGroup,
    Sleep,
    UpdateWeightsFromDisk,
    UpdateWeightsFromDistributed,
    UpdateWeightsFromTensors,
    UtilityMethod,
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
        }

    # ------------------------------------------------------------------ the calls

    def handle(
        self,
        call_id: int,
        method: UtilityMethod,
        args: dict[str, Any],
        aborted: list[EngineCoreOutput],
    ) -> UtilityResult | None:
        """Runs one call. Requests it aborts go to `aborted`. None: the answer comes later."""
        handler = getattr(self, f"_{method.value}")
        try:
            result = handler(args, aborted)
        except (ControlError, KeyError, TypeError) as e:
            message = f"missing argument {e}" if isinstance(e, KeyError) else str(e)
            return UtilityResult(call_id, error=message)
        if result is _DEFERRED:
            self._deferred_pauses.append(call_id)
            return None
        return UtilityResult(call_id, result)

    def _abort_all(self, aborted: list[EngineCoreOutput]) -> None:
        s = self.core.scheduler
        ids = [r.request_id for r in list(s.running) + list(s.waiting)]
        aborted.extend(self.core.abort_requests(ids))

    def _get_control_state(self, args: dict[str, Any], aborted: list[EngineCoreOutput]) -> object:
        return self.state()

    def _pause(self, args: dict[str, Any], aborted: list[EngineCoreOutput]) -> object:
        mode = args.get("mode", "abort")
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

    def _resume(self, args: dict[str, Any], aborted: list[EngineCoreOutput]) -> object:
        self.pause_mode = None
        return self.state()

    def _reset_prefix_cache(self, args: dict[str, Any], aborted: list[EngineCoreOutput]) -> object:
        self.core.scheduler.kv.invalidate_prefix_cache()
        return {"success": True, "message": "prefix cache reset"}

    # ------------------------------------------------------------------ weights

    def _run(self, call: object, timeout: float | None = None) -> None:
        errors = self.core.executor.run_control(call, timeout)
        if errors:
            raise ControlError("; ".join(errors))

    def _transaction(
        self, call: object, args: dict[str, Any], aborted: list, finished: bool
    ) -> dict:
        if self.asleep_tags & {"weights"}:
            raise ControlError('the weights are asleep: POST /wake_up with tags ["weights"] first')
        if args.get("abort_all_requests"):
            self._abort_all(aborted)
        try:
            self._run(call, timeout=args.get("timeout_s"))
        except ControlError:
            self.update_open = False
            self._run(FinishWeightUpdate(commit=False))
            raise
        if not finished:
            self.update_open = True  # generation waits for the rest of the buckets
            return {"success": True, "message": "bucket loaded; waiting for finished=true"}
        return self._commit(args)

    def _commit(self, args: dict[str, Any]) -> dict:
        self._run(FinishWeightUpdate(commit=True))
        self.update_open = False
        self.weights_valid = True
        self._num_updates += 1
        self.weight_version = str(args.get("weight_version") or self._num_updates)
        # flush_cache=False (SGLang's option) keeps prefixes computed with the old weights.
        if args.get("flush_cache", True):
            self.core.scheduler.kv.invalidate_prefix_cache()
        logger.info("weights updated: version %s", self.weight_version)
        return {
            "success": True,
            "message": "weights updated",
            "weight_version": self.weight_version,
        }

    def _update_weights_from_disk(self, args: dict[str, Any], aborted: list) -> object:
        call = UpdateWeightsFromDisk(model_path=str(args["model_path"]))
        return self._transaction(call, args, aborted, finished=bool(args.get("finished", True)))

    def _finish_weights_update(self, args: dict[str, Any], aborted: list) -> object:
        """Ends the open update (loaded with finished=false): commit, or roll back to the weights
        before it. Trainers driving several servers prepare on all, then finish on all."""
        if not self.update_open:
            raise ControlError("no weight update is open (send one with finished=false first)")
        if args.get("commit", True):
            return self._commit(args)
        self.update_open = False
        self._run(FinishWeightUpdate(commit=False))
        return {"success": True, "message": "weight update rolled back"}

    def _update_weights_from_tensors(self, args: dict[str, Any], aborted: list) -> object:
        call = UpdateWeightsFromTensors(
            blobs=list(args.get("blobs", [])), shm_paths=list(args.get("shm_paths", []))
        )
        return self._transaction(call, args, aborted, finished=bool(args.get("finished", True)))

    def _update_weights_from_distributed(self, args: dict[str, Any], aborted: list) -> object:
        call = UpdateWeightsFromDistributed(
            group_name=args["group_name"],
            names=list(args["names"]),
            dtypes=list(args["dtypes"]),
            shapes=[list(s) for s in args["shapes"]],
            flattened=args.get("load_format") == "flattened_bucket",
        )
        return self._transaction(call, args, aborted, finished=bool(args.get("finished", True)))

    def _init_weights_update_group(self, args: dict[str, Any], aborted: list) -> object:
        call = InitWeightsUpdateGroup(
            master_address=str(args["master_address"]),
            master_port=int(args["master_port"]),
            rank_offset=int(args["rank_offset"]),
            world_size=int(args["world_size"]),
            group_name=str(args["group_name"]),
            backend=args.get("backend"),
            timeout_s=float(args.get("timeout_s", 600.0)),
        )
        self._run(call)
        return {"success": True, "message": f"joined weight-update group {call.group_name!r}"}

    def _destroy_weights_update_group(self, args: dict[str, Any], aborted: list) -> object:
        self._run(DestroyWeightsUpdateGroup(group_name=str(args["group_name"])))
        return {"success": True, "message": f"destroyed {args['group_name']!r}"}

    # ------------------------------------------------------------------ sleep

    def _sleep(self, args: dict[str, Any], aborted: list) -> object:
        """Level 1 frees the KV cache, level 2 the weights too; `tags` (SGLang's
        release_memory_occupation) name what to free instead."""
        level = int(args.get("level") or 1)
        if level not in (1, 2):
            raise ControlError(f"level must be 1 or 2, not {level}")
        tags = _memory_tags(args.get("tags")) or (["kv_cache", "weights"][:level])
        self._abort_all(aborted)  # nothing in flight can continue without its cache or weights
        self._run(Sleep(level=level, tags=[t for t in tags if t != "cuda_graph"]))
        self.core.scheduler.kv.invalidate_prefix_cache()
        self.asleep_tags |= set(tags) - {"cuda_graph"}  # it holds nothing: never kept asleep
        if "weights" in tags:
            self.weights_valid = False
        return {"success": True, "message": f"released {sorted(set(tags))}", **self.state()}

    def _wake_up(self, args: dict[str, Any], aborted: list) -> object:
        tags = _memory_tags(args.get("tags")) or list(WAKE_TAGS)
        self._run(WakeUp(tags=[t for t in tags if t != "cuda_graph"]))
        self.asleep_tags -= set(tags)
        return {"success": True, "message": f"resumed {sorted(set(tags))}", **self.state()}


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

"""Control calls (RL trainers' routes) over every replica of a --dp > 1 server, as one operation.

Each replica's engine core already runs a weight update as a transaction over its own workers
(enginecore/control.py: load and keep a snapshot, then CommitWeights commits or rolls back).
Across replicas the same two phases run one level up:
- prepare: the update goes to every living replica at once with finished=false, so each loads the
  new weights, keeps the old ones, and stops generating (its update is open);
- commit: only when every replica prepared, FinishWeightsUpdate(commit=true) goes to all, with one
  weight_version chosen here (the caller's, or the count of commits); if any replica failed, the
  others roll back (commit=false) and the caller gets the first error.
Generation is held on every replica between the two phases, so once a call returns every replica
answers with the same weights and weight_version. A bucketed update (finished=false from the caller)
stays open on all until its last bucket or /finish_weights_update; a failed bucket rolls back all.

init_weights_update_group: the trainer's group spans 1 + dp x tp x pp ranks; the i-th living replica
joins with rank_offset + i x tp x pp (all at once: the rendezvous waits for every rank). If one
fails, the others leave the group again.
a LoRA adapter's load is staged on every replica, then served by all (or dropped by all);
pause fails as a whole (the paused ones resume); resume, reset_prefix_cache, sleep, wake_up and
destroy_weights_update_group go to every replica and report the first error. get_control_state and
get_stats merge the replicas' answers.
A replica that dies during a call fails the call (the others roll back); dead replicas are left
out of later calls (they serve nothing). Mutating calls are serialized: one transaction at a time.
This module knows nothing about HTTP.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from msgspec.structs import replace

from enginecore.messages import (
    DestroyWeightsUpdateGroup,
    EngineControlOp,
    FinishLoraLoad,
    FinishWeightsUpdate,
    GetControlState,
    GetStats,
    InitWeightsUpdateGroup,
    LoadLoraAdapter,
    PauseGeneration,
    ResumeGeneration,
    UpdateWeights,
)
from frontend.engine.core_client import EngineDeadError, UtilityError

logger = logging.getLogger("tern.frontend")

# Stats that are the same on every replica rather than summed.
_SHARED_STATS = frozenset({"block_size"})


class Replica(Protocol):
    index: int

    @property
    def is_dead(self) -> bool: ...

    async def call_utility(self, op: EngineControlOp, timeout: float = 10.0) -> Any: ...


class ReplicaControl:
    def __init__(self, replicas: Sequence[Replica], ranks_per_replica: int) -> None:
        self.replicas = replicas
        self.ranks_per_replica = ranks_per_replica
        self.num_updates = 0  # commits so far: the default weight_version, as one engine counts
        self._lock = asyncio.Lock()

    def living(self) -> list[Replica]:
        alive = [r for r in self.replicas if not r.is_dead]
        if not alive:
            raise EngineDeadError("every replica is dead")
        return alive

    async def call(self, op: EngineControlOp, timeout: float) -> Any:
        if isinstance(op, GetStats | GetControlState):
            return await self._read(op, timeout)
        async with self._lock:
            if isinstance(op, UpdateWeights):
                return await self._update(op, timeout)
            if isinstance(op, FinishWeightsUpdate):
                return await self._finish(op, timeout)
            if isinstance(op, InitWeightsUpdateGroup):
                return await self._init_group(op, timeout)
            if isinstance(op, PauseGeneration):
                return await self._pause(op, timeout)
            if isinstance(op, LoadLoraAdapter):
                return await self._load_lora(op, timeout)
            results = await self._on_all(self.living(), timeout, lambda i: op)
            return _first_result_or_raise(results)

    # ------------------------------------------------------------------ fan-out

    async def _on_all(
        self,
        replicas: list[Replica],
        timeout: float,
        op_of: Callable[[int], EngineControlOp],
    ) -> list[tuple[Replica, Any]]:
        """(replica, its result or the exception it raised), for every replica, in order."""
        ops = [op_of(i) for i in range(len(replicas))]
        results = await asyncio.gather(
            *(r.call_utility(op, timeout) for r, op in zip(replicas, ops, strict=True)),
            return_exceptions=True,
        )
        for r, op, result in zip(replicas, ops, results, strict=True):
            if isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result  # cancellation and the like: not a replica's answer
            if isinstance(result, Exception):
                name = type(op).__struct_config__.tag
                logger.warning("replica %d: %s failed: %s", r.index, name, result)
        return list(zip(replicas, results, strict=True))

    async def _read(self, op: GetStats | GetControlState, timeout: float) -> Any:
        results = await self._on_all(self.living(), timeout, lambda i: op)
        answers = [(r, res) for r, res in results if not isinstance(res, Exception)]
        if not answers:
            _first_result_or_raise(results)
        if isinstance(op, GetStats):
            return merge_stats([(r.index, res) for r, res in answers])
        return merge_control_states([res for _, res in answers])

    # ------------------------------------------------------------------ weight updates

    async def _update(self, op: UpdateWeights, timeout: float) -> Any:
        replicas = self.living()
        prepare = replace(op, options=replace(op.options, finished=False))
        prepared = await self._on_all(replicas, timeout, lambda i: prepare)
        failed = [(r, res) for r, res in prepared if isinstance(res, Exception)]
        if failed:
            await self._roll_back([r for r, res in prepared if not isinstance(res, Exception)])
            raise _error_of(failed)
        if not op.options.finished:
            return prepared[0][1]
        commit = FinishWeightsUpdate(True, op.options.weight_version, op.options.flush_cache)
        return await self._commit(replicas, timeout, commit)

    async def _commit(
        self, replicas: list[Replica], timeout: float, finish: FinishWeightsUpdate
    ) -> Any:
        version = finish.weight_version or str(self.num_updates + 1)
        commit = replace(finish, commit=True, weight_version=version)
        results = await self._on_all(replicas, timeout, lambda i: commit)
        failed = [(r, res) for r, res in results if isinstance(res, Exception)]
        if failed:
            # NOTE: a commit only drops the snapshot: it fails when a replica died meanwhile, and
            # a dead replica serves nothing, so the living ones still agree.
            logger.error("commit failed on replicas %s", [r.index for r, _ in failed])
            raise _error_of(failed)
        self.num_updates += 1
        return results[0][1]

    async def _roll_back(self, replicas: list[Replica]) -> None:
        if replicas:
            await self._on_all(replicas, 600.0, lambda i: FinishWeightsUpdate(commit=False))

    async def _finish(self, op: FinishWeightsUpdate, timeout: float) -> Any:
        replicas = self.living()
        if op.commit:
            return await self._commit(replicas, timeout, op)
        results = await self._on_all(replicas, timeout, lambda i: op)
        return _first_result_or_raise(results)

    async def _init_group(self, op: InitWeightsUpdateGroup, timeout: float) -> Any:
        replicas = self.living()

        def op_of(i: int) -> InitWeightsUpdateGroup:
            return replace(op, rank_offset=op.rank_offset + i * self.ranks_per_replica)

        results = await self._on_all(replicas, timeout, op_of)
        failed = [(r, res) for r, res in results if isinstance(res, Exception)]
        if failed:
            joined = [r for r, res in results if not isinstance(res, Exception)]
            leave = DestroyWeightsUpdateGroup(op.group_name)
            if joined:
                await self._on_all(joined, 60.0, lambda i: leave)
            raise _error_of(failed)
        return results[0][1]

    async def _load_lora(self, op: LoadLoraAdapter, timeout: float) -> Any:
        """Every replica loads the adapter (staged), then all serve it; if one fails, none."""
        replicas = self.living()
        staged = replace(op, stage=True)
        results = await self._on_all(replicas, timeout, lambda i: staged)
        failed = [(r, res) for r, res in results if isinstance(res, Exception)]
        loaded = [r for r, res in results if not isinstance(res, Exception)]
        finish = FinishLoraLoad(op.name, commit=not failed)
        done = await self._on_all(loaded, timeout, lambda i: finish) if loaded else []
        if failed:
            raise _error_of(failed)
        return _first_result_or_raise(done)

    async def _pause(self, op: PauseGeneration, timeout: float) -> Any:
        results = await self._on_all(self.living(), timeout, lambda i: op)
        failed = [(r, res) for r, res in results if isinstance(res, Exception)]
        if failed:
            paused = [r for r, res in results if not isinstance(res, Exception)]
            if paused:
                await self._on_all(paused, 60.0, lambda i: ResumeGeneration())
            raise _error_of(failed)
        return merge_control_states([res for _, res in results])


def _error_of(failed: list[tuple[Replica, Any]]) -> Exception:
    """The error a failed fan-out raises: the caller's mistake (UtilityError, same on every replica)
    when there is one, else a replica's death (as UtilityError: the others still serve)."""
    for _, e in failed:
        if isinstance(e, UtilityError):
            return e
    replica, e = failed[0]
    return UtilityError(f"replica {replica.index} failed ({e}); the other replicas rolled back")


def _first_result_or_raise(results: list[tuple[Replica, Any]]) -> Any:
    failed = [(r, res) for r, res in results if isinstance(res, Exception)]
    if failed:
        raise _error_of(failed)
    return results[0][1]


def merge_control_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """One control state for the server: asleep or updating if any replica is, valid if all are."""
    merged = dict(states[0])
    merged["is_sleeping"] = any(s["is_sleeping"] for s in states)
    merged["asleep_tags"] = sorted({t for s in states for t in s["asleep_tags"]})
    merged["weights_valid"] = all(s["weights_valid"] for s in states)
    merged["update_open"] = any(s["update_open"] for s in states)
    versions = sorted({s["weight_version"] for s in states})
    if len(versions) > 1:  # never after a call returned (see the module docstring)
        logger.error("replicas hold different weight versions: %s", versions)
    merged["replica_weight_versions"] = [s["weight_version"] for s in states]
    return merged


def merge_stats(stats: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    """The replicas' SchedulerStats summed (block_size shared), and each under `replicas`."""
    merged: dict[str, Any] = {}
    for _, s in stats:
        for key, value in s.items():
            if key in _SHARED_STATS:
                merged[key] = value
            elif isinstance(value, int | float):
                merged[key] = merged.get(key, 0) + value
    merged["replicas"] = [{"replica": index, **s} for index, s in stats]
    return merged

"""The frontend's engine: one engine core per data-parallel replica (--dp N), seen as one.

EngineClient starts N engine cores (frontend/engine/core_client.py), each with its own tp x pp
workers and its own IPC directory, and waits until all are ready. Requests go to the replica the
LoadBalancer picks (least loaded; prefix-aware: frontend/engine/load_balancer.py); aborts follow them.
Control calls go to every replica as one transaction (frontend/engine/replicas.py). At --dp 1
every call goes straight to the one engine core, as before replicas existed.

Health, with several replicas. A replica whose engine core or worker dies fails its own requests in
flight at once (EngineDeadError: 503, or an error event mid-stream; a dead worker is seen by its
core within a poll interval, a dead core here within LIVENESS_INTERVAL_S, a frozen one after
engine_heartbeat_timeout_s), its processes are stopped and reaped, and it gets no more requests or
control calls. The server keeps serving on the others: degraded. GET /health then answers 200 with
{"status": "degraded", ...} naming the dead replicas, so that a router keeps sending traffic to the
capacity left (a 503 would take the whole server out of rotation); an orchestrator that prefers a
restart can read the status. Only when every replica is dead is the engine dead: /health answers
503, the `on_dead` callbacks run, and the server exits non-zero (frontend/server/launcher.py). A dead
replica is not restarted: its workers' memory layout and the trainer's group would have to be
rebuilt, which is a restart of the server.
This module knows nothing about HTTP or text.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
from collections.abc import Callable
from typing import Any

import msgspec

from enginecore.config import Config
from enginecore.messages import (
    EngineControlOp,
    EngineCoreRequest,
    EngineReady,
    FinishWeightsUpdate,
    GetStats,
    ReleaseMemory,
    ResetPrefixCache,
    SchedulerStats,
    UpdateWeights,
)
from frontend.engine.core_client import (
    EngineCoreClient,
    EngineDeadError,
    EngineStartupError,
    RequestStream,
    UtilityError,
)
from frontend.engine.load_balancer import LoadBalancer, ReplicaLoad
from frontend.engine.replicas import ReplicaControl

__all__ = [
    "EngineClient",
    "EngineDeadError",
    "EngineStartupError",
    "RequestStream",
    "UtilityError",
]

logger = logging.getLogger("tern.frontend")

# Calls after which no replica holds the prefixes the balancer remembers.
_CACHE_RESETS = (ResetPrefixCache, UpdateWeights, FinishWeightsUpdate, ReleaseMemory)


@dataclasses.dataclass(frozen=True)
class ReplicaSnapshot:
    """One replica as /metrics and /health show it."""

    index: int
    is_alive: bool
    dead_reason: str | None
    stats: SchedulerStats | None
    num_in_flight: int
    num_routed: dict[str, int]  # requests sent to it, by the balancer's reason


def replica_config(config: Config, index: int) -> Config:
    """Replica `index`'s copy of the config: its own IPC directory and data_parallel_rank."""
    if config.parallel.data_parallel_size == 1:
        return config
    return config.replace(
        ipc_dir=os.path.join(config.ipc_dir, f"dp{index}"),
        parallel=dataclasses.replace(config.parallel, data_parallel_rank=index),
    )


class EngineClient:
    def __init__(self, config: Config) -> None:
        self.config = config
        num_replicas = config.parallel.data_parallel_size
        self.replicas = [EngineCoreClient(replica_config(config, d)) for d in range(num_replicas)]
        self.balancer = LoadBalancer(num_replicas, config.cache.block_size)
        self.control = ReplicaControl(self.replicas, config.parallel.world_size)
        self.ready: EngineReady | None = None
        self.dead_reason: str | None = None
        self.on_dead: list[Callable[[str], None]] = []
        self._reaping: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------------ lifecycle

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    @property
    def is_replicated(self) -> bool:
        return len(self.replicas) > 1

    @property
    def pid(self) -> int | None:
        """The first replica's engine-core pid (each replica's: `replicas[i].pid`)."""
        return self.replicas[0].pid

    def spawn(self) -> None:
        """Starts every replica's engine core (once): they load the model meanwhile."""
        if self.replicas[0].pid is not None:  # spawned already
            return
        for replica in self.replicas:
            os.makedirs(replica.config.ipc_dir, exist_ok=True)
            replica.on_dead.append(lambda reason, r=replica: self._on_replica_dead(r, reason))
            replica.spawn()

    async def start(self) -> EngineReady:
        """Starts every replica at once (unless spawn() did) and waits for all; raises
        EngineStartupError."""
        self.spawn()
        results = await asyncio.gather(*(r.start() for r in self.replicas), return_exceptions=True)
        for replica, result in zip(self.replicas, results, strict=True):
            if isinstance(result, BaseException):
                if self.is_replicated and isinstance(result, EngineStartupError):
                    raise EngineStartupError(f"replica {replica.index}: {result}") from result
                raise result
        readies: list[EngineReady] = list(results)  # type: ignore[arg-type]
        # NOTE: same model and settings everywhere; the KV-cache sizes may differ a little (free
        # memory at start-up), and every replica must take every request: the smallest limits.
        self.ready = msgspec.structs.replace(
            readies[0],
            num_kv_blocks=min(r.num_kv_blocks for r in readies),
            max_model_len=min(r.max_model_len for r in readies),
        )
        if self.is_replicated:
            logger.info(
                "%d replicas ready (engine cores %s)",
                len(self.replicas),
                ", ".join(str(r.pid) for r in self.replicas),
            )
        return self.ready

    async def shutdown(self) -> None:
        """Stops every replica (engine core, then leftover workers), removes the IPC files."""
        await asyncio.gather(*(r.shutdown() for r in self.replicas), return_exceptions=True)
        for task in self._reaping:
            with contextlib.suppress(BaseException):
                await task
        shutil.rmtree(self.config.ipc_dir, ignore_errors=True)

    def _on_replica_dead(self, replica: EngineCoreClient, reason: str) -> None:
        """Called by a replica once its requests have failed."""
        if self.is_dead:
            return
        self.balancer.forget(replica.index)
        alive = [r for r in self.replicas if not r.is_dead]
        if not alive:
            self.dead_reason = reason if not self.is_replicated else f"every replica died: {reason}"
            for callback in self.on_dead:
                callback(self.dead_reason)
            return
        logger.error(
            "replica %d died (%s); serving on %d of %d replicas (degraded)",
            replica.index,
            reason,
            len(alive),
            len(self.replicas),
        )
        # Its engine core exits by itself (or was killed); reap it and any worker left behind now.
        self._reaping.append(asyncio.ensure_future(replica.stop_process()))

    def health(self) -> dict[str, Any]:
        """ok (every replica serves), degraded (some do) or dead (none)."""
        dead = {r.index: r.dead_reason for r in self.replicas if r.is_dead}
        status = "dead" if self.is_dead else "degraded" if dead else "ok"
        return {
            "status": status,
            "num_replicas": len(self.replicas),
            "num_replicas_alive": len(self.replicas) - len(dead),
            "dead_replicas": [{"replica": i, "reason": why} for i, why in dead.items()],
        }

    # ------------------------------------------------------------------ requests

    def add_request(self, request: EngineCoreRequest) -> RequestStream:
        """Queues a request on a replica; its outputs arrive on the returned stream."""
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        if not self.is_replicated:
            return self.replicas[0].add_request(request)
        index = self.balancer.choose(request.prompt_token_ids, self._loads(), request.mm_items)
        stream = self.replicas[index].add_request(request)
        stream.replica = index
        return stream

    def _loads(self) -> list[ReplicaLoad | None]:
        loads: list[ReplicaLoad | None] = []
        for r in self.replicas:
            s = r.latest_stats
            usage = (
                1.0 - s.num_free_blocks / s.num_total_blocks if s and s.num_total_blocks else 0.0
            )
            loads.append(None if r.is_dead else ReplicaLoad(r.num_in_flight, usage))
        return loads

    def abort(self, request_ids: list[str]) -> None:
        """Ends requests still in flight on whichever replica runs them (see EngineCoreClient)."""
        for r in self.replicas:
            mine = [rid for rid in request_ids if r.is_in_flight(rid)]
            if mine:
                r.abort(mine)

    def cancel(self, request_ids: list[str]) -> None:
        """Stops requests; each stream still ends with its last output (see EngineCoreClient)."""
        for r in self.replicas:
            mine = [rid for rid in request_ids if r.is_in_flight(rid)]
            if mine:
                r.cancel(mine)

    def release_kv(self, replica: int, lease_ids: list[str]) -> None:
        """Ends leases of replica `replica`'s engine core (frontend/disagg/bootstrap.py)."""
        self.replicas[replica].release_kv(lease_ids)

    def replica_ready(self, replica: int) -> EngineReady | None:
        """Replica `replica`'s own EngineReady (its KV endpoints and layouts); None once dead."""
        r = self.replicas[replica]
        return None if r.is_dead else r.ready

    def is_in_flight(self, request_id: str) -> bool:
        return any(r.is_in_flight(request_id) for r in self.replicas)

    @property
    def num_in_flight(self) -> int:
        return sum(r.num_in_flight for r in self.replicas)

    def fail_all_requests(self, reason: str) -> None:
        """Ends every request and utility call in flight, on every replica, with EngineDeadError."""
        for r in self.replicas:
            r.fail_all_requests(reason)

    # ------------------------------------------------------------------ utility calls and stats

    async def call_utility(self, op: EngineControlOp, timeout: float = 10.0) -> Any:
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        if not self.is_replicated:
            return await self.replicas[0].call_utility(op, timeout)
        try:
            return await self.control.call(op, timeout)
        finally:
            if isinstance(op, _CACHE_RESETS):
                self.balancer.forget()

    async def get_stats(self) -> dict[str, Any]:
        return await self.call_utility(GetStats())

    async def replica_stats(self) -> list[tuple[int, dict[str, Any]]]:
        """(index, scheduler stats asked now) of every living replica."""
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        alive = [r for r in self.replicas if not r.is_dead]
        stats = await asyncio.gather(*(r.call_utility(GetStats()) for r in alive))
        return [(r.index, s) for r, s in zip(alive, stats)]

    @property
    def latest_stats(self) -> SchedulerStats | None:
        """The living replicas' last SchedulerStats, summed (None before the first)."""
        stats = [r.latest_stats for r in self.replicas if not r.is_dead and r.latest_stats]
        if not stats:
            return None
        if len(stats) == 1:
            return stats[0]
        fields = [f for f in SchedulerStats.__struct_fields__ if f != "block_size"]
        summed = {f: sum(getattr(s, f) for s in stats) for f in fields}
        return SchedulerStats(block_size=stats[0].block_size, **summed)

    def replica_snapshots(self) -> list[ReplicaSnapshot]:
        return [
            ReplicaSnapshot(
                index=r.index,
                is_alive=not r.is_dead,
                dead_reason=r.dead_reason,
                stats=r.latest_stats,
                num_in_flight=r.num_in_flight,
                num_routed=dict(self.balancer.num_routed[r.index]),
            )
            for r in self.replicas
        ]

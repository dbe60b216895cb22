"""The frontend's side of one engine core (one data-parallel replica): its process, its sockets,
and one queue per request.

EngineCoreClient binds a PUSH socket (requests, aborts, utility calls) and a PULL socket (outputs),
spawns the engine-core process, and waits for its EngineReady. A background task routes each
EngineCoreOutputs to the queue of its request or to the future of its utility call; another
watches the process. When the engine is gone (process exit, `engine_dead`, or no message for
`engine_heartbeat_timeout_s` although it sends a heartbeat every second: a stopped or frozen process,
which is then killed), every request in flight ends with EngineDeadError and `on_dead` callbacks
run. What the server does then is frontend/engine/client.py's business (it owns every replica).
This module knows nothing about HTTP, text, or other replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import shutil
import time
from collections.abc import Callable
from typing import Any

import msgspec
import psutil
import zmq
import zmq.asyncio

from enginecore.config import Config
from enginecore.messages import (
    Codec,
    EngineControlOp,
    EngineCoreAbort,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    EngineStartup,
    EngineStartupFailed,
    GetStats,
    KVLeaseRelease,
    Logprobs,
    RequestType,
    SchedulerStats,
    UtilityCall,
)

logger = logging.getLogger("tern.frontend")

LIVENESS_INTERVAL_S = 0.5
SHUTDOWN_JOIN_S = 8.0


class UtilityError(RuntimeError):
    """The engine core answered a utility call with an error (the engine itself is fine)."""


class EngineStartupError(RuntimeError):
    """The engine core did not become ready (its error, a crash, or a timeout)."""


class EngineDeadError(RuntimeError):
    """The engine core is gone: the request cannot finish."""


class RequestStream:
    """The outputs of one request, in order. Ends with a finished output or EngineDeadError."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.replica = 0  # the data-parallel replica serving it
        self.queue: asyncio.Queue[EngineCoreOutput | EngineDeadError] = asyncio.Queue()
        self.is_finished = False

    async def next(self) -> EngineCoreOutput:
        """The next output, merged with any others already queued (a slow reader gets batches)."""
        item = await self.queue.get()
        merged: EngineCoreOutput | None = None
        while True:
            if isinstance(item, EngineDeadError):
                self.is_finished = True
                raise item
            merged = item if merged is None else _merge(merged, item)
            if merged.finish_reason is not None or self.queue.empty():
                break
            item = self.queue.get_nowait()
        if merged.finish_reason is not None:
            self.is_finished = True
        return merged


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _merge(a: EngineCoreOutput, b: EngineCoreOutput) -> EngineCoreOutput:
    new_logprobs = a.new_logprobs
    if b.new_logprobs is not None:
        new_logprobs = Logprobs.concat([a.new_logprobs or Logprobs(), b.new_logprobs])
    routed = a.routed_experts
    if routed is None or b.routed_experts is None:
        routed = routed or b.routed_experts
    else:  # consecutive positions' rows
        routed = msgspec.structs.replace(routed, data=routed.data + b.routed_experts.data)
    return EngineCoreOutput(
        a.request_id,
        a.new_token_ids + b.new_token_ids,
        b.finish_reason,
        max(a.num_cached_tokens, b.num_cached_tokens),
        b.error,
        a.queued_time if a.queued_time is not None else b.queued_time,
        a.first_scheduled_time if a.first_scheduled_time is not None else b.first_scheduled_time,
        b.weight_version if b.weight_version is not None else a.weight_version,
        new_logprobs,
        a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
        b.pooled if b.pooled is not None else a.pooled,
        routed,
        b.lora_version if b.lora_version is not None else a.lora_version,
        a.cross_attention + b.cross_attention,  # consecutive positions' rows
        b.kv_lease_block_ids if b.kv_lease_block_ids is not None else a.kv_lease_block_ids,
        b.kv_lease_other_block_ids or a.kv_lease_other_block_ids,
        b.kv_lease_routing or a.kv_lease_routing,
        max(a.kv_lease_state_checkpoint, b.kv_lease_state_checkpoint),
    )


class EngineCoreClient:
    """One engine core: `index` is its replica (its config's parallel.data_parallel_rank)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.index = config.parallel.data_parallel_rank
        # For log lines: which replica, when there are several.
        self.label = (
            f"replica {self.index}" if config.parallel.data_parallel_size > 1 else "engine core"
        )
        self.ready: EngineReady | None = None
        self.dead_reason: str | None = None
        # The engine core's last SchedulerStats (sent every ~0.5 s while busy, and when it idles).
        self.latest_stats: SchedulerStats | None = None
        self.on_dead: list[Callable[[str], None]] = []
        self._ctx = zmq.asyncio.Context()
        self._input: zmq.asyncio.Socket | None = None
        self._output: zmq.asyncio.Socket | None = None
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._streams: dict[str, RequestStream] = {}
        self._utility_futures: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._tasks: list[asyncio.Task[None]] = []
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._is_shutting_down = False
        self._engine_children: list[psutil.Process] = []
        self._last_message_time = time.monotonic()
        self._stopping: asyncio.Future[None] | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def spawn(self) -> None:
        """Starts the engine core's process (once): it loads the model while the caller goes on."""
        if self._proc is not None:
            return
        # Imported here, not at the top: only spawning needs the engine side.
        from enginecore.core_proc import run_engine_core

        self._input = self._ctx.socket(zmq.PUSH)
        self._output = self._ctx.socket(zmq.PULL)
        for sock in (self._input, self._output):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
        self._input.bind(self.config.ipc_path("engine_input"))
        self._output.bind(self.config.ipc_path("engine_output"))
        ctx = multiprocessing.get_context("spawn")
        name = "tern-engine-core"
        if self.config.parallel.data_parallel_size > 1:
            name += f"-{self.index}"
        self._proc = ctx.Process(target=run_engine_core, args=(self.config,), name=name)
        self._proc.start()

    async def start(self) -> EngineReady:
        """Spawns the engine core (unless spawn() did) and waits for EngineReady; raises
        EngineStartupError."""
        self.spawn()
        self.ready = await self._wait_ready()
        self._engine_children = _children(self._proc.pid)
        self._last_message_time = time.monotonic()
        self._tasks = [
            asyncio.create_task(self._output_loop(), name="tern-engine-outputs"),
            asyncio.create_task(self._watch_process(), name="tern-engine-liveness"),
        ]
        return self.ready

    async def _wait_ready(self) -> EngineReady:
        assert self._output is not None and self._proc is not None
        timeout = self.config.startup_timeout_s
        deadline = time.monotonic() + timeout
        while True:
            if await self._output.poll(timeout=200):
                frames = await self._output.recv_multipart()
                try:
                    msg = Codec(EngineStartup).decode(frames[-1])
                except msgspec.DecodeError as e:
                    raise EngineStartupError(
                        f"bad start-up message from the engine core: {e}"
                    ) from e
                if isinstance(msg, EngineStartupFailed):
                    raise EngineStartupError(f"the engine core failed to start: {msg.error}")
                return msg
            if not self._proc.is_alive():
                raise EngineStartupError(
                    f"the engine core exited with code {self._proc.exitcode} during start-up"
                )
            if time.monotonic() > deadline:
                raise EngineStartupError(
                    f"the engine core was not ready within {timeout:g} s (TERN_STARTUP_TIMEOUT)"
                )

    async def shutdown(self) -> None:
        """Stops the engine core (SIGTERM, then kill after 8 s), closes sockets, removes IPC files."""
        self._is_shutting_down = True
        self.fail_all_requests("the server is shutting down")
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        self._tasks = []
        await self.stop_process()
        for sock in (self._input, self._output):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.destroy(linger=0)
        shutil.rmtree(self.config.ipc_dir, ignore_errors=True)

    async def stop_process(self) -> None:
        """Stops the engine core and any of its workers that outlive it (once; later calls wait
        for that one)."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop_process())
        await self._stopping

    async def _stop_process(self) -> None:
        proc = self._proc
        if proc is None or proc.pid is None:
            return
        # NOTE: the core stops its own workers; we remember them (at start-up too, in case the core
        # is already gone) and kill any that outlive it.
        children = {p.pid: p for p in [*self._engine_children, *_children(proc.pid)]}.values()
        started = time.monotonic()
        if proc.is_alive():
            proc.terminate()
        deadline = started + SHUTDOWN_JOIN_S
        while proc.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if proc.is_alive():
            logger.warning("%s did not stop within %g s; killing it", self.label, SHUTDOWN_JOIN_S)
            proc.kill()
        proc.join(timeout=2.0)
        logger.info(
            "%s stopped in %.1f s (exit code %s)",
            self.label,
            time.monotonic() - started,
            proc.exitcode,
        )
        _, alive = psutil.wait_procs(list(children), timeout=1.0)
        for child in alive:
            logger.warning("killing leftover engine process %d", child.pid)
            with contextlib.suppress(psutil.Error):
                child.kill()

    # ------------------------------------------------------------------ requests

    def add_request(self, request: EngineCoreRequest) -> RequestStream:
        """Queues a request in the engine core; its outputs arrive on the returned stream."""
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        assert request.request_id not in self._streams, "request ids must be unique"
        stream = RequestStream(request.request_id)
        self._streams[request.request_id] = stream
        self._send(RequestType.ADD, request)
        return stream

    def abort(self, request_ids: list[str]) -> None:
        """Ends requests still in flight (client gone, stop string found); frees their KV blocks.

        Their streams are dropped at once: nothing more is read from them.
        """
        ids = [rid for rid in request_ids if self._streams.pop(rid, None) is not None]
        if ids and not self.is_dead:
            self._send(RequestType.ABORT, EngineCoreAbort(ids))

    def cancel(self, request_ids: list[str]) -> None:
        """Asks the engine core to stop requests; each stream still ends with its last output
        (finish reason ABORT, or the one it finished with if the engine got there first)."""
        ids = [rid for rid in request_ids if rid in self._streams]
        if ids and not self.is_dead:
            self._send(RequestType.ABORT, EngineCoreAbort(ids))

    def is_in_flight(self, request_id: str) -> bool:
        return request_id in self._streams

    def release_kv(self, lease_ids: list[str]) -> None:
        """A producer's leases end early (a consumer took the blocks, or gave up on them): the
        engine core puts their blocks back in its pool."""
        if lease_ids and not self.is_dead:
            self._send(RequestType.RELEASE_KV, KVLeaseRelease(lease_ids))

    async def call_utility(self, op: EngineControlOp, timeout: float = 10.0) -> Any:
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._utility_futures[call_id] = future
        try:
            self._send(RequestType.UTILITY, UtilityCall(call_id, op))
            return await asyncio.wait_for(future, timeout)
        finally:
            self._utility_futures.pop(call_id, None)

    async def get_stats(self) -> dict[str, Any]:
        return await self.call_utility(GetStats())

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def _send(self, kind: RequestType, body: msgspec.Struct) -> None:
        assert self._input is not None, "the engine client is not started"
        # NOTE: not awaited: with HWM 0 a PUSH to a connected peer completes at once, and
        # zmq.asyncio keeps sends in order. Aborts must be sendable from `finally` blocks.
        self._input.send_multipart([kind.value, self._encoder.encode(body)], copy=False)

    # ------------------------------------------------------------------ background tasks

    async def _output_loop(self) -> None:
        assert self._output is not None
        try:
            while True:
                frames = await self._output.recv_multipart(copy=False)
                self._last_message_time = time.monotonic()
                msg: EngineCoreOutputs = self._decoder.decode(frames[-1].buffer)
                self._dispatch(msg)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.exception("the engine output loop failed")
            self.mark_dead(f"cannot read engine outputs: {type(e).__name__}: {e}")

    def _dispatch(self, msg: EngineCoreOutputs) -> None:
        # NOTE: stats first: a client answered from these outputs then sees gauges at least as new.
        if msg.scheduler_stats is not None:
            self.latest_stats = msg.scheduler_stats
        for out in msg.outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted by us; the engine's last words about it do not matter
            stream.queue.put_nowait(out)
            if out.finish_reason is not None:
                del self._streams[out.request_id]
        for result in msg.utility_results:
            future = self._utility_futures.get(result.call_id)
            if future is None or future.done():
                continue
            if result.error is not None:
                future.set_exception(UtilityError(result.error))
            else:
                future.set_result(result.result)
        if msg.engine_dead is not None:
            self.mark_dead(msg.engine_dead)

    async def _watch_process(self) -> None:
        assert self._proc is not None
        timeout = self.config.engine_heartbeat_timeout_s
        while self._proc.is_alive():
            before = time.monotonic()
            await asyncio.sleep(LIVENESS_INTERVAL_S)
            now = time.monotonic()
            if now - before > LIVENESS_INTERVAL_S + 2.0:
                # NOTE: our own event loop was blocked: the engine's messages wait unread in the
                # socket, so its silence proves nothing yet.
                self._last_message_time = now
            if now - self._last_message_time > timeout and not self._is_shutting_down:
                self.mark_dead(
                    f"the engine core sent nothing for {timeout:g} s (stopped or hung; "
                    "TERN_ENGINE_HEARTBEAT_TIMEOUT); it was killed"
                )
                # SIGKILL works on a stopped process too; its workers see it gone and exit.
                self._proc.kill()
                return
        if not self._is_shutting_down:
            self.mark_dead(f"the engine core process exited with code {self._proc.exitcode}")

    def mark_dead(self, reason: str) -> None:
        """Ends every request in flight with EngineDeadError and runs the on_dead callbacks."""
        if self.is_dead:
            return
        logger.error("%s is dead: %s", self.label, reason)
        self.dead_reason = reason
        self.fail_all_requests(reason)
        for callback in self.on_dead:
            callback(reason)

    def fail_all_requests(self, reason: str) -> None:
        """Ends every request and utility call in flight with EngineDeadError."""
        for stream in self._streams.values():
            stream.queue.put_nowait(EngineDeadError(reason))
        self._streams.clear()
        for future in self._utility_futures.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))

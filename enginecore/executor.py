"""Executors run scheduler steps on the workers.

- `InProcExecutor`: the model runner in the calling process (tests, scripts/bench_step.py).
- `MultiprocExecutor`: one spawned worker process per rank (tp x pp of them). Each step goes out
  once through the shared-memory broadcast (every rank reads it); replies come back on one ZMQ PULL
  socket, from the driver rank only for steps. Worker processes are watched: a dead worker fails
  the step with `WorkerDied` within a poll interval, an error reply with `WorkerFailed`.
  With --nnodes > 1 it starts node 0's ranks only; each other node's worker launcher
  (workers.worker_proc.run_worker_node) joins through `NodeMonitor`, its workers read the broadcast
  over ZMQ (remote readers) and reply over TCP.

The engine core imports no torch: only workers use torch threads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import socket
import time
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Protocol

import psutil
import zmq

from enginecore.config import Config
from enginecore.kv_cache_manager import servable_len
from enginecore.messages import (
    BitmaskSource,
    Codec,
    ControlCall,
    ExecuteModel,
    GrammarBitmasks,
    InitKVCache,
    ModelRunnerOutput,
    NodeBootstrap,
    RoutingShape,
    SchedulerOutput,
    Shutdown,
    WorkerCall,
    WorkerReady,
    WorkerReply,
    WorkerResult,
)
from enginecore.node_monitor import NodeMonitor
from enginecore.shm_broadcast import MessageQueue

logger = logging.getLogger("tern.executor")

POLL_INTERVAL_MS = 200
# How long an error reply waits for a killed peer to show up as dead (see _raise_if_peer_killed).
KILLED_PEER_GRACE_S = 1.0
# A worker stopped (SIGSTOP) for this long counts as dead: it would hold every step forever.
STOPPED_WORKER_GRACE_S = 5.0
# OpenMP threads that wait at the end of a parallel region spin before they sleep (libgomp: 300,000
# polls, about a millisecond, unless told). When other programs use the cores too, a rank's waiting
# threads then spin through the time slices its late thread needs to finish the region: beside two
# busy-looping processes on 2 cores, decode took 240 ms a token at libgomp's default and 86 ms at
# 1,000 polls, with no difference on a quiet machine (docs/benchmarks.md, "A loaded machine").
WORKER_OMP_ENV = {"GOMP_SPINCOUNT": "1000"}


def _is_stopped(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return False


class WorkerDied(RuntimeError):
    """A worker process exited while the engine needed it."""


class WorkerFailed(RuntimeError):
    """A worker reported an exception (start-up error, failed step, failed collective)."""


class Executor(Protocol):
    num_kv_blocks: int
    max_model_len: int
    kv_cache_windows: list[int | None]  # per KV-cache group (workers/models/kv_cache_groups.py)
    # Hybrid models with prefix caching: linear-attention state checkpoints, and every how many
    # tokens they are taken (enginecore/state_checkpoints.py); 0 when there are none.
    num_state_checkpoints: int
    state_checkpoint_interval: int
    routing_shape: RoutingShape | None  # mixture-of-experts models (enginecore/routing.py)
    vocab_size: int
    model_summary: str

    def submit_step(self, step: SchedulerOutput, bitmasks: BitmaskSource | None = None) -> None:
        """Starts the step on the workers; collect_step waits for its output. `bitmasks` (when
        step.grammar_bitmasks_follow): computes the grammar bitmasks; called while the workers run
        the forward pass."""
        ...

    def collect_step(self) -> ModelRunnerOutput:
        """The output of the step submit_step started."""
        ...

    def execute_model(
        self, step: SchedulerOutput, bitmasks: BitmaskSource | None = None
    ) -> ModelRunnerOutput:
        """submit_step, then collect_step."""
        ...

    def run_control(self, call: ControlCall) -> list[str]: ...

    def shutdown(self) -> None: ...


class _ExecutorBase:
    """What both executors share: execute_model as its two halves, and the limits that follow
    from the model and the KV cache once it is sized."""

    def execute_model(
        self, step: SchedulerOutput, bitmasks: BitmaskSource | None = None
    ) -> ModelRunnerOutput:
        self.submit_step(step, bitmasks)  # type: ignore[attr-defined]
        return self.collect_step()  # type: ignore[attr-defined]

    def _adopt_model(self, config: Config, driver: WorkerReady) -> None:
        """Takes the model's facts from the driver rank's report; num_kv_blocks is set."""
        self.kv_cache_windows = driver.kv_cache_windows
        self.routing_shape = driver.routing_shape
        # A producer (prefill/decode disaggregation) keeps a lent prompt's sliding-window
        # blocks too (its consumer pulls them all): each group may hold the whole prompt.
        windows = self.kv_cache_windows
        if config.kv_transfer.produces:
            windows = [None] * len(windows)
        self.max_model_len = servable_len(
            driver.max_model_len, self.num_kv_blocks, config.cache.block_size, windows,
            config.scheduler.max_num_batched_tokens,
        )  # fmt: skip
        self.vocab_size = driver.vocab_size
        self.model_summary = driver.model_summary

    def _adopt_kv_transfer(self, readies: list[WorkerReady]) -> None:
        """Every rank's KV endpoint and layout, by rank (prefill/decode disaggregation)."""
        readies = sorted(readies, key=lambda r: r.rank)
        self.kv_endpoints = [r.kv_endpoint for r in readies]
        self.kv_layouts = [r.kv_layout for r in readies if r.kv_layout is not None]


class InProcExecutor(_ExecutorBase):
    def __init__(self, config: Config) -> None:
        from workers.runner.model_runner import ModelRunner  # torch only where a runner lives
        from workers.worker_control import WorkerControl
        from workers.worker_proc import ready_report

        self.runner = ModelRunner(config, rank=0)
        self.runner.load_model()
        self._output: ModelRunnerOutput | None = None
        self.control = WorkerControl(self.runner, rank=0)
        ready = ready_report(self.runner, 0, self.runner.num_kv_blocks_for_memory())
        self.num_kv_blocks = ready.num_kv_blocks
        self.num_state_checkpoints = ready.num_state_checkpoints
        self.state_checkpoint_interval = ready.state_checkpoint_interval
        self.runner.init_kv_cache(self.num_kv_blocks, self.num_state_checkpoints)
        self._adopt_model(config, ready)
        self._adopt_kv_transfer([ready])

    def submit_step(self, step: SchedulerOutput, bitmasks: BitmaskSource | None = None) -> None:
        self._output = self.runner.execute_model(step, bitmasks)

    def collect_step(self) -> ModelRunnerOutput:
        output, self._output = self._output, None
        assert output is not None, "no step was submitted"
        return output

    def run_control(self, call: ControlCall) -> list[str]:
        try:
            self.control.handle(call)
        except Exception as e:  # noqa: BLE001 - reported like a worker's control error
            return [f"rank 0: {type(e).__name__}: {e}"]
        return []

    def shutdown(self) -> None:
        pass


def worker_env() -> dict[str, str]:
    """What a worker process's environment needs beyond this one's: the OpenMP wait policy,
    unless the user set one."""
    if {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & set(os.environ):
        return {}
    return dict(WORKER_OMP_ENV)


class MultiprocExecutor(_ExecutorBase):
    """tp x pp worker processes on this node; the step goes out once, the driver rank answers it.

    Rank r is TP rank r % tp of pipeline stage r // tp. The workers join one torch.distributed world
    through a TCP store at a free port picked here (unique per instance) on 127.0.0.1, or with
    several nodes on --dist-init-addr's host, whose own port is then the nodes' meeting point.
    Replies come from every rank for `InitKVCache` and from the driver only (TP rank 0 of the last
    stage, on the last node) for `ExecuteModel`; an error reply from any rank fails the engine.
    """

    # Shutdown asks the workers to stop (they leave torch.distributed and exit) before it
    # terminates them.
    asks_workers_to_stop = True

    def __init__(self, config: Config) -> None:
        parallel = config.parallel
        if parallel.node_rank != 0:
            raise ValueError("the engine core runs on node 0; other nodes only run workers")
        if not (Path(config.model.path) / "config.json").is_file():
            raise ValueError(f"model directory {config.model.path} has no config.json")
        self.world_size = parallel.world_size
        self.driver_rank = parallel.driver_rank
        self._call_codec = Codec(WorkerCall)
        self._reply_codec = Codec(WorkerReply)
        self._failed = False
        self._stopped_since: dict[int, float] = {}  # pid -> when first seen stopped
        self._nodes: NodeMonitor | None = None
        self.procs: list[BaseProcess] = []
        self._ctx = zmq.Context()
        self._replies = self._ctx.socket(zmq.PULL)
        self._replies.setsockopt(zmq.LINGER, 0)
        self._reply_addr = config.ipc_path("worker_output")
        self._ipc_dir = config.ipc_dir
        self._reply_file = self._reply_addr.removeprefix("ipc://")  # removed at shutdown
        self._replies.bind(self._reply_addr)
        self._mq: MessageQueue | None = None
        try:
            host, num_local_ranks = self._place_ranks(config)
            self._mq = MessageQueue(
                n_reader=self.world_size,
                n_local_reader=num_local_ranks,
                connect_ip=host,
                parent_dir=config.ipc_dir,
            )
            self.config = self._with_store(config, host)
            self._start_workers(self.config)
            driver = self._init_kv_cache(self.config)
        except BaseException:
            self._failed = True
            self.shutdown()
            raise
        self._adopt_model(self.config, driver)

    def _place_ranks(self, config: Config) -> tuple[str, int]:
        """The host other nodes reach this one at, and how many ranks (the first ones) run on this
        host and read the broadcast from shared memory."""
        parallel = config.parallel
        # With several nodes, everything other nodes reach listens on --dist-init-addr's host.
        host = "127.0.0.1"
        if parallel.nnodes > 1:
            assert parallel.dist_init_addr is not None
            host = socket.gethostbyname(parallel.dist_init_addr.rpartition(":")[0])
        return host, parallel.ranks_per_node

    def _with_store(self, config: Config, host: str) -> Config:
        """The config with the workers' TCP store address (a free port here unless one node was
        given one), after starting the other nodes' monitor with several nodes."""
        parallel = config.parallel
        store_addr = parallel.dist_init_addr
        if parallel.nnodes > 1 or store_addr is None:
            store_addr = f"{host}:{free_port(host)}"
        if parallel.nnodes > 1:
            remote_reply_port = self._replies.bind_to_random_port(f"tcp://{host}")
            bootstrap = NodeBootstrap(
                self._mq.export_handle(), f"tcp://{host}:{remote_reply_port}", store_addr
            )
            self._nodes = NodeMonitor(self._ctx, parallel, bootstrap)
        return config.replace(parallel=dataclasses.replace(parallel, dist_init_addr=store_addr))

    def _start_workers(self, config: Config) -> None:
        """Spawns this node's ranks and waits until every rank (of every node) reads the
        broadcast."""
        from workers.worker_proc import run_worker

        os.environ.update(worker_env())  # spawned processes inherit it; OpenMP reads it at load
        mp = multiprocessing.get_context("spawn")
        for rank in config.parallel.node_ranks:
            proc = mp.Process(
                target=run_worker,
                args=(config, rank, self._mq.export_handle(), self._reply_addr),
                name=f"tern-worker-{rank}",
            )
            proc.start()
            self.procs.append(proc)
        if self._nodes is not None:
            self._nodes.wait_for_nodes(config.startup_timeout_s, self.check_health)
        self._mq.wait_until_ready(timeout=config.startup_timeout_s)

    def _init_kv_cache(self, config: Config) -> WorkerReady:
        """Sizes the KV cache to the rank with the least room, has every rank allocate it, and
        returns the driver rank's report."""
        readies = self._gather(WorkerReady, config.startup_timeout_s)
        self.num_kv_blocks = min(r.num_kv_blocks for r in readies)
        if self.num_kv_blocks < 1:
            raise RuntimeError("--kv-cache-memory is too small for one KV-cache block")
        # Pipeline stages without linear-attention layers keep no checkpoints.
        planned = [r for r in readies if r.state_checkpoint_interval]
        self.num_state_checkpoints = min((r.num_state_checkpoints for r in planned), default=0)
        self.state_checkpoint_interval = max(
            (r.state_checkpoint_interval for r in planned), default=0
        )
        self._broadcast(InitKVCache(self.num_kv_blocks, self.num_state_checkpoints))
        self._gather(WorkerResult, config.startup_timeout_s)
        self._adopt_kv_transfer(readies)
        return readies[self.driver_rank]

    def submit_step(self, step: SchedulerOutput, bitmasks: BitmaskSource | None = None) -> None:
        self._broadcast(ExecuteModel(step))
        if step.grammar_bitmasks_follow:
            assert bitmasks is not None, "the step promises grammar bitmasks"
            self._broadcast(GrammarBitmasks(step.step_id, bitmasks()))

    def collect_step(self) -> ModelRunnerOutput:
        (result,) = self._gather(WorkerResult, timeout=None, ranks=1)
        assert result.rank == self.driver_rank and result.output is not None, result
        return result.output

    def run_control(self, call: ControlCall) -> list[str]:
        """Runs a control call on every rank; returns the errors of the ranks that failed."""
        self._broadcast(call)
        results = self._gather(WorkerResult, timeout=None)
        return [f"rank {r.rank}: {r.control_error}" for r in results if r.control_error]

    def check_health(self) -> None:
        now = time.monotonic()
        for proc in self.procs:
            if not proc.is_alive():
                self._failed = True
                raise WorkerDied(f"worker {proc.name} died (exit code {proc.exitcode})")
            # NOTE: a stopped worker (SIGSTOP) is alive but never answers: the step would wait
            # forever (at --tp 1 no collective times out), so it counts as dead after a grace.
            if proc.pid is not None and _is_stopped(proc.pid):
                since = self._stopped_since.setdefault(proc.pid, now)
                if now - since > STOPPED_WORKER_GRACE_S:
                    self._failed = True
                    raise WorkerDied(
                        f"worker {proc.name} has been stopped (SIGSTOP) for {now - since:.0f} s"
                    )
            else:
                self._stopped_since.pop(proc.pid, None)
        if self._nodes is not None and self._nodes.error is not None:
            self._failed = True
            raise WorkerDied(self._nodes.error)

    def _broadcast(self, call: WorkerCall) -> None:
        assert self._mq is not None
        self._mq.enqueue(self._call_codec.encode(call))

    def _gather(self, typ: type, timeout: float | None, ranks: int | None = None) -> list:
        """Waits for one reply of type typ from each of `ranks` ranks (all by default)."""
        expected = self.world_size if ranks is None else ranks
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: list = []
        while len(replies) < expected:
            if self._replies.poll(POLL_INTERVAL_MS):
                reply = self._reply_codec.decode(self._replies.recv())
                if isinstance(reply, WorkerResult) and reply.error is not None:
                    self._failed = True
                    self._raise_if_peer_killed(reply.rank)
                    raise WorkerFailed(f"worker {reply.rank} failed: {reply.error}")
                assert isinstance(reply, typ), reply
                replies.append(reply)
                continue
            self.check_health()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"workers did not answer within {timeout:.0f} s")
        return sorted(replies, key=lambda r: r.rank)

    def _raise_if_peer_killed(self, reporter: int) -> None:
        """A failed collective is usually the echo of a peer killed mid-step (its sockets close
        before its parent can reap it): name that peer rather than the rank that reported."""
        deadline = time.monotonic() + KILLED_PEER_GRACE_S
        while True:
            for rank, proc in enumerate(self.procs):
                # NOTE: exit code 1 is a worker's own error exit, which it reports itself.
                if rank != reporter and proc.exitcode not in (None, 0, 1):
                    raise WorkerDied(f"worker {proc.name} died (exit code {proc.exitcode})")
            if self._nodes is not None and self._nodes.killed is not None:
                raise WorkerDied(self._nodes.killed)
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)

    def shutdown(self) -> None:
        """Stops the workers: asks them when all are well, else (or if they do not go) terminates
        and finally kills them. After a failure, a surviving rank may be blocked in a collective
        with the dead one and cannot run its SIGTERM handler, so the waits are short."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        mq = self._mq
        asks = self.asks_workers_to_stop and not self._failed
        if mq is not None and asks and all(p.is_alive() for p in self.procs):
            try:
                mq.enqueue(self._call_codec.encode(Shutdown()), timeout=1.0)
                deadline = time.monotonic() + 3.0
                for proc in self.procs:
                    proc.join(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # ring full or readers gone: terminate below
                pass
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + 1.0
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=1.0)
        if self._nodes is not None:
            self._nodes.close()  # tells the other nodes to stop their workers
        if mq is not None:
            mq.close()
        self._replies.close(linger=0)
        self._ctx.term()
        with contextlib.suppress(OSError):  # an in-process engine core's; a server's frontend
            os.unlink(self._reply_file)  # removes its own, which holds its sockets too
            os.rmdir(self._ipc_dir)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now (another process may still take it before it is bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]

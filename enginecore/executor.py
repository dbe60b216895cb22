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
import threading
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Protocol

import msgspec
import psutil
import zmq

from enginecore.config import Config, ParallelConfig
from enginecore.kv_cache_manager import servable_len
from enginecore.messages import (
    BitmaskSource,
    Codec,
    ControlCall,
    CoreToNode,
    ExecuteModel,
    GrammarBitmasks,
    InitKVCache,
    ModelRunnerOutput,
    NodeAck,
    NodeBootstrap,
    NodeHeartbeat,
    NodeHello,
    NodeStop,
    NodeToCore,
    NodeWorkerExited,
    RoutingShape,
    SchedulerOutput,
    Shutdown,
    WorkerCall,
    WorkerReady,
    WorkerReply,
    WorkerResult,
)
from enginecore.shm_broadcast import MessageQueue

logger = logging.getLogger("tern.executor")

POLL_INTERVAL_MS = 200
# How long an error reply waits for a killed peer to show up as dead (see _raise_if_peer_killed).
KILLED_PEER_GRACE_S = 1.0
# A worker stopped (SIGSTOP) for this long counts as dead: it would hold every step forever.
STOPPED_WORKER_GRACE_S = 5.0
# A node whose launcher sends no heartbeat for this long counts as dead (and node 0, to the others).
NODE_TIMEOUT_S = 5.0


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
    kv_cache_windows: list[int | None]  # per KV-cache group (workers/runner/kv_cache_groups.py)
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


class InProcExecutor:
    def __init__(self, config: Config) -> None:
        from workers.runner.model_runner import ModelRunner  # torch only where a runner lives
        from workers.worker_control import WorkerControl

        self.runner = ModelRunner(config, rank=0)
        self.runner.load_model()
        self._output: ModelRunnerOutput | None = None
        self.control = WorkerControl(self.runner, rank=0)
        self.num_kv_blocks = self.runner.num_kv_blocks_for_memory()
        self.num_state_checkpoints, self.state_checkpoint_interval = (
            self.runner.plan_state_checkpoints()
        )
        self.runner.init_kv_cache(self.num_kv_blocks, self.num_state_checkpoints)
        self.routing_shape = self.runner.routing_shape()
        self.kv_cache_windows = [g.window for g in self.runner.kv_cache_groups]
        self.max_model_len = servable_len(
            self.runner.max_model_len, self.num_kv_blocks, config.cache.block_size,
            self.kv_cache_windows, config.scheduler.max_num_batched_tokens,
        )  # fmt: skip
        self.vocab_size = self.runner.vocab_size
        self.model_summary = self.runner.model_summary

    def submit_step(self, step: SchedulerOutput, bitmasks: BitmaskSource | None = None) -> None:
        self._output = self.runner.execute_model(step, bitmasks)

    def collect_step(self) -> ModelRunnerOutput:
        output, self._output = self._output, None
        assert output is not None, "no step was submitted"
        return output

    def execute_model(
        self, step: SchedulerOutput, bitmasks: BitmaskSource | None = None
    ) -> ModelRunnerOutput:
        self.submit_step(step, bitmasks)
        return self.collect_step()

    def run_control(self, call: ControlCall) -> list[str]:
        try:
            self.control.handle(call)
        except Exception as e:  # noqa: BLE001 - reported like a worker's control error
            return [f"rank 0: {type(e).__name__}: {e}"]
        return []

    def shutdown(self) -> None:
        pass


class MultiprocExecutor:
    """tp x pp worker processes on this node; the step goes out once, the driver rank answers it.

    Rank r is TP rank r % tp of pipeline stage r // tp. The workers join one torch.distributed world
    through a TCP store at a free port picked here (unique per instance) on 127.0.0.1, or with
    several nodes on --dist-init-addr's host, whose own port is then the nodes' meeting point.
    Replies come from every rank for `InitKVCache` and from the driver only (TP rank 0 of the last
    stage, on the last node) for `ExecuteModel`; an error reply from any rank fails the engine.
    """

    def __init__(self, config: Config) -> None:
        from workers.worker_proc import run_worker

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
        reply_addr = config.ipc_path("worker_output")
        self._ipc_dir = config.ipc_dir
        self._reply_file = reply_addr.removeprefix("ipc://")  # removed at shutdown
        self._replies.bind(reply_addr)
        # With several nodes, everything other nodes reach listens on --dist-init-addr's host.
        host = "127.0.0.1"
        if parallel.nnodes > 1:
            assert parallel.dist_init_addr is not None
            host = socket.gethostbyname(parallel.dist_init_addr.rpartition(":")[0])
        self._mq = MessageQueue(
            n_reader=self.world_size,
            n_local_reader=parallel.ranks_per_node,
            connect_ip=host,
            parent_dir=config.ipc_dir,
        )
        try:
            store_addr = parallel.dist_init_addr
            if parallel.nnodes > 1 or store_addr is None:
                store_addr = f"{host}:{free_port(host)}"
            config = config.replace(
                parallel=dataclasses.replace(parallel, dist_init_addr=store_addr)
            )
            if parallel.nnodes > 1:
                remote_reply_port = self._replies.bind_to_random_port(f"tcp://{host}")
                bootstrap = NodeBootstrap(
                    self._mq.export_handle(), f"tcp://{host}:{remote_reply_port}", store_addr
                )
                self._nodes = NodeMonitor(self._ctx, parallel, bootstrap)
            self.config = config
            mp = multiprocessing.get_context("spawn")
            for rank in parallel.node_ranks:
                proc = mp.Process(
                    target=run_worker,
                    args=(config, rank, self._mq.export_handle(), reply_addr),
                    name=f"tern-worker-{rank}",
                )
                proc.start()
                self.procs.append(proc)
            if self._nodes is not None:
                self._nodes.wait_for_nodes(config.startup_timeout_s, self.check_health)
            self._mq.wait_until_ready(timeout=config.startup_timeout_s)
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
        except BaseException:
            self._failed = True
            self.shutdown()
            raise
        driver = readies[self.driver_rank]
        self.kv_cache_windows = driver.kv_cache_windows
        self.routing_shape = driver.routing_shape
        self.max_model_len = servable_len(
            driver.max_model_len, self.num_kv_blocks, config.cache.block_size,
            self.kv_cache_windows, config.scheduler.max_num_batched_tokens,
        )  # fmt: skip
        self.vocab_size = driver.vocab_size
        self.model_summary = driver.model_summary

    def submit_step(self, step: SchedulerOutput, bitmasks: BitmaskSource | None = None) -> None:
        self._broadcast(ExecuteModel(step))
        if step.grammar_bitmasks_follow:
            assert bitmasks is not None, "the step promises grammar bitmasks"
            self._broadcast(GrammarBitmasks(step.step_id, bitmasks()))

    def collect_step(self) -> ModelRunnerOutput:
        (result,) = self._gather(WorkerResult, timeout=None, ranks=1)
        assert result.rank == self.driver_rank and result.output is not None, result
        return result.output

    def execute_model(
        self, step: SchedulerOutput, bitmasks: BitmaskSource | None = None
    ) -> ModelRunnerOutput:
        self.submit_step(step, bitmasks)
        return self.collect_step()

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
            if _is_stopped(proc.pid):
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
        if not self._failed and all(p.is_alive() for p in self.procs):
            try:
                self._mq.enqueue(self._call_codec.encode(Shutdown()), timeout=1.0)
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
        self._mq.close()
        self._replies.close(linger=0)
        self._ctx.term()
        with contextlib.suppress(OSError):  # an in-process engine core's; a server's frontend
            os.unlink(self._reply_file)  # removes its own, which holds its sockets too
            os.rmdir(self._ipc_dir)


class NodeMonitor:
    """Node 0's end of the other nodes' worker launchers (--nnodes > 1), on a thread of its own so
    that heartbeats are answered while a step runs.

    Binds a ROUTER socket at --dist-init-addr, answers each node's `NodeHello` with the bootstrap,
    acknowledges heartbeats, and records what went wrong for `check_health` to raise: a node's
    worker exited, or a node fell silent for NODE_TIMEOUT_S. On close it tells every node to stop.
    """

    def __init__(
        self, ctx: zmq.Context, parallel: ParallelConfig, bootstrap: NodeBootstrap
    ) -> None:
        assert parallel.dist_init_addr is not None
        self.parallel = parallel
        self.bootstrap = bootstrap
        self.error: str | None = None  # the first failure of another node
        self.killed: str | None = None  # the same, when a worker died of a signal
        self.num_joined = 0
        self._last_seen: dict[int, float] = {}  # node rank -> monotonic time of its last message
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 1000)
        host, _, port = parallel.dist_init_addr.rpartition(":")
        try:
            self._sock.bind(f"tcp://{socket.gethostbyname(host)}:{port}")
        except zmq.ZMQError as e:
            self._sock.close(linger=0)
            raise ValueError(f"--dist-init-addr {parallel.dist_init_addr}: {e}") from None
        self._in = Codec(NodeToCore)
        self._out = Codec(CoreToNode)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tern-node-monitor", daemon=True)
        self._thread.start()

    def wait_for_nodes(self, timeout: float, check_health: Callable[[], None]) -> None:
        deadline = time.monotonic() + timeout
        while self.num_joined < self.parallel.nnodes - 1:
            check_health()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.num_joined} of {self.parallel.nnodes - 1} other nodes joined within "
                    f"{timeout:.0f} s (is `--node-rank N --dist-init-addr "
                    f"{self.parallel.dist_init_addr}` running on each?)"
                )
            time.sleep(0.05)

    def _fail(self, error: str, killed: bool = False) -> None:
        if self.error is None:
            logger.error("%s", error)
            self.error = error
        if killed and self.killed is None:
            self.killed = error

    def _handle(self, ident: bytes, msg: object, peers: dict[int, bytes]) -> None:
        if isinstance(msg, NodeHello):
            error = None
            if msg.world_size != self.parallel.world_size:
                error = f"node {msg.node_rank} runs tp x pp = {msg.world_size}, node 0 runs {self.parallel.world_size}"
            elif not 0 < msg.node_rank < self.parallel.nnodes or msg.node_rank in peers:
                error = f"unexpected or duplicate --node-rank {msg.node_rank}"
            reply = (
                self.bootstrap
                if error is None
                else msgspec.structs.replace(self.bootstrap, error=error)
            )
            self._sock.send_multipart([ident, self._out.encode(reply)])
            if error is None:
                peers[msg.node_rank] = ident
                self._last_seen[msg.node_rank] = time.monotonic()
                self.num_joined = len(peers)
            else:
                self._fail(error)
        elif isinstance(msg, NodeHeartbeat):
            self._last_seen[msg.node_rank] = time.monotonic()
            self._sock.send_multipart([ident, self._out.encode(NodeAck())])
        elif isinstance(msg, NodeWorkerExited):
            self._fail(
                f"worker tern-worker-{msg.rank} on node {msg.node_rank} died "
                f"(exit code {msg.exitcode})",
                killed=msg.exitcode not in (0, 1),
            )

    def _run(self) -> None:
        peers: dict[int, bytes] = {}
        try:
            while not self._stop.is_set():
                if self._sock.poll(100):
                    ident, data = self._sock.recv_multipart()
                    try:
                        self._handle(ident, self._in.decode(data), peers)
                    except msgspec.ValidationError as e:
                        logger.error("dropping a malformed node message: %s", e)
                now = time.monotonic()
                for node, seen in self._last_seen.items():
                    if now - seen > NODE_TIMEOUT_S:
                        self._fail(f"node {node} sent no heartbeat for {NODE_TIMEOUT_S:.0f} s")
            for ident in peers.values():
                self._sock.send_multipart([ident, self._out.encode(NodeStop())])
        finally:
            self._sock.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now (another process may still take it before it is bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]

"""The worker process: one per rank. Reads calls from the step broadcast, runs them, replies over ZMQ.

Lifecycle: connect to the broadcast and the reply socket, check that the model can be split as asked,
join the torch.distributed world (world size > 1), load this rank's shard of the model, report
`WorkerReady` (with how many KV blocks fit), then serve calls until `Shutdown`, SIGTERM, or the
engine core's death. Every rank runs every `ExecuteModel` (the collectives need all of them); only
the driver rank (TP rank 0 of the last pipeline stage) answers it. Every rank answers the other
calls. A failure is reported as a `WorkerResult` with the error, and the process exits non-zero.

`run_worker_node` is the main loop of a node other than node 0 (--nnodes > 1, --node-rank > 0): it
joins node 0's executor at --dist-init-addr, starts this node's ranks, and heartbeats until node 0
says stop, a worker dies (node 0 is told at once) or node 0 falls silent.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

import zmq

from enginecore.config import Config
from enginecore.messages import (
    CONTROL_CALLS,
    Codec,
    ControlCall,
    CoreToNode,
    ExecuteModel,
    GrammarBitmasks,
    InitKVCache,
    NodeAck,
    NodeBootstrap,
    NodeHeartbeat,
    NodeHello,
    NodeStop,
    NodeToCore,
    NodeWorkerExited,
    Shutdown,
    WorkerCall,
    WorkerReady,
    WorkerReply,
    WorkerResult,
)
from enginecore.shm_broadcast import Handle, MessageQueue

if TYPE_CHECKING:
    from workers.kv_transfer.lender import KVLender
    from workers.runner.model_runner import ModelRunner
    from workers.worker_control import WorkerControl

logger = logging.getLogger("tern.worker")

# How often a worker waiting for work checks that the engine core still exists.
PARENT_CHECK_S = 1.0
# A node launcher's heartbeat period, and how long node 0 may stay silent before the node stops.
HEARTBEAT_S = 1.0
NODE_TIMEOUT_S = 5.0


def num_threads(ranks_per_node: int) -> int:
    """Torch threads per worker: the cores this process may run on (its CPU affinity: a server
    started under `taskset` or in a cpuset gets those, not the machine's) split between the
    node's workers."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // ranks_per_node)


def _build_runner(
    config: Config, rank: int, mq: MessageQueue, device_index: int | None = None
) -> ModelRunner:
    """Checks the split, joins the distributed world and loads this rank's shard of the model."""
    import torch

    from workers.distributed import init_distributed
    from workers.models.args import load_model_args
    from workers.runner.loading import check_parallel_split, default_device
    from workers.runner.model_runner import ModelRunner
    from workers.worker_control import reuse_heap_for_activations

    parallel = config.parallel
    torch.set_num_threads(num_threads(parallel.num_local_workers))  # every replica's workers
    reuse_heap_for_activations()
    # NOTE: first: the executor waits for every reader's subscription before anything else.
    mq.wait_until_ready(timeout=config.startup_timeout_s)
    # Deterministic start-up errors come before the rendezvous, which would wait for dead peers.
    check_parallel_split(load_model_args(config.model.path), parallel)
    # NOTE: a Ray actor sees only the GPU Ray gave it (device_index 0).
    placed = device_index is not None
    device = default_device(device_index if placed else parallel.first_device_index + rank)
    if device.type == "cuda" and not placed:
        if torch.cuda.device_count() < parallel.num_local_workers:
            raise ValueError(
                f"dp x tp x pp = {parallel.num_local_workers} workers need as many GPUs on "
                f"this node, {torch.cuda.device_count()} visible"
            )
        torch.cuda.set_device(device)
    context = init_distributed(parallel, rank)
    runner = ModelRunner(config, rank=rank, device=device, parallel=context)
    runner.load_model()
    return runner


def _next_bitmasks(
    mq: MessageQueue, codec: Codec, step_id: int, parent_pid: int
) -> dict[str, bytes]:
    """The grammar bitmasks that follow step `step_id` on the broadcast (the sampling rank's)."""
    while True:
        try:
            data = mq.dequeue(timeout=PARENT_CHECK_S)
            break
        except TimeoutError:
            if os.getppid() != parent_pid:
                raise RuntimeError("the engine core is gone") from None
    call = codec.decode(data)
    if not isinstance(call, GrammarBitmasks) or call.step_id != step_id:
        raise RuntimeError(f"expected the grammar bitmasks of step {step_id}, got {call!r:.80}")
    return call.bitmasks


def _run_control(control: WorkerControl, call: ControlCall, rank: int) -> WorkerResult:
    """A failed control call (bad checkpoint path, trainer gone) is the caller's error, not fatal."""
    try:
        control.handle(call)
    except Exception as e:  # noqa: BLE001 - every failure goes back to the caller
        logger.warning("rank %d: %s failed: %s", rank, type(call).__name__, e)
        return WorkerResult(rank=rank, control_error=f"{type(e).__name__}: {e}")
    return WorkerResult(rank=rank)


def ready_report(
    runner: ModelRunner, rank: int, num_kv_blocks: int, lender: KVLender | None = None
) -> WorkerReady:
    """What a rank tells the engine core once its model is loaded: what fits, what it serves;
    with --kv-transfer-config, what its KV blocks are and where it lends them."""
    num_checkpoints, checkpoint_interval = runner.plan_state_checkpoints()
    kv_transfer = runner.config.kv_transfer.enabled
    return WorkerReady(
        rank=rank,
        num_kv_blocks=num_kv_blocks,
        max_model_len=runner.max_model_len,
        vocab_size=runner.vocab_size,
        model_summary=runner.model_summary,
        kv_cache_windows=[g.window for g in runner.kv_cache_groups],
        num_state_checkpoints=num_checkpoints,
        state_checkpoint_interval=checkpoint_interval,
        routing_shape=runner.routing_shape(),
        kv_endpoint=lender.endpoint if lender is not None else "",
        kv_layout=runner.kv_layout() if kv_transfer else None,
    )


def start_lender(config: Config, runner: ModelRunner) -> KVLender | None:
    """A producer's rank lends its KV blocks from start-up on (none are lent before the cache
    is allocated: the engine core lends only blocks of finished prompts)."""
    if not config.kv_transfer.produces:
        return None
    from workers.kv_transfer.lender import KVLender

    return KVLender(
        config.kv_transfer.bootstrap_host, lambda: runner.kv_cache, runner.kv_layout(),
        runner.inputs.checkpoint_states, runner.draft_kv_cache,
    )  # fmt: skip


def _serve_calls(
    runner: ModelRunner,
    rank: int,
    mq: MessageQueue,
    replies: zmq.Socket,
    parent_pid: int,
    stopped: Callable[[], bool],
) -> int:
    """Answers the engine core's broadcast calls until Shutdown or SIGTERM; returns the exit
    code (1 when the engine core is gone)."""
    from workers.worker_control import WorkerControl

    reply_codec = Codec(WorkerReply)
    call_codec = Codec(WorkerCall)
    is_driver = runner.parallel.is_driver
    control = WorkerControl(runner, rank)
    while not stopped():
        try:
            data = mq.dequeue(timeout=PARENT_CHECK_S)
        except TimeoutError:
            if os.getppid() != parent_pid:
                logger.error("engine core is gone; worker %d exits", rank)
                return 1
            continue
        call = call_codec.decode(data)
        if isinstance(call, Shutdown):
            break
        if isinstance(call, InitKVCache):
            first = runner.num_kv_blocks == 0
            runner.init_kv_cache(call.num_blocks, call.num_state_checkpoints)
            if first and rank == 0:
                floor = runner.decode_floor()
                logger.info("%s%s", runner.kernel_report(), f"; {floor}" if floor else "")
            replies.send(reply_codec.encode(WorkerResult(rank=rank)))
        elif isinstance(call, ExecuteModel):
            step = call.step
            output = runner.execute_model(
                step,
                lambda step_id=step.step_id: _next_bitmasks(mq, call_codec, step_id, parent_pid),
            )
            if is_driver:
                replies.send(reply_codec.encode(WorkerResult(rank=rank, output=output)))
        elif isinstance(call, GrammarBitmasks):
            pass  # the sampling rank read its own inside its step; the others skip it
        elif isinstance(call, CONTROL_CALLS):
            replies.send(reply_codec.encode(_run_control(control, call, rank)))
    return 0


def run_worker(
    config: Config, rank: int, mq_handle: Handle, reply_addr: str, device_index: int | None = None
) -> None:
    """Process entry point (spawned by MultiprocExecutor, by a node's worker launcher, or run in
    a Ray actor by RayExecutor, which gives the device index of the one GPU the actor sees)."""
    parallel = config.parallel
    name = (
        f"worker{parallel.data_parallel_rank}.{rank}"
        if parallel.data_parallel_size > 1
        else f"worker{rank}"
    )
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(message)s")
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    # Ctrl-C reaches the whole process group; the parent decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent_pid = os.getppid()

    ctx = zmq.Context()
    replies = ctx.socket(zmq.PUSH)
    replies.setsockopt(zmq.LINGER, 1000)
    replies.connect(reply_addr)
    reply_codec = Codec(WorkerReply)
    mq = MessageQueue.create_from_handle(mq_handle, rank)
    exit_code = 0
    lender = None
    try:
        runner = _build_runner(config, rank, mq, device_index)
        lender = start_lender(config, runner)
        ready = ready_report(runner, rank, runner.num_kv_blocks_for_memory(), lender)
        replies.send(reply_codec.encode(ready))
        exit_code = _serve_calls(runner, rank, mq, replies, parent_pid, lambda: stop)
        if exit_code == 0:
            from workers.distributed import destroy_distributed

            destroy_distributed()
    except Exception as e:  # report to the engine core, then exit non-zero
        logger.error("worker %d failed:\n%s", rank, traceback.format_exc())
        error = f"{type(e).__name__}: {e}"
        try:
            replies.send(reply_codec.encode(WorkerResult(rank=rank, error=error)), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        exit_code = 1
    finally:
        if lender is not None:
            lender.close()
        mq.close()
        replies.close()
        ctx.term()
    # NOTE: not sys.exit: a rank that ran gloo collectives and the OpenMP kernels can abort in
    # interpreter teardown (static destructors with those libraries' threads alive; see
    # tests/dist/gloo_world.py). Everything the worker owns is closed above.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def _join_node_zero(config: Config, sock: zmq.Socket) -> NodeBootstrap:
    parallel = config.parallel
    codec = Codec(CoreToNode)
    sock.send(Codec(NodeToCore).encode(NodeHello(parallel.node_rank, parallel.world_size)))
    if not sock.poll(config.startup_timeout_s * 1000):
        raise TimeoutError(f"node 0 did not answer at {parallel.dist_init_addr}")
    reply = codec.decode(sock.recv())
    if not isinstance(reply, NodeBootstrap):
        raise RuntimeError(f"expected the bootstrap from node 0, got {type(reply).__name__}")
    if reply.error is not None:
        raise ValueError(f"node 0 refused this node: {reply.error}")
    return reply


def _stop_procs(procs: list[BaseProcess], grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout=1.0)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=1.0)


def run_worker_node(config: Config) -> int:
    """Runs this node's ranks for node 0's engine core; returns the exit code (0: told to stop)."""
    parallel = config.parallel
    assert parallel.nnodes > 1 and parallel.node_rank > 0 and parallel.dist_init_addr
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(f"tcp://{parallel.dist_init_addr}")
    procs: list[BaseProcess] = []
    exit_code = 1
    try:
        boot = _join_node_zero(config, sock)
        worker_parallel = dataclasses.replace(parallel, dist_init_addr=boot.store_addr)
        worker_config = config.replace(parallel=worker_parallel)
        mp = multiprocessing.get_context("spawn")
        for rank in parallel.node_ranks:
            args = (worker_config, rank, boot.mq_handle, boot.reply_addr)
            procs.append(mp.Process(target=run_worker, args=args, name=f"tern-worker-{rank}"))
            procs[-1].start()
        logger.info("node %d runs ranks %s", parallel.node_rank, list(parallel.node_ranks))
        exit_code = _watch(config, sock, procs, lambda: stop)
    except Exception:
        logger.error("node %d failed:\n%s", parallel.node_rank, traceback.format_exc())
    finally:
        _stop_procs(procs, grace_s=3.0 if exit_code == 0 else 0.5)
        sock.close()
        ctx.term()
    return exit_code


def _watch(
    config: Config, sock: zmq.Socket, procs: list[BaseProcess], stopped: Callable[[], bool]
) -> int:
    """Heartbeats to node 0 and watches this node's workers; returns the node's exit code."""
    node = config.parallel.node_rank
    to_core, from_core = Codec(NodeToCore), Codec(CoreToNode)
    last_ack = next_beat = time.monotonic()
    while not stopped():
        now = time.monotonic()
        if now >= next_beat:
            sock.send(to_core.encode(NodeHeartbeat(node)))
            next_beat = now + HEARTBEAT_S
        if now - last_ack > NODE_TIMEOUT_S:
            logger.error("node 0 sent nothing for %.0f s; node %d stops", NODE_TIMEOUT_S, node)
            return 1
        while sock.poll(0):
            msg = from_core.decode(sock.recv())
            if isinstance(msg, NodeStop):
                return 0
            if isinstance(msg, NodeAck):
                last_ack = time.monotonic()
        # NOTE: is_alive() reaps an exited worker and sets its exit code, so the codes are read
        # after it: a killed worker must never pass for one that exited cleanly.
        alive = [p for p in procs if p.is_alive()]
        for rank, proc in zip(config.parallel.node_ranks, procs):
            if proc.exitcode not in (None, 0):  # 0: Shutdown, the others follow
                sock.send(to_core.encode(NodeWorkerExited(node, rank, proc.exitcode)))
                return 1
        if not alive:  # every worker exited cleanly (Shutdown broadcast)
            return 0
        wait([p.sentinel for p in alive], timeout=0.2)
    return 0

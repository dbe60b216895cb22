"""The worker process: one per rank. Reads calls from the step broadcast, runs them, replies over ZMQ.

Lifecycle: connect to the broadcast and the reply socket, load the model, report `WorkerReady`
(with how many KV blocks fit), then serve calls until `Shutdown`, SIGTERM, or the engine core's death.
Only rank 0 answers `ExecuteModel`; every rank answers the other calls. A failure is reported as a
`WorkerResult` with the error, and the process exits non-zero.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback

import zmq

from enginecore.config import Config
from enginecore.messages import (
    Codec,
    ExecuteModel,
    InitKVCache,
    Shutdown,
    WorkerCall,
    WorkerReady,
    WorkerReply,
    WorkerResult,
)
from enginecore.shm_broadcast import Handle, MessageQueue

logger = logging.getLogger("tern.worker")

# How often a worker waiting for work checks that the engine core still exists.
PARENT_CHECK_S = 1.0


def _num_threads(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // world_size)


def run_worker(config: Config, rank: int, mq_handle: Handle) -> None:
    """Process entry point (spawned by MultiprocExecutor)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s worker{rank} %(message)s")
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
    replies.connect(config.ipc_path("worker_output"))
    reply_codec = Codec(WorkerReply)
    call_codec = Codec(WorkerCall)
    mq = MessageQueue.create_from_handle(mq_handle, rank)
    exit_code = 0
    try:
        import torch

        from workers.model_runner import ModelRunner

        torch.set_num_threads(_num_threads(config.parallel.world_size))
        mq.wait_until_ready(timeout=config.startup_timeout_s)
        runner = ModelRunner(config, rank=rank)
        runner.load_model()
        replies.send(
            reply_codec.encode(
                WorkerReady(
                    rank=rank,
                    num_kv_blocks=runner.num_kv_blocks_for_memory(),
                    max_model_len=runner.max_model_len,
                    vocab_size=runner.vocab_size,
                    model_summary=runner.model_summary,
                )
            )
        )
        while not stop:
            try:
                data = mq.dequeue(timeout=PARENT_CHECK_S)
            except TimeoutError:
                if os.getppid() != parent_pid:
                    logger.error("engine core is gone; worker %d exits", rank)
                    exit_code = 1
                    break
                continue
            call = call_codec.decode(data)
            if isinstance(call, Shutdown):
                break
            if isinstance(call, InitKVCache):
                runner.init_kv_cache(call.num_blocks)
                replies.send(reply_codec.encode(WorkerResult(rank=rank)))
            elif isinstance(call, ExecuteModel):
                output = runner.execute_model(call.step)
                if rank == 0:
                    replies.send(reply_codec.encode(WorkerResult(rank=rank, output=output)))
    except Exception as e:  # report to the engine core, then exit non-zero
        logger.error("worker %d failed:\n%s", rank, traceback.format_exc())
        error = f"{type(e).__name__}: {e}"
        try:
            replies.send(reply_codec.encode(WorkerResult(rank=rank, error=error)), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        exit_code = 1
    finally:
        mq.close()
        replies.close()
        ctx.term()
    sys.exit(exit_code)

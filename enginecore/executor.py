"""Executors run scheduler steps on the workers.

- `InProcExecutor`: the model runner in the calling process (tests, scripts/bench_step.py).
- `MultiprocExecutor`: one spawned worker process per rank. Each step goes out once through the
  shared-memory broadcast (every rank reads it); replies come back on one ZMQ PULL socket. Worker
  processes are watched: a dead worker fails the step with `WorkerDied` within a poll interval.

The engine core imports no torch: only workers use torch threads.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from multiprocessing.process import BaseProcess
from typing import Protocol

import zmq

from enginecore.config import Config
from enginecore.messages import (
    Codec,
    ExecuteModel,
    InitKVCache,
    ModelRunnerOutput,
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


class WorkerDied(RuntimeError):
    pass


class Executor(Protocol):
    num_kv_blocks: int
    max_model_len: int
    vocab_size: int
    model_summary: str

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None: ...


class InProcExecutor:
    def __init__(self, config: Config) -> None:
        from workers.model_runner import ModelRunner  # torch only where a runner lives

        self.runner = ModelRunner(config, rank=0)
        self.runner.load_model()
        self.num_kv_blocks = self.runner.num_kv_blocks_for_memory()
        self.runner.init_kv_cache(self.num_kv_blocks)
        self.max_model_len = min(
            self.runner.max_model_len, self.num_kv_blocks * config.cache.block_size
        )
        self.vocab_size = self.runner.vocab_size
        self.model_summary = self.runner.model_summary

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(step)

    def shutdown(self) -> None:
        pass


class MultiprocExecutor:
    def __init__(self, config: Config) -> None:
        from workers.worker_proc import run_worker

        self.config = config
        self.world_size = config.parallel.world_size
        self._call_codec = Codec(WorkerCall)
        self._reply_codec = Codec(WorkerReply)
        self._ctx = zmq.Context()
        self._replies = self._ctx.socket(zmq.PULL)
        self._replies.setsockopt(zmq.LINGER, 0)
        self._replies.bind(config.ipc_path("worker_output"))
        self._mq = MessageQueue(n_reader=self.world_size, n_local_reader=self.world_size)
        handle = self._mq.export_handle()
        mp = multiprocessing.get_context("spawn")
        self.procs: list[BaseProcess] = []
        try:
            for rank in range(self.world_size):
                proc = mp.Process(
                    target=run_worker, args=(config, rank, handle), name=f"tern-worker-{rank}"
                )
                proc.start()
                self.procs.append(proc)
            self._mq.wait_until_ready(timeout=config.startup_timeout_s)
            readies = self._gather(WorkerReady, config.startup_timeout_s)
            self.num_kv_blocks = min(r.num_kv_blocks for r in readies)
            if self.num_kv_blocks < 1:
                raise RuntimeError("--kv-cache-memory is too small for one KV-cache block")
            self._broadcast(InitKVCache(self.num_kv_blocks))
            self._gather(WorkerResult, config.startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        kv_tokens = self.num_kv_blocks * config.cache.block_size
        self.max_model_len = min(readies[0].max_model_len, kv_tokens)
        self.vocab_size = readies[0].vocab_size
        self.model_summary = readies[0].model_summary

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        self._broadcast(ExecuteModel(step))
        (result,) = self._gather(WorkerResult, timeout=None, ranks=1)
        assert result.output is not None
        return result.output

    def check_health(self) -> None:
        for proc in self.procs:
            if not proc.is_alive():
                raise WorkerDied(f"worker {proc.name} died (exit code {proc.exitcode})")

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
                    raise RuntimeError(f"worker {reply.rank} failed: {reply.error}")
                assert isinstance(reply, typ), reply
                replies.append(reply)
                continue
            self.check_health()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"workers did not answer within {timeout:.0f} s")
        return sorted(replies, key=lambda r: r.rank)

    def shutdown(self) -> None:
        """Asks workers to stop, then terminates and finally kills the ones that do not."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if any(p.is_alive() for p in self.procs):
            try:
                self._mq.enqueue(self._call_codec.encode(Shutdown()), timeout=1.0)
            except Exception:  # ring full or readers gone: terminate below
                pass
        deadline = time.monotonic() + 3.0
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(timeout=2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=1.0)
        self._mq.close()
        self._replies.close(linger=0)
        self._ctx.term()

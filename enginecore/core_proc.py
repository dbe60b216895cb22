"""The engine-core process: the busy loop around EngineCore, its sockets, and its workers' lifetime.

Frontend -> core: 2-frame messages [RequestType byte, msgpack body] on a PULL socket.
Core -> frontend: one `EngineStartup` message, then `EngineCoreOutputs` on a PUSH socket.

The loop blocks on its input socket while there is nothing to run (no busy-spinning: this process
shares two cores with the workers), and runs one step after another while there is.
SchedulerStats ride along with the outputs at most every STATS_INTERVAL_S, and always on the messages
that leave the engine idle and that follow idleness (so the frontend's gauges come back to zero, and
leave it as soon as work starts). While busy, one log line
every LOG_INTERVAL_S gives throughput, queue lengths, KV-cache usage and prefix-cache hit rate.
A worker that dies, or a step that fails, ends every request with an error, tells the frontend
(`engine_dead`) and exits non-zero after stopping the remaining workers. A heartbeat thread sends an
empty EngineCoreOutputs every HEARTBEAT_INTERVAL_S on its own socket, also inside long steps and
control calls, so that the frontend can tell a stopped or frozen process from a slow step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable

import msgspec
import zmq

from enginecore.config import Config
from enginecore.control import EngineControl
from enginecore.core import EngineCore
from enginecore.executor import MultiprocExecutor
from enginecore.messages import (
    Codec,
    EngineCoreAbort,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    EngineStartupFailed,
    KVLeaseRelease,
    KVPulled,
    RequestType,
    SchedulerStats,
    UtilityCall,
    UtilityResult,
)

logger = logging.getLogger("tern.engine")

# An idle loop's wait for input; also how late a SIGTERM is noticed (the poll does not return
# for it), which every stop pays.
IDLE_POLL_MS = 100
STATS_INTERVAL_S = 0.5
LOG_INTERVAL_S = 5.0
HEARTBEAT_INTERVAL_S = 1.0


def make_executor(config: Config) -> MultiprocExecutor:
    """The executor --distributed-executor-backend names (Ray is imported only for "ray")."""
    if config.parallel.distributed_executor_backend == "ray":
        from enginecore.ray_executor import RayExecutor

        return RayExecutor(config)
    return MultiprocExecutor(config)


class EngineCoreProc:
    def __init__(self, config: Config, ctx: zmq.Context) -> None:
        self.config = config
        self.input = ctx.socket(zmq.PULL)
        self.input.setsockopt(zmq.LINGER, 0)
        self.input.connect(config.ipc_path("engine_input"))
        # NOTE: bound as well: this process's own KV puller threads post their KVPulled here.
        self.input.bind(config.ipc_path("kv_pulled"))
        self._poller = zmq.Poller()
        self._poller.register(self.input, zmq.POLLIN)
        self._wake_up: int | None = None
        self.output = ctx.socket(zmq.PUSH)
        self.output.setsockopt(zmq.LINGER, 2000)
        self.output.connect(config.ipc_path("engine_output"))
        self.encoder = msgspec.msgpack.Encoder()
        self.decoders = {
            RequestType.ADD.value: msgspec.msgpack.Decoder(EngineCoreRequest),
            RequestType.ABORT.value: msgspec.msgpack.Decoder(EngineCoreAbort),
            RequestType.UTILITY.value: msgspec.msgpack.Decoder(UtilityCall),
            RequestType.RELEASE_KV.value: msgspec.msgpack.Decoder(KVLeaseRelease),
            RequestType.KV_PULLED.value: msgspec.msgpack.Decoder(KVPulled),
        }
        self.should_stop = False
        self.core: EngineCore | None = None
        self.parent_pid = os.getppid()
        self._last_stats_time = 0.0
        self._sent_idle = True  # the last stats sent showed no request
        self._stats_logger = StatsLogger()

    def wake_on_signals(self) -> None:
        """A signal with a Python handler (SIGTERM) ends the idle wait for input at once, so a
        stop takes effect now rather than after IDLE_POLL_MS: Python writes a byte to the wake-up
        pipe as the signal arrives, and the pipe is polled beside the input (main thread only)."""
        read_end, write_end = os.pipe()
        os.set_blocking(read_end, False)
        os.set_blocking(write_end, False)
        signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        self._poller.register(read_end, zmq.POLLIN)
        self._wake_up = read_end

    def start(self) -> None:
        executor = make_executor(self.config)
        self.core = EngineCore(self.config, executor)
        self.control = EngineControl(self.core)
        block_size = self.config.cache.block_size
        logger.info(
            "engine core ready: %s; KV cache %d blocks x %d = %d tokens; max_model_len %d",
            executor.model_summary,
            executor.num_kv_blocks,
            block_size,
            executor.num_kv_blocks * block_size,
            executor.max_model_len,
        )
        ready = EngineReady(
            num_kv_blocks=executor.num_kv_blocks,
            block_size=block_size,
            max_model_len=executor.max_model_len,
            vocab_size=executor.vocab_size,
            model_summary=executor.model_summary,
            task=self.core.model_task.task,
            pooling_type=self.config.model.pooling_type,
            pooled_size=self.core.model_task.pooled_size,
            id2label=self.core.model_task.id2label,
            kv_endpoints=executor.kv_endpoints,
            kv_layouts=executor.kv_layouts,
        )
        self.output.send(Codec(EngineReady).encode(ready))

    def run(self) -> None:
        assert self.core is not None
        core = self.core
        control = self.control
        # NOTE: a step's outputs go to the frontend after the next step is launched: the workers
        # compute while the frontend and the client handle the token. Inputs are read between
        # the two, when no step is in flight (control calls run on the workers).
        while not self.should_stop:
            outputs = self._stamped(core.finish_step())  # before a weight update in the inputs
            results: list[UtilityResult] = []
            busy = control.is_busy()
            ready = dict(self._poller.poll(0 if busy or outputs else IDLE_POLL_MS))
            if self._wake_up in ready:  # emptied, lest another signal's byte keep it readable
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_up, 4096)
            if self.input in ready:
                self._drain_inputs(outputs, results)
            elif not busy and not outputs:
                core.expire_kv_leases()
                self._check_liveness()
                self._stats_logger.maybe_log(core.stats)
                continue
            results.extend(control.poll_deferred())
            if control.is_busy():
                outputs.extend(core.launch_step(admit_waiting=control.can_admit))
            self._stamped(outputs)
            if outputs or results:
                msg = EngineCoreOutputs(
                    outputs, results, timestamp=time.time(), scheduler_stats=self._stats_to_send()
                )
                self.output.send(self.encoder.encode(msg))
            if busy:
                self._stats_logger.maybe_log(core.stats)

    def _stamped(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Names the weight version on each finished output that has none yet."""
        for out in outputs:
            if out.finish_reason is not None and out.weight_version is None:
                out.weight_version = self.control.weight_version
        return outputs

    def _stats_to_send(self) -> SchedulerStats | None:
        assert self.core is not None
        now = time.monotonic()
        is_idle = not self.core.scheduler.has_requests
        if not is_idle and not self._sent_idle and now - self._last_stats_time < STATS_INTERVAL_S:
            return None
        self._last_stats_time, self._sent_idle = now, is_idle
        return self.core.stats()

    def _drain_inputs(self, outputs: list[EngineCoreOutput], results: list[UtilityResult]) -> None:
        assert self.core is not None
        while True:
            try:
                kind, body = self.input.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            decoder = self.decoders.get(kind)
            if decoder is None:
                logger.error("dropping a message of unknown type %r", kind)
                continue
            msg = decoder.decode(body)
            if isinstance(msg, EngineCoreRequest):
                outputs.extend(self.core.add_request(msg))
            elif isinstance(msg, EngineCoreAbort):
                outputs.extend(self.core.abort_requests(msg.request_ids))
            elif isinstance(msg, KVPulled):
                outputs.extend(self.core.kv_pulled(msg))
            elif isinstance(msg, KVLeaseRelease):
                self.core.release_kv_leases(msg.lease_ids)
            else:
                result = self._run_utility(msg, outputs)
                if result is not None:
                    results.append(result)

    def _run_utility(
        self, call: UtilityCall, outputs: list[EngineCoreOutput]
    ) -> UtilityResult | None:
        assert self.core is not None
        # NOTE: worker failures inside a control call propagate: they are fatal for the engine.
        return self.control.handle(call.call_id, call.op, outputs)

    def _check_liveness(self) -> None:
        assert self.core is not None
        self.core.executor.check_health()
        if os.getppid() != self.parent_pid:
            logger.error("frontend is gone; engine core exits")
            self.should_stop = True

    def fail(self, error: str) -> None:
        """Ends every request with an error and tells the frontend the engine is dead."""
        outputs = self.core.fail_all(error) if self.core is not None else []
        msg = EngineCoreOutputs(outputs, timestamp=time.time(), engine_dead=error)
        try:
            self.output.send(self.encoder.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def shutdown(self) -> None:
        if self.core is not None:
            self.core.shutdown()


class Heartbeat:
    """A thread sending an empty EngineCoreOutputs every HEARTBEAT_INTERVAL_S: proof of life.

    NOTE: it proves the process runs, not that the busy loop progresses: a step or a weight load may
    rightly block the loop for minutes, and the frontend must not take that for a hang.
    """

    def __init__(self, config: Config, ctx: zmq.Context) -> None:
        self._address = config.ipc_path("engine_output")
        self._ctx = ctx
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tern-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)

    def _run(self) -> None:
        # NOTE: a socket of its own (zmq sockets are not thread-safe); the frontend's PULL socket
        # takes both. Started after EngineReady, which must be the first message.
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._address)
        beat = msgspec.msgpack.encode(EngineCoreOutputs())
        try:
            while not self._stop.wait(HEARTBEAT_INTERVAL_S):
                try:
                    sock.send(beat, zmq.NOBLOCK)
                except zmq.Again:
                    pass  # the frontend is not reading: it has bigger problems than our heartbeat
        finally:
            sock.close(linger=0)


class StatsLogger:
    """One line every LOG_INTERVAL_S while there is work: rates over the interval since the last."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last_time = time.monotonic()
        self._last = SchedulerStats(0, 0, 0, 0, 0, 0, 0, 0)  # the totals start at zero

    def maybe_log(self, get_stats: Callable[[], SchedulerStats]) -> str | None:
        """Logs (and returns) the line when an interval with work has passed."""
        now = time.monotonic()
        elapsed = now - self._last_time
        if elapsed < self.interval_s:
            return None
        stats = get_stats()
        last, self._last, self._last_time = self._last, stats, now
        num_prefill = stats.num_prefill_tokens_total - last.num_prefill_tokens_total
        num_generated = stats.num_generated_tokens_total - last.num_generated_tokens_total
        is_busy = stats.num_running_reqs or stats.num_waiting_reqs
        if not (is_busy or num_prefill or num_generated):
            return None  # idle for the whole interval: stay quiet
        queries = stats.prefix_cache_queries - last.prefix_cache_queries
        hits = stats.prefix_cache_hits - last.prefix_cache_hits
        usage = 1.0 - stats.num_free_blocks / max(stats.num_total_blocks, 1)
        line = (
            f"prompt throughput: {num_prefill / elapsed:.1f} tokens/s, "
            f"generation throughput: {num_generated / elapsed:.1f} tokens/s, "
            f"running: {stats.num_running_reqs} reqs, waiting: {stats.num_waiting_reqs} reqs, "
            f"KV cache usage: {100 * usage:.1f}%, "
            f"prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%"
        )
        drafts = stats.spec_num_draft_tokens - last.spec_num_draft_tokens
        if drafts:
            accepted = stats.spec_num_accepted_tokens - last.spec_num_accepted_tokens
            steps = stats.spec_num_drafts - last.spec_num_drafts
            # mean acceptance length: tokens a verifying step yields (accepted drafts + 1)
            line += (
                f", spec decode: draft acceptance rate {100 * accepted / drafts:.1f}%, "
                f"mean acceptance length {1 + accepted / steps:.2f}"
            )
        logger.info(line)
        return line


def run_engine_core(config: Config) -> None:
    """Process entry point (spawned by the frontend's EngineClient)."""
    # With --dp > 1 every line, the periodic stats line too, names its replica.
    parallel = config.parallel
    name = f"engine{parallel.data_parallel_rank}" if parallel.data_parallel_size > 1 else "engine"
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(message)s")
    ctx = zmq.Context()
    proc = EngineCoreProc(config, ctx)
    heartbeat = Heartbeat(config, ctx)

    def on_sigterm(signum: int, frame: object) -> None:
        proc.should_stop = True

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the frontend, which stops us
    proc.wake_on_signals()
    exit_code = 0
    started = False
    try:
        proc.start()
        started = True
        heartbeat.start()
        proc.run()
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
        logger.error("engine core failed:\n%s", traceback.format_exc())
        if started:
            proc.fail(error)
        else:
            proc.output.send(Codec(EngineStartupFailed).encode(EngineStartupFailed(error)))
        exit_code = 1
    finally:
        heartbeat.stop()
        proc.shutdown()
        proc.input.close()
        proc.output.close()
        ctx.term()
    sys.exit(exit_code)

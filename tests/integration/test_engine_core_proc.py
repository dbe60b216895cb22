"""The engine-core process and its worker process, driven over their real ZMQ sockets (no frontend).

Checks the wire contract end to end: start-up handshake, generation equal to the in-process engine,
aborts freeing blocks, stats, clean SIGTERM shutdown, a start-up failure reported in one message, and a
killed worker turning into `engine_dead` with every request failed and the core exiting non-zero.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import time
from pathlib import Path

import msgspec
import psutil
import pytest
import zmq

from enginecore.config import CacheConfig, Config, ModelConfig
from enginecore.core_proc import run_engine_core
from enginecore.messages import (
    Codec,
    EngineCoreAbort,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    EngineStartup,
    EngineStartupFailed,
    FinishReason,
    GetStats,
    RequestType,
    SamplingParams,
    UtilityCall,
)

TIMEOUT_S = 120


class CoreClient:
    def __init__(self, config: Config) -> None:
        self.ipc_dir = config.ipc_dir
        self.ctx = zmq.Context()
        self.inp = self.ctx.socket(zmq.PUSH)
        self.inp.bind(config.ipc_path("engine_input"))
        self.out = self.ctx.socket(zmq.PULL)
        self.out.bind(config.ipc_path("engine_output"))
        self.proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, args=(config,), name="tern-engine-core"
        )
        self.proc.start()
        self.ps = psutil.Process(self.proc.pid)
        self.outputs = Codec(EngineCoreOutputs)

    def startup(self) -> EngineReady | EngineStartupFailed:
        assert self.out.poll(TIMEOUT_S * 1000), "no start-up message"
        return Codec(EngineStartup).decode(self.out.recv())

    def send(self, kind: RequestType, msg: msgspec.Struct) -> None:
        self.inp.send_multipart([kind.value, msgspec.msgpack.encode(msg)])

    def recv(self) -> EngineCoreOutputs:
        assert self.out.poll(TIMEOUT_S * 1000), "engine core went quiet"
        return self.outputs.decode(self.out.recv())

    def stats(self) -> dict:
        self.send(RequestType.UTILITY, UtilityCall(1, GetStats()))
        for _ in range(100):
            msg = self.recv()
            if msg.utility_results:
                return msg.utility_results[0].result
        raise AssertionError("no stats reply")

    def run(self, reqs: dict[str, EngineCoreRequest]) -> dict[str, tuple[list[int], FinishReason]]:
        for r in reqs.values():
            self.send(RequestType.ADD, r)
        toks: dict[str, list[int]] = {k: [] for k in reqs}
        done: dict[str, FinishReason] = {}
        self.logprobs = {k: [] for k in reqs}  # the sampled tokens' (requests that asked)
        for _ in range(10_000):
            if len(done) == len(reqs):
                break
            for o in self.recv().outputs:
                toks[o.request_id] += o.new_token_ids
                if o.new_logprobs is not None:
                    self.logprobs[o.request_id] += o.new_logprobs.logprobs
                if o.finish_reason is not None:
                    done[o.request_id] = o.finish_reason
        return {k: (toks[k], done[k]) for k in reqs}

    def close(self) -> None:
        descendants = self.ps.children(recursive=True) if self.ps.is_running() else []
        if self.proc.is_alive():
            self.proc.terminate()
        self.proc.join(15)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        gone, alive = psutil.wait_procs(descendants, timeout=10)
        for p in alive:
            p.kill()
        self.inp.close(0)
        self.out.close(0)
        self.ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
        assert not alive, f"orphans: {alive}"


def config_for(model_dir: Path, **cache) -> Config:
    return Config(
        model=ModelConfig(path=str(model_dir), dtype="float32"), cache=CacheConfig(**cache)
    )


def greedy(req_id: str, prompt: list[int], n: int = 8) -> EngineCoreRequest:
    return EngineCoreRequest(
        req_id, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    )


def test_generate_abort_stats_and_sigterm(tiny_llama: Path):
    from tests.unit.test_engine_inproc import make_core, run_to_end

    prompts = {f"r{i}": [(7 * i + j) % 500 + 1 for j in range(5 + 9 * i)] for i in range(4)}
    core = make_core(tiny_llama)
    ref, _ = run_to_end(core, {k: (p, greedy(k, p).sampling_params) for k, p in prompts.items()})

    client = CoreClient(config_for(tiny_llama))
    try:
        ready = client.startup()
        assert isinstance(ready, EngineReady) and ready.num_kv_blocks > 0
        assert "LlamaForCausalLM" in ready.model_summary
        start = client.stats()
        assert start["num_free_blocks"] == start["num_total_blocks"] == ready.num_kv_blocks
        got = client.run({k: greedy(k, p) for k, p in prompts.items()})
        assert {k: v[0] for k, v in got.items()} == ref
        assert all(v[1] == FinishReason.LENGTH for v in got.values())

        # Two long requests, aborted mid-way: their blocks come back at once.
        client.send(RequestType.ADD, greedy("long0", prompts["r3"], n=10_000))
        client.send(RequestType.ADD, greedy("long1", prompts["r2"], n=10_000))
        for _ in range(3):
            client.recv()
        client.send(RequestType.ABORT, EngineCoreAbort(["long0", "long1"]))
        reasons = {}
        for _ in range(100):
            for o in client.recv().outputs:
                if o.finish_reason is not None:
                    reasons[o.request_id] = o.finish_reason
            if len(reasons) == 2:
                break
        assert reasons == {"long0": FinishReason.ABORT, "long1": FinishReason.ABORT}
        stats = client.stats()
        assert stats["num_free_blocks"] == start["num_free_blocks"]
        assert stats["num_running_reqs"] == stats["num_waiting_reqs"] == 0

        workers = client.ps.children(recursive=True)
        assert len(workers) >= 1
        os.kill(client.proc.pid, signal.SIGTERM)
        client.proc.join(10)
        assert client.proc.exitcode == 0
        gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive
    finally:
        client.close()


def test_startup_failure_is_one_message_and_nonzero_exit(tmp_path: Path):
    (tmp_path / "config.json").write_text('{"architectures": ["NoSuchForCausalLM"]}')
    client = CoreClient(config_for(tmp_path))
    try:
        failed = client.startup()
        assert isinstance(failed, EngineStartupFailed)
        assert "NoSuchForCausalLM" in failed.error
        client.proc.join(30)
        assert client.proc.exitcode not in (0, None)
    finally:
        client.close()


def test_killed_worker_fails_requests_and_core_exits(tiny_llama: Path):
    client = CoreClient(config_for(tiny_llama))
    try:
        assert isinstance(client.startup(), EngineReady)
        client.send(RequestType.ADD, greedy("victim", [1, 2, 3], n=100_000))
        client.recv()
        (worker,) = client.ps.children(recursive=False)
        killed_at = time.monotonic()
        worker.send_signal(signal.SIGKILL)
        dead = None
        for _ in range(1000):
            msg = client.recv()
            if msg.engine_dead:
                dead = msg
                break
        assert dead is not None and "died" in dead.engine_dead
        assert [(o.request_id, o.finish_reason) for o in dead.outputs] == [
            ("victim", FinishReason.ERROR)
        ]
        client.proc.join(10)
        assert client.proc.exitcode == 1
        assert time.monotonic() - killed_at < 10
    finally:
        client.close()


@pytest.fixture(autouse=True)
def _no_leftover_children(no_leftover_children: None) -> None:
    """Every test here: no process it started outlives it (conftest's no_leftover_children)."""

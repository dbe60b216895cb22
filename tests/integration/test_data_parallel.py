"""`tern launch --dp 2`: two engine cores with their own workers behind one frontend.

Greedy outputs equal Hugging Face's with requests spread over both replicas (and at --tp 2 too);
a shared prefix follows its replica; every weight-update path commits on both replicas or on
neither; sleep/wake and pause/resume act on both; a replica whose worker is killed fails its own
requests within 10 s while the other keeps serving (/health: 200, "degraded"), and no process
outlives the server. The oracle is Hugging Face greedy on the checkpoint tern was updated to.
"""

from __future__ import annotations

import multiprocessing
import random
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from enginecore.executor import free_port
from frontend.client.launched_server import is_alive
from frontend.client.trainer import TernAPIError, TrainerClient
from tests.integration.test_rl import _trainer, state_dict
from tests.unit.test_engine_inproc import hf_greedy
from tests.worker_memory import memory_held, workers_of

N = 6
COMMON = ("--dtype", "float32", "--kv-cache-memory", "0.05", "--max-model-len", "512")


def prompts(num: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(rng.randrange(3, 12))] for _ in range(num)]


def complete(server: Any, prompt: list[int], max_tokens: int = N, model: str = "m") -> dict:
    r = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
              "ignore_eos": True, "return_token_ids": True},
        timeout=120,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


def greedy_all(server: Any, batch: list[list[int]]) -> tuple[list[list[int]], set[str]]:
    """Token ids of every prompt, all sent at once; and the weight versions the replies carry."""
    with ThreadPoolExecutor(len(batch)) as pool:
        replies = list(pool.map(lambda p: complete(server, p), batch))
    return [r["choices"][0]["token_ids"] for r in replies], {r["weight_version"] for r in replies}


def metric(server: Any, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels`."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    total = 0.0
    for line_labels, value in re.findall(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        found = dict(re.findall(r'(\w+)="([^"]*)"', line_labels))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(value)
    return total


def routed(server: Any) -> list[float]:
    return [metric(server, "tern:replica_requests_routed_total", replica=str(i)) for i in (0, 1)]


@pytest.fixture(scope="module")
def server(module_server: Any, tiny_llama: Path) -> Any:
    return module_server("--model", str(tiny_llama), "--served-model-name", "m", "--dp", "2",
                         *COMMON, "--enable-lora")  # fmt: skip


@pytest.fixture(scope="module")
def hf(tiny_llama: Path, tiny_llama_perturbed: Path) -> dict[str, list[list[int]]]:
    batch = prompts(32)
    return {
        "original": hf_greedy(tiny_llama, batch, N),
        "perturbed": hf_greedy(tiny_llama_perturbed, batch[:8], N),
    }


def test_32_concurrent_requests_equal_hf_on_both_replicas(server: Any, hf: dict) -> None:
    before = routed(server)
    outs, versions = greedy_all(server, prompts(32))
    assert outs == hf["original"]
    shares = [a - b for a, b in zip(routed(server), before, strict=True)]
    assert sum(shares) == 32 and min(shares) >= 8, shares  # balanced by load
    for i in (0, 1):
        assert metric(server, "tern:replica_up", replica=str(i)) == 1
        assert metric(server, "tern:replica_generation_tokens_sampled_total", replica=str(i)) > 0
    # vLLM's names, the engine-state ones per engine, for routers and autoscalers.
    assert metric(server, "vllm:generation_tokens_total") == metric(
        server, "tern:generation_tokens_total"
    )
    assert {"0", "1"} <= set(
        re.findall(r'^vllm:kv_cache_usage_perc\{engine="(\d)"', _metrics(server), re.M)
    )
    health = httpx.get(f"{server.base_url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"


def _metrics(server: Any) -> str:
    return httpx.get(f"{server.base_url}/metrics", timeout=10).text


def test_a_shared_prefix_stays_on_one_replica(server: Any) -> None:
    rng = random.Random(7)
    prefix = [rng.randrange(1, 500) for _ in range(64)]  # four blocks
    hits = [metric(server, "tern:prefix_cache_hits_total", replica=str(i)) for i in (0, 1)]
    by_prefix = metric(server, "tern:replica_requests_routed_total", reason="prefix")
    for k in range(6):  # one after the other: both replicas idle, load cannot decide
        complete(server, [*prefix, 1 + k], max_tokens=1)
    gained = [
        metric(server, "tern:prefix_cache_hits_total", replica=str(i)) - hits[i] for i in (0, 1)
    ]
    assert sorted(gained) == [0, 5 * 64], gained
    assert metric(server, "tern:replica_requests_routed_total", reason="prefix") - by_prefix == 5


def test_every_update_path_commits_on_both_replicas(
    server: Any, hf: dict, tiny_llama: Path, tiny_llama_perturbed: Path
) -> None:
    batch = prompts(8)
    client = TrainerClient(server.base_url)
    start = client.weight_version()

    before = routed(server)
    client.update_weights_from_disk(str(tiny_llama_perturbed))
    outs, versions = greedy_all(server, batch)
    assert outs == hf["perturbed"] and versions == {client.weight_version()} != {start}
    assert all(a > b for a, b in zip(routed(server), before, strict=True))  # both answered

    # Several buckets: each prepared on both replicas, committed together by the last.
    client.update_weights_from_tensors(state_dict(tiny_llama), bucket_bytes=1 << 20,
                                       weight_version="step-2")  # fmt: skip
    outs, versions = greedy_all(server, batch)
    assert outs == hf["original"][:8] and versions == {"step-2"}

    client.update_weights_from_tensors(state_dict(tiny_llama_perturbed), load_format="shm",
                                       weight_version="step-3")  # fmt: skip
    outs, versions = greedy_all(server, batch)
    assert outs == hf["perturbed"] and versions == {"step-3"}

    # A wrong shape on one tensor fails on every replica: all roll back, still step-3.
    sd = state_dict(tiny_llama)
    name = "model.layers.0.self_attn.o_proj.weight"
    with pytest.raises(TernAPIError) as e:
        client.update_weights_from_tensors({**sd, name: sd[name][:, :-1].contiguous()})
    assert e.value.status == 400 and "shape" in str(e.value)
    # A good bucket held open on both replicas, then a bad one: both roll back the whole update.
    client.post("/update_weights_from_disk", {"model_path": str(tiny_llama), "finished": False})
    with pytest.raises(TernAPIError):
        client.update_weights_from_disk(str(tiny_llama.parent / "missing"))
    outs, versions = greedy_all(server, batch)
    assert outs == hf["perturbed"] and versions == {"step-3"}
    assert client.weight_version() == "step-3"

    client.update_weights_from_disk(str(tiny_llama))
    assert greedy_all(server, batch)[0] == hf["original"][:8]


def test_a_trainer_group_spans_both_replicas(
    server: Any, hf: dict, tiny_llama: Path, tiny_llama_perturbed: Path
) -> None:
    """world size 1 + dp x tp x pp = 3: the trainer as rank 0, replica d's worker as rank 1 + d
    (the trainer says tern_world_size=2: the server's dp x tp x pp)."""
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    for ckpt, expected in [(tiny_llama_perturbed, hf["perturbed"]),
                           (tiny_llama, hf["original"][:8])]:  # fmt: skip
        proc = ctx.Process(
            target=_trainer, args=(server.base_url, free_port(), str(ckpt), False, q)
        )
        proc.start()
        assert q.get(timeout=120) == "ok"
        proc.join(30)
        assert proc.exitcode == 0
        outs, versions = greedy_all(server, prompts(8))
        assert outs == expected and len(versions) == 1


def _memory_of_replica_workers(server: Any) -> list[int]:
    replicas = server.server_info()["engine"]["replicas"]
    return [memory_held(workers_of(replica["engine_core_pid"])) for replica in replicas]


def test_sleep_wake_and_pause_resume_act_on_both_replicas(server: Any, hf: dict) -> None:
    client = TrainerClient(server.base_url)
    client.update_weights_from_disk(server.server_info()["model_path"])
    awake = _memory_of_replica_workers(server)
    client.sleep(level=1)
    asleep = _memory_of_replica_workers(server)
    kv_bytes = 0.05 * (1 << 30)
    assert all(a - b >= 0.8 * kv_bytes for a, b in zip(awake, asleep, strict=True)), (awake, asleep)
    assert client.get("/is_sleeping") == {"is_sleeping": True}
    client.wake_up()
    assert greedy_all(server, prompts(8))[0] == hf["original"][:8]

    client.pause(mode="keep")
    results: list[dict] = []
    threads = [
        threading.Thread(target=lambda p=p: results.append(complete(server, p)))
        for p in prompts(4, seed=1)
    ]
    for t in threads:
        t.start()
    time.sleep(1.5)
    assert results == []  # frozen on both replicas
    in_flight = [metric(server, "tern:replica_requests_in_flight", replica=str(i)) for i in (0, 1)]
    assert min(in_flight) >= 1, in_flight
    client.resume()
    for t in threads:
        t.join(60)
    assert len(results) == 4


def test_dp2_tp2_matches_hf(launch_server: Any, tiny_llama: Path, hf: dict) -> None:
    server = launch_server("--model", str(tiny_llama), "--served-model-name", "m", "--dp", "2",
                           "--tp", "2", *COMMON)  # fmt: skip
    info = server.server_info()
    assert info["engine"]["data_parallel_size"] == 2
    outs, _ = greedy_all(server, prompts(8))
    assert outs == hf["original"][:8]
    assert min(routed(server)) >= 1


def test_a_dead_replica_fails_its_requests_and_the_other_serves_on(
    launch_server: Any, tiny_llama: Path
) -> None:
    server = launch_server("--model", str(tiny_llama), "--served-model-name", "m", "--dp", "2",
                           *COMMON[:4], "--max-model-len", "2048")  # fmt: skip
    replicas = server.server_info()["engine"]["replicas"]
    core1 = psutil.Process(replicas[1]["engine_core_pid"])
    worker1 = [p for p in core1.children() if "resource_tracker" not in " ".join(p.cmdline())]
    assert len(worker1) == 1
    server.record_descendants()

    results: dict[int, tuple[int, float]] = {}
    errors: list[str] = []

    def long_request(k: int) -> None:
        r = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"model": "m", "prompt": [1 + k, 2, 3], "max_tokens": 2000, "ignore_eos": True},
            timeout=120,
        )
        results[k] = (r.status_code, time.monotonic())
        if r.status_code != 200:
            errors.append(r.json()["error"]["message"])

    threads = [threading.Thread(target=long_request, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while metric(server, "tern:replica_requests_in_flight", replica="1") < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    killed_at = time.monotonic()
    worker1[0].send_signal(signal.SIGKILL)
    for t in threads:
        t.join(120)
    failed = [t for code, t in results.values() if code != 200]
    assert len(failed) == 2 and all(t - killed_at < 10 for t in failed), results
    # The engine core fails them as it goes (500, naming the worker), or the frontend sees it gone.
    assert sorted(code for code, _ in results.values())[:2] == [200, 200]
    assert all("worker" in e or "replica" in e or "engine" in e for e in errors), errors

    health = httpx.get(f"{server.base_url}/health", timeout=10)
    assert health.status_code == 200
    assert health.json()["status"] == "degraded" and health.json()["num_replicas_alive"] == 1
    assert metric(server, "tern:replica_up", replica="1") == 0
    assert all(complete(server, p, 2) for p in prompts(4))  # all on the living replica
    deadline = time.monotonic() + 10  # the dead replica's processes are reaped, not left behind
    while is_alive(core1) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not is_alive(core1)
    assert server.proc.poll() is None


def test_load_routes_report_each_replica(server: Any) -> None:
    """SGLang's /get_load lists each replica (sglang-router sums num_tokens over them); vLLM's
    /load is the HTTP requests in flight."""
    r = httpx.get(f"{server.base_url}/get_load", timeout=30)
    assert r.status_code == 200, r.text
    loads = r.json()
    assert [e["dp_rank"] for e in loads] == [0, 1]
    for e in loads:
        assert e["num_reqs"] >= e["num_waiting_reqs"] >= 0 and e["num_tokens"] >= 0
    r = httpx.get(f"{server.base_url}/load", timeout=30)
    assert r.status_code == 200 and r.json() == {"server_load": 0}


def test_a_lora_adapter_serves_on_both_replicas(
    server: Any, tiny_llama: Path, tmp_path: Path
) -> None:
    """Loaded once through the frontend, the adapter is staged on both replicas and then served by
    both: requests on it, balanced over the replicas, all equal Hugging Face PEFT's answers; a
    load both refuse changes nothing."""
    from scripts.make_tiny_model import make_lora_adapter
    from tests.unit.test_lora import hf_reference

    adapter = make_lora_adapter(tiny_llama, tmp_path / "adapter", rank=8, seed=7)
    r = httpx.post(f"{server.base_url}/v1/load_lora_adapter",
                   json={"lora_name": "ad", "lora_path": str(adapter)}, timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    batch = prompts(8)
    before = routed(server)
    with ThreadPoolExecutor(len(batch)) as pool:
        replies = list(pool.map(lambda p: complete(server, p, model="ad"), batch))
    shares = [a - b for a, b in zip(routed(server), before, strict=True)]
    assert min(shares) >= 1, shares  # both replicas served the adapter
    for p, reply in zip(batch, replies, strict=True):
        assert reply["choices"][0]["token_ids"] == hf_reference(tiny_llama, adapter, p, N)[0]
        assert reply["lora_version"] == "1"
    bad = {"lora_name": "ad", "lora_path": str(tmp_path / "missing")}
    assert (
        httpx.post(f"{server.base_url}/load_lora_adapter", json=bad, timeout=120).status_code == 400
    )
    assert complete(server, batch[0], model="ad")["lora_version"] == "1"
    r = httpx.post(
        f"{server.base_url}/v1/unload_lora_adapter", json={"lora_name": "ad"}, timeout=60
    )
    assert r.status_code == 200, r.text

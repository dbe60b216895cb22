"""tern behind the real routers people run in front of vLLM and SGLang: vllm-router 0.1.17 (the
PyPI wheel's Rust binary) with its cache-aware policy in front of two tern servers on loopback.
sglang-router 0.3.2 also runs here; it is checked to register tern and forward both OpenAI routes.
And vLLM's launch line: `tern serve MODEL -tp 2 --gpu-memory-utilization 0.1`.

Every process started here is stopped, and psutil checks that none survived.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
from openai import OpenAI

from enginecore.executor import free_port
from frontend.client.launched_server import ROOT, is_alive

pytestmark = pytest.mark.timeout(180)

SHARED_PREFIX = " ".join(f"item{i} is the value {i * 7 % 13};" for i in range(60))


class Router:
    """A router binary on a free loopback port, in front of `workers`."""

    def __init__(self, binary: str, args: list[str], workers: list[str]) -> None:
        exe = shutil.which(binary, path=str(Path(sys.executable).parent))
        if exe is None:
            pytest.skip(f"{binary} is not installed (pip install -e '.[test]')")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [exe, *args, "--host", "127.0.0.1", "--port", str(self.port)]
        # Both routers export metrics on port 29000 by default: two at once would clash.
        cmd += ["--prometheus-port", str(free_port()), "--worker-urls"]
        self.proc = subprocess.Popen(
            [*cmd, *workers], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"{binary} exited with {self.proc.returncode}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200:
                    break
            time.sleep(0.3)
        self.processes = [psutil.Process(self.proc.pid)]
        self.processes += self.processes[0].children(recursive=True)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        time.sleep(0.2)
        alive = [p for p in self.processes if is_alive(p)]
        for p in alive:
            p.kill()
        assert not alive, f"router processes survived: {alive}"


def metric(server_url: str, name: str) -> float:
    text = httpx.get(f"{server_url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M))


@pytest.fixture(scope="module")
def servers(module_server, tiny_llama_with_tokenizer: Path) -> list[str]:
    model = str(tiny_llama_with_tokenizer)
    return [module_server("--model", model).base_url for _ in range(2)]


@pytest.fixture(scope="module")
def vllm_router(servers: list[str]) -> Iterator[Router]:
    router = Router("vllm-router", ["--policy", "cache_aware"], servers)
    yield router
    router.stop()


def complete(client: OpenAI, model: str, prompt: str) -> str:
    r = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason == "length"
    return r.choices[0].text


def test_64_requests_through_vllm_router(vllm_router: Router, servers: list[str]) -> None:
    client = OpenAI(base_url=f"{vllm_router.url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    prompts = [f"Request {i}: tell me about the number {i}." for i in range(64)]
    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(lambda p: complete(client, model, p), prompts))
    assert len(texts) == 64 and all(isinstance(t, str) for t in texts)
    # Chat too: the router adds SGLang's no_stop_trim, separate_reasoning... to every body.
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert chat.choices[0].message.role == "assistant"
    assert sum(metric(url, "tern:request_success_total") for url in servers) >= 65


def test_shared_prefix_lands_on_one_server(vllm_router: Router, servers: list[str]) -> None:
    client = OpenAI(base_url=f"{vllm_router.url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    before = [metric(url, "tern:prefix_cache_hits_total") for url in servers]
    for i in range(6):
        complete(client, model, f"{SHARED_PREFIX} Question {i}: which item is {i}?")
    gained = [metric(url, "tern:prefix_cache_hits_total") - b for url, b in zip(servers, before)]
    assert sorted(gained)[0] == 0 and sorted(gained)[1] > 0, gained


def test_removing_a_server_mid_run_loses_no_request(
    vllm_router: Router, servers: list[str]
) -> None:
    client = OpenAI(base_url=f"{vllm_router.url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    removed, kept = servers[1], servers[0]
    with ThreadPoolExecutor(8) as pool:
        first = [pool.submit(complete, client, model, f"early {i}") for i in range(16)]
        time.sleep(0.3)
        r = httpx.post(f"{vllm_router.url}/remove_worker", params={"url": removed}, timeout=10)
        assert r.status_code < 300, r.text
        later = [pool.submit(complete, client, model, f"late {i}") for i in range(16)]
        results = [f.result() for f in first + later]  # raises if any request failed
    assert len(results) == 32
    served_by_removed = metric(removed, "tern:request_success_total")
    kept_before = metric(kept, "tern:request_success_total")
    for i in range(4):
        complete(client, model, f"after removal {i}")
    assert metric(removed, "tern:request_success_total") == served_by_removed
    assert metric(kept, "tern:request_success_total") == kept_before + 4


def test_sglang_router_forwards_both_routes(servers: list[str]) -> None:
    router = Router("sglang-router", ["launch", "--policy", "cache_aware"], servers)
    try:
        client = OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
        model = httpx.get(f"{servers[0]}/v1/models", timeout=10).json()["data"][0]["id"]
        assert complete(client, model, "hello there")
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert chat.choices[0].finish_reason == "length"
    finally:
        router.stop()
    # what load-based policies read from a one-replica server
    loads = httpx.get(f"{servers[0]}/get_load", timeout=10).json()
    assert [e["dp_rank"] for e in loads] == [0] and loads[0]["num_reqs"] >= 0
    assert httpx.get(f"{servers[0]}/load", timeout=10).json() == {"server_load": 0}


def test_tern_serve_as_vllm_is_launched(tiny_llama_with_tokenizer: Path) -> None:
    """vLLM's launch line starts tern: serve MODEL, -tp 2, --gpu-memory-utilization 0.1."""
    port = free_port()
    cmd = [sys.executable, "-m", "frontend", "serve", str(tiny_llama_with_tokenizer),
           "-tp", "2", "--gpu-memory-utilization", "0.1", "--host", "127.0.0.1",
           "--port", str(port)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    family: dict[int, psutil.Process] = {}
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        for p in psutil.Process(proc.pid).children(recursive=True):
            family[p.pid] = p
        info = httpx.get(f"http://127.0.0.1:{port}/server_info", timeout=10).json()
        assert info["config"]["parallel"]["tensor_parallel_size"] == 2
        expected = 0.1 * psutil.virtual_memory().available / 2 / 2**30
        assert info["config"]["cache"]["kv_cache_memory_gib"] == pytest.approx(expected, rel=0.3)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        model = client.models.list().data[0].id
        assert complete(client, model, "hello")
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        time.sleep(0.5)
        alive = [p for p in family.values() if is_alive(p)]
        for p in alive:
            p.kill()
    assert not alive, f"processes survived: {alive}"

"""tern behind LMDeploy's proxy (`lmdeploy serve proxy`, Hybrid mode): `--proxy-url` registers the
server as LMDeploy's api_server does, and removes it at shutdown.

LMDeploy cannot be a test extra: its wheel requires torch<=2.12.1 (tern's venv has 2.13 CPU),
CUDA libraries (nvidia-nccl-cu12...) and triton, and its proxy module imports torch, transformers
and mmengine. So a small in-test proxy records what tern posts and answers as the real one does;
TERN_LMDEPLOY=/path/to/bin/lmdeploy (from a separate venv) also runs the real proxy.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from enginecore.executor import free_port

pytestmark = pytest.mark.timeout(180)


class RecordingProxy:
    """Answers /nodes/add and /nodes/remove as lmdeploy/serve/proxy/proxy.py (v0.18.0) does: 200
    with a JSON string, "Added successfully" / "Deleted successfully" (a refusal is also a 200)."""

    def __init__(self, add_answer: str = "Added successfully") -> None:
        self.posts: list[tuple[str, dict]] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                proxy.posts.append((self.path, body))
                answer = add_answer if self.path == "/nodes/add" else "Deleted successfully"
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def proxy() -> Iterator[RecordingProxy]:
    p = RecordingProxy()
    yield p
    p.close()


def test_registers_as_lmdeploy_api_server_and_leaves_at_shutdown(
    launch_server, proxy: RecordingProxy, tiny_llama_with_tokenizer: Path
) -> None:
    server = launch_server(
        "--model", str(tiny_llama_with_tokenizer), "--served-model-name", "tiny",
        "--proxy-url", proxy.url + "/",
    )  # fmt: skip
    # lmdeploy/serve/openai/api_server.py, register_to_proxy():
    #     data = {'url': context.api_server_url,
    #             'status': {'models': get_model_list(context), 'role': engine_role}}
    # with engine_role = EngineRole.Hybrid.value == 1 and api_server_url 'http://{host}:{port}'.
    # NOTE: tern registers once uvicorn accepts connections, so /health may answer first.
    deadline = time.monotonic() + 30
    while not proxy.posts and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proxy.posts == [
        ("/nodes/add", {"url": server.base_url, "status": {"models": ["tiny"], "role": 1}})
    ]
    assert server.stop() == 0
    assert proxy.posts[1:] == [("/nodes/remove", {"url": server.base_url})]


def test_a_refusing_proxy_fails_start_up(launch_server, tiny_llama_with_tokenizer: Path) -> None:
    proxy = RecordingProxy("Failed to add, please check the input url.")
    try:
        server = launch_server(
            "--model", str(tiny_llama_with_tokenizer), "--proxy-url", proxy.url, wait=False
        )
        assert server.proc.wait(120) == 1
    finally:
        proxy.close()
    assert "LMDeploy proxy at" in server.log and "refused" in server.log
    assert [path for path, _ in proxy.posts] == ["/nodes/add"]


def test_an_unreachable_proxy_fails_start_up(
    launch_server, tiny_llama_with_tokenizer: Path
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    server = launch_server(
        "--model", str(tiny_llama_with_tokenizer), "--proxy-url", url, wait=False
    )
    assert server.proc.wait(120) == 1
    assert f"cannot reach LMDeploy proxy at {url}/nodes/add" in server.log


@pytest.fixture
def lmdeploy_proxy() -> Iterator[str]:
    exe = os.environ.get("TERN_LMDEPLOY")
    if not exe:
        pytest.skip("LMDeploy's proxy needs torch<=2.12.1 + CUDA libraries: set TERN_LMDEPLOY")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [exe, "serve", "proxy", "--server-name", "127.0.0.1", "--server-port", str(port)]
    cmd += ["--serving-strategy", "Hybrid", "--routing-strategy", "min_expected_latency"]
    cmd += ["--disable-cache-status"]  # else it keeps its nodes in its package's proxy_config.json
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"lmdeploy proxy exited with {proc.returncode}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/nodes/status", timeout=2).status_code == 200:
                    break
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(15)


def test_two_servers_behind_the_real_lmdeploy_proxy(
    lmdeploy_proxy: str, launch_server, tiny_llama_with_tokenizer: Path
) -> None:
    # lmdeploy_proxy first: its teardown runs last, so the servers can still leave it
    model = str(tiny_llama_with_tokenizer)
    servers = [
        launch_server(
            "--model", model, "--served-model-name", "tiny", "--proxy-url", lmdeploy_proxy
        )
        for _ in range(2)
    ]
    nodes = httpx.get(f"{lmdeploy_proxy}/nodes/status", timeout=10).json()
    assert sorted(nodes) == sorted(s.base_url for s in servers)
    assert httpx.get(f"{lmdeploy_proxy}/v1/models", timeout=10).json()["data"][0]["id"] == "tiny"
    for i in range(6):
        r = httpx.post(
            f"{lmdeploy_proxy}/v1/completions",
            json={"model": "tiny", "prompt": f"hello {i}", "max_tokens": 3, "temperature": 0},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
        r = httpx.post(
            f"{lmdeploy_proxy}/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
            },
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
    stream = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{lmdeploy_proxy}/v1/completions", json=stream, timeout=60) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 4
    assert servers[0].stop() == 0
    nodes = httpx.get(f"{lmdeploy_proxy}/nodes/status", timeout=10).json()
    assert list(nodes) == [servers[1].base_url]

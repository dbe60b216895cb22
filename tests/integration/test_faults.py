"""Faults against a real `tern launch`: a truncated checkpoint, a 1 GiB body, a slowloris client and
a frozen (SIGSTOPped) engine core or worker. Each must end with a clear error, bounded time and memory, and
a server that either still serves or exits non-zero; the fixtures check that no process survives.

Killed workers and a killed engine core are covered by test_server.py and test_parallel.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

pytestmark = pytest.mark.timeout(600)

BODY_TIMEOUT_S = 3.0
HEARTBEAT_TIMEOUT_S = 5.0
PROMPT = [101, 2024, 318, 257]


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_with_tokenizer: Path) -> Path:
    return tiny_llama_with_tokenizer


@pytest.fixture(scope="module")
def server(module_server: Any, tiny_model: Path) -> Any:
    return module_server(
        "--model", str(tiny_model), "--dtype", "float32", "--kv-cache-memory", "0.25",
        "--request-body-timeout", str(BODY_TIMEOUT_S),
    )  # fmt: skip


def greedy(server: Any, model: Path) -> str:
    r = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": str(model), "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
              "ignore_eos": True},
        timeout=60,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def stream_and_stop(server: Any, model: Path, proc: psutil.Process) -> tuple[list[str], float]:
    """Streams a long completion, SIGSTOPs `proc` after its second event; returns the stream's
    events and the seconds from the stop to the stream's end."""
    events: list[str] = []
    with httpx.stream(
        "POST",
        f"{server.base_url}/v1/completions",
        json={"model": str(model), "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True,
              "stream": True},
        timeout=60,
    ) as r:  # fmt: skip
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            events.append(line)
            if len(events) == 2:
                proc.send_signal(signal.SIGSTOP)
                stopped = time.monotonic()
    return events, time.monotonic() - stopped


def frontend_rss(server: Any) -> int:
    return psutil.Process(server.proc.pid).memory_info().rss


def openai_error(body: dict) -> dict:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, body
    assert error["message"] and error["type"], body
    return error


def raw_request(server: Any, path: str, headers: dict[str, str]) -> socket.socket:
    """A connection with the request line and headers sent, and no body yet."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    head = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{server.port}"]
    head += [f"{k}: {v}" for k, v in {"Content-Type": "application/json", **headers}.items()]
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
    return sock


def read_response(sock: socket.socket, timeout: float) -> bytes:
    """What the server sent until it closed the connection or `timeout` passed."""
    sock.settimeout(timeout)
    data = b""
    with contextlib.suppress(TimeoutError, ConnectionError):
        while chunk := sock.recv(65536):
            data += chunk
            if b"\r\n\r\n" in data and b'"error"' in data and data.rstrip().endswith(b"}"):
                break
    return data


def send_until_answered(sock: socket.socket, pieces: Any, interval: float = 0.0) -> None:
    """Sends `pieces` one by one (every `interval` s) until the server answers or hangs up.

    NOTE: stopping at the answer matters: a server closing with unread data resets the connection,
    which may drop its answer from our receive buffer.
    """
    for piece in pieces:
        readable, _, _ = select.select([sock], [], [], interval)
        if readable:
            return
        try:
            sock.sendall(piece)
        except ConnectionError:
            return


def test_truncated_checkpoint_is_refused_and_the_old_weights_keep_serving(
    server: Any, tiny_model: Path, tmp_path: Path
):
    before = greedy(server, tiny_model)
    version = httpx.get(f"{server.base_url}/get_weight_version").json()["weight_version"]
    bad = tmp_path / "truncated"
    shutil.copytree(tiny_model, bad)
    (weights,) = bad.glob("*.safetensors")
    os.truncate(weights, weights.stat().st_size // 2)

    started = time.monotonic()
    r = httpx.post(
        f"{server.base_url}/update_weights_from_disk", json={"model_path": str(bad)}, timeout=60
    )
    assert time.monotonic() - started < 30
    assert r.status_code == 400, r.text
    message = openai_error(r.json())["message"]
    assert "safetensors" in message.lower() or "truncat" in message.lower(), message
    assert httpx.get(f"{server.base_url}/get_weight_version").json()["weight_version"] == version
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert greedy(server, tiny_model) == before


def test_a_1gib_body_gets_413_without_being_read(server: Any, tiny_model: Path):
    rss = frontend_rss(server)
    started = time.monotonic()
    with raw_request(server, "/v1/completions", {"Content-Length": str(2**30)}) as sock:
        # A few MB of the announced GiB, then the client stops.
        send_until_answered(sock, [b"x" * 2**16] * 64)
        response = read_response(sock, 10)
    assert time.monotonic() - started < 10
    assert response.startswith(b"HTTP/1.1 413"), response[:200]
    assert b"request_too_large" in response
    # Without Content-Length (chunked), the limit applies while reading: 413 past 16 MiB.
    with raw_request(server, "/v1/completions", {"Transfer-Encoding": "chunked"}) as sock:
        send_until_answered(sock, [b"10000\r\n" + b"x" * 2**16 + b"\r\n"] * 320)  # 20 MiB
        response = read_response(sock, 10)
    assert response.startswith(b"HTTP/1.1 413"), response[:200]
    assert frontend_rss(server) - rss < 200 * 2**20
    assert greedy(server, tiny_model)


def test_slowloris_is_cut_off_with_408_while_others_are_served(server: Any, tiny_model: Path):
    rss = frontend_rss(server)
    num_slow = 8
    responses: list[bytes] = []
    durations: list[float] = []

    def trickle() -> None:
        started = time.monotonic()
        sock = raw_request(server, "/v1/completions", {"Content-Length": "1000"})
        with sock:
            body = b'{"prompt": "' + b"x" * 900
            send_until_answered(sock, [bytes([b]) for b in body], interval=1.0)
            responses.append(read_response(sock, 5))
        durations.append(time.monotonic() - started)

    threads = [threading.Thread(target=trickle) for _ in range(num_slow)]
    for t in threads:
        t.start()
    served = 0
    while any(t.is_alive() for t in threads):
        greedy(server, tiny_model)  # the slow clients hold neither the server nor the engine
        served += 1
    for t in threads:
        t.join()
    assert served >= 2
    assert len(responses) == num_slow
    for response in responses:
        assert response.startswith(b"HTTP/1.1 408"), response[:200]
        assert b"request_timeout" in response and b"--request-body-timeout" in response
    assert max(durations) < BODY_TIMEOUT_S + 8, durations
    assert frontend_rss(server) - rss < 100 * 2**20
    # A streamed response outlives the body timeout: the deadline covers the body read only.
    with httpx.stream(
        "POST",
        f"{server.base_url}/v1/completions",
        json={"model": str(tiny_model), "prompt": PROMPT, "max_tokens": 4, "stream": True},
        timeout=60,
    ) as r:
        assert r.status_code == 200
        lines = iter(r.iter_lines())
        first = next(line for line in lines if line.startswith("data:"))
        time.sleep(BODY_TIMEOUT_S + 1)
        rest = [line for line in lines if line.startswith("data:")]
    assert "error" not in first and rest[-1] == "data: [DONE]", rest


def test_a_stopped_engine_core_fails_requests_and_the_server_exits(
    launch_server: Any, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("TERN_ENGINE_HEARTBEAT_TIMEOUT", str(HEARTBEAT_TIMEOUT_S))
    server = launch_server(
        "--model", str(tiny_model), "--dtype", "float32", "--max-model-len", "2048"
    )
    # Idle for longer than the timeout: the heartbeat, not traffic, keeps the engine alive.
    time.sleep(HEARTBEAT_TIMEOUT_S + 2)
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    core = psutil.Process(server.server_info()["engine"]["engine_core_pid"])
    try:
        events, ended = stream_and_stop(server, tiny_model, core)
        assert ended < HEARTBEAT_TIMEOUT_S + 10, ended
        assert events[-1] == "data: [DONE]", events[-3:]
        error = json.loads(events[-2].removeprefix("data:"))
        assert openai_error(error)["code"] == "engine_dead", error
        assert "sent nothing" in error["error"]["message"], error
        health = None
        with contextlib.suppress(httpx.HTTPError):
            health = httpx.get(f"{server.base_url}/health", timeout=5).status_code
        assert health in (503, None)  # 503 for a moment, then the port closes
        assert server.proc.wait(30) == 1
        assert not core.is_running() or core.status() == psutil.STATUS_ZOMBIE
    finally:
        with contextlib.suppress(psutil.Error):
            core.send_signal(signal.SIGCONT)
            core.kill()


def test_a_stopped_worker_fails_requests_and_the_server_exits(launch_server: Any, tiny_model: Path):
    """At --tp 1 no collective times out: the engine core itself notices the stopped worker."""
    server = launch_server(
        "--model", str(tiny_model), "--dtype", "float32", "--max-model-len", "2048"
    )  # fmt: skip
    core = psutil.Process(server.server_info()["engine"]["engine_core_pid"])
    (worker,) = core.children()
    try:
        events, ended = stream_and_stop(server, tiny_model, worker)
        assert ended < 20, ended
        assert events[-1] == "data: [DONE]", events[-3:]
        error = json.loads(events[-2].removeprefix("data:"))
        # The engine core fails the request (engine_error), tells the frontend and exits.
        assert openai_error(error)["code"] in ("engine_error", "engine_dead"), error
        assert "stopped (SIGSTOP)" in error["error"]["message"], error
        assert server.proc.wait(30) == 1
    finally:
        with contextlib.suppress(psutil.Error):
            worker.send_signal(signal.SIGCONT)
            worker.kill()


def _get(sock: socket.socket, port: int, path: str) -> None:
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())


def _read_one_response(sock: socket.socket, timeout: float) -> tuple[int, bytes]:
    """(status, body) of one Content-Length response on a kept-alive connection."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    length = next(int(v) for k, _, v in (h.partition(":") for h in lines[1:])
                  if k.lower() == "content-length")  # fmt: skip
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection mid-body"
        body += chunk
    return int(lines[0].split()[1]), body


def test_a_request_sent_while_the_frontend_stalls_is_served_not_dropped(
    launch_server: Any, tiny_model: Path
):
    """The `vllm bench serve` "Server disconnected" defect: a starved event loop let the keep-alive
    timer close a connection whose next request was already waiting in its socket."""
    server = launch_server("--model", str(tiny_model), "--dtype", "float32",
                           "--timeout-keep-alive", "1")  # fmt: skip
    frontend = psutil.Process(server.proc.pid)
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        _get(sock, server.port, "/v1/models")
        assert _read_one_response(sock, 30)[0] == 200
        frontend.send_signal(signal.SIGSTOP)  # the loop stalls past the keep-alive time...
        try:
            _get(sock, server.port, "/v1/models")  # ...with the next request already sent
            time.sleep(2.5)
        finally:
            frontend.send_signal(signal.SIGCONT)
        status, body = _read_one_response(sock, 30)
        assert status == 200 and json.loads(body)["data"], body
        # An idle connection still ends after --timeout-keep-alive.
        sock.settimeout(10)
        t0 = time.monotonic()
        assert sock.recv(1) == b""
        assert 0.5 < time.monotonic() - t0 < 5
    assert server.server_info()["frontend"]["keep_alive_timeout_s"] == 1


def _small_dev_shm(mib: int) -> tuple[str, ...]:
    """A command prefix that runs tern with a /dev/shm of `mib` MiB (a private mount namespace,
    as in a container started without --shm-size)."""
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "mount", "-t", "tmpfs", "-o", "size=1m",
         "tmpfs", "/dev/shm"], capture_output=True,
    )  # fmt: skip
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a small /dev/shm here: {probe.stderr.decode().strip()}")
    script = f'mount -t tmpfs -o size={mib}m tmpfs /dev/shm && exec "$@"'
    return ("unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh")


def test_a_full_dev_shm_is_a_clear_start_up_error(launch_server: Any, tiny_model: Path):
    """The step ring buffer (8 MiB) does not fit: tern says so and exits 1, instead of a SIGBUS in
    the first step that touches a page the tmpfs cannot back."""
    server = launch_server("--model", str(tiny_model), "--dtype", "float32",
                           wait=False, wrapper=_small_dev_shm(1))  # fmt: skip
    assert server.proc.wait(120) == 1, server.log[-3000:]
    assert "/dev/shm has no room for" in server.log, server.log[-3000:]
    assert "--shm-size" in server.log


def test_tp_collectives_fall_back_when_dev_shm_is_small(launch_server: Any, tiny_model: Path):
    """The ring buffer fits, the tensor-parallel segment (32 MiB at --tp 2) does not: the ranks
    agree to use the process group, warn, and answer exactly as with shared memory."""
    args = ("--model", str(tiny_model), "--dtype", "float32", "--tp", "2", "--max-model-len", "512")
    small = launch_server(*args, wrapper=_small_dev_shm(16))
    text = greedy(small, tiny_model)
    assert "/dev/shm has no room for" in small.log
    assert "collectives stay on the process group" in small.log
    small.stop()
    assert greedy(launch_server(*args), tiny_model) == text

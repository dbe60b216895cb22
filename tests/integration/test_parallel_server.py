"""`tern launch --tp 2` end to end: the HTTP server over a two-worker pool, and a worker killed under it.

A worker that dies mid-generation must fail its requests with an error, turn /health to 503, and make
the launcher exit non-zero within 15 s with no process left behind.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil

from tests.integration.test_server import MAX_MODEL_LEN, client_for, stream_in_background


def test_tp2_serves_and_a_killed_worker_stops_the_server(launch_server: Any, tiny_llama: Path):
    server = launch_server(
        "--model",
        str(tiny_llama),
        "--dtype",
        "float32",
        "--tp",
        "2",
        "--max-model-len",
        str(MAX_MODEL_LEN),
    )
    reply = client_for(server).completions.create(
        model=str(tiny_llama),
        prompt="Hello",
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert reply.usage.completion_tokens == 8

    core = psutil.Process(server.server_info()["engine"]["engine_core_pid"])
    workers = [p for p in core.children() if "spawn_main" in " ".join(p.cmdline())]
    workers = [p for p in workers if "resource_tracker" not in " ".join(p.cmdline())]
    assert len(workers) == 2, workers
    server.record_descendants()
    thread, result = stream_in_background(server, str(tiny_llama))
    assert result["started"].wait(60)
    killed_at = time.monotonic()
    workers[1].send_signal(signal.SIGKILL)

    health = []
    while server.proc.poll() is None and time.monotonic() - killed_at < 15:
        try:
            health.append(httpx.get(f"{server.base_url}/health", timeout=1).status_code)
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    thread.join(10)
    assert not thread.is_alive()
    assert isinstance(result.get("error"), openai.APIError) or result.get("finish") == "error"
    assert server.proc.wait(timeout=15 - (time.monotonic() - killed_at)) not in (0, None)
    assert 503 in health
    assert server.survivors(timeout=5.0) == []

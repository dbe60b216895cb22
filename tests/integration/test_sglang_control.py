"""SGLang's control names against a real `tern launch`: each alias does what its SGLang counterpart
does. Pause "retract" frees the running requests' KV cache and they finish later with the same greedy
output, "in_place" holds them; /continue_generation, /flush_cache, /release_memory_occupation and
/resume_memory_occupation with tags, /get_model_info, /get_server_info; the update options
(flush_cache, unsupported fields); and a "flattened_bucket" broadcast from a trainer process.
"""

from __future__ import annotations

import json
import multiprocessing
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from enginecore.executor import free_port
from frontend.client.trainer import TrainerClient
from tests.integration.test_rl import (
    PROMPTS,
    greedy,
    memory_of_workers,
    state_dict,
)
from tests.unit.test_engine_inproc import hf_greedy

pytestmark = pytest.mark.timeout(600)

LONG = 48


@pytest.fixture(scope="module")
def server(module_server: Any, tiny_llama: Path) -> Any:
    return module_server(
        "--model", str(tiny_llama), "--dtype", "float32", "--kv-cache-memory", "0.25"
    )


def post(server: Any, path: str, body: Any = None, method: str = "POST") -> httpx.Response:
    return httpx.request(method, f"{server.base_url}{path}", json=body, timeout=120)


def stats(server: Any) -> dict:
    return server.server_info()["scheduler_stats"]


def long_greedy(server: Any, model: str, out: list, first_token: threading.Event) -> None:
    """Streams a long greedy completion into `out`; sets `first_token` once tokens flow."""
    body = {"model": model, "prompt": PROMPTS[1], "max_tokens": LONG, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}  # fmt: skip
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            out.extend(choice.get("token_ids") or [])
            if len(out) >= 4:
                first_token.set()
            if choice.get("finish_reason"):
                out.append(choice["finish_reason"])


def reference(server: Any, model: str) -> list[int]:
    r = post(server, "/v1/completions", {"model": model, "prompt": PROMPTS[1], "max_tokens": LONG,
                                         "temperature": 0, "ignore_eos": True,
                                         "return_token_ids": True})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def wait_until(predicate: Any, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_modes_hold_requests_and_they_finish_unchanged(
    server: Any, tiny_llama: Path, mode: str
):
    model = str(tiny_llama)
    expected = reference(server, model)
    out: list = []
    first = threading.Event()
    stream = threading.Thread(target=long_greedy, args=(server, model, out, first))
    stream.start()
    try:
        assert first.wait(60)
        r = post(server, "/pause_generation", {"mode": mode})
        assert r.status_code == 200, r.text
        s = stats(server)
        if mode == "retract":  # back in the queue, its KV cache freed
            assert (s["num_running_reqs"], s["num_waiting_reqs"]) == (0, 1), s
            assert s["num_free_blocks"] == s["num_total_blocks"], s
        else:  # held where it is
            assert (s["num_running_reqs"], s["num_waiting_reqs"]) == (1, 0), s
        held = len(out)
        time.sleep(0.5)
        assert len(out) == held and "length" not in out  # nothing ran while paused
        assert post(server, "/continue_generation").status_code == 200
    finally:
        stream.join(120)
    assert out[-1] == "length" and out[:-1] == expected


def test_flush_cache_and_info_routes(server: Any, tiny_llama: Path):
    for method in ("GET", "POST"):
        r = post(server, "/flush_cache", method=method)
        assert r.status_code == 200 and r.json()["success"], r.text
    info = post(server, "/get_model_info", method="GET").json()
    assert info["model_path"] == str(tiny_llama) and info["is_generation"] is True
    assert (
        info["weight_version"]
        == post(server, "/get_weight_version", method="GET").json()["weight_version"]
    )
    sinfo = post(server, "/get_server_info", method="GET").json()
    assert sinfo["tp_size"] == 1 and sinfo["dp_size"] == 1 and sinfo["max_total_num_tokens"] > 0
    assert "scheduler_stats" in sinfo


def test_update_options(server: Any, tiny_llama: Path):
    model = str(tiny_llama)
    body = {"model": model, "prompt": list(range(100, 164)), "max_tokens": 1}

    def cached() -> int:
        r = post(server, "/v1/completions", body)
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached()
    assert cached() > 0
    for flush, expect_cached in ((False, True), (True, False)):
        r = post(server, "/update_weights_from_disk",
                 {"model_path": model, "flush_cache": flush, "weight_version": f"f{flush}"})  # fmt: skip
        assert r.status_code == 200, r.text
        assert (cached() > 0) == expect_cached, flush
    r = post(server, "/update_weights_from_disk", {"model_path": model, "is_async": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "is_async", r.text
    r = post(server, "/update_weights_from_distributed",
             {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]], "load_format": "pickle"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "load_format", r.text


def test_memory_occupation_and_sleep_tags(server: Any, tiny_llama: Path):
    model = str(tiny_llama)
    before = greedy(server, model)
    # Only the KV cache: the weights stay, so waking it is enough.
    r = post(server, "/sleep", {"tags": ["kv_cache"]})
    assert r.status_code == 200 and r.json()["is_sleeping"], r.text
    assert post(server, "/v1/completions", {"model": model, "prompt": "x"}).status_code == 503
    assert post(server, "/wake_up", {"tags": ["kv_cache", "cuda_graph"]}).status_code == 200
    assert greedy(server, model) == before
    assert post(server, "/sleep", {"tags": ["bogus"]}).status_code == 400

    # SGLang's release (all tags by default) frees the weights like sleep level 2.
    rss = memory_of_workers(server)
    r = post(server, "/release_memory_occupation", {})
    assert r.status_code == 200, r.text
    assert set(r.json()["asleep_tags"]) == {"weights", "kv_cache"}  # cuda_graph holds nothing
    released = memory_of_workers(server)
    assert released < rss - 8 * 2**20, (rss, released)
    assert post(server, "/resume_memory_occupation", {"tags": ["weights"]}).status_code == 200
    assert post(server, "/resume_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    # The weights came back empty: generation waits for new ones.
    assert post(server, "/v1/completions", {"model": model, "prompt": "x"}).status_code == 503
    TrainerClient(server.base_url).update_weights_from_disk(model)
    assert greedy(server, model) == before


def _trainer(base_url: str, port: int, ckpt: str, wrong_shape: bool, q: Any) -> None:
    """Joins the group as rank 0 and sends the checkpoint in flattened buckets."""
    import torch

    torch.set_num_threads(1)
    client = TrainerClient(base_url)
    try:
        client.init_weights_update_group("127.0.0.1", port, tern_world_size=1, group_name="fb",
                                         timeout_s=20)  # fmt: skip
        sd = state_dict(Path(ckpt))
        if wrong_shape:  # metadata that fits no parameter of the model
            name = next(n for n in sd if n.endswith("q_proj.weight"))
            sd[name] = sd[name][:-1]
        try:
            client.update_weights_from_distributed(
                sd, bucket_bytes=1 << 18, load_format="flattened_bucket", weight_version="fb"
            )
            q.put("ok")
        except Exception as e:  # noqa: BLE001 - reported to the test
            q.put(f"error: {e}")
        client.destroy_weights_update_group()
    except Exception as e:  # noqa: BLE001
        q.put(f"error: {e}")


def test_flattened_bucket_update(server: Any, tiny_llama: Path, tiny_llama_perturbed: Path):
    model = str(tiny_llama)
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    original = greedy(server, model)
    assert original == hf_greedy(tiny_llama, PROMPTS, len(original[0]))
    version = TrainerClient(server.base_url).weight_version()
    # A bucket whose metadata does not match the model: a clear error, nothing half-applied.
    proc = ctx.Process(target=_trainer, args=(server.base_url, free_port(), str(tiny_llama_perturbed), True, q))  # fmt: skip
    proc.start()
    result = q.get(timeout=120)
    proc.join(30)
    assert result.startswith("error") and "q_proj" in result, result
    assert greedy(server, model) == original
    assert TrainerClient(server.base_url).weight_version() == version

    proc = ctx.Process(target=_trainer, args=(server.base_url, free_port(), str(tiny_llama_perturbed), False, q))  # fmt: skip
    proc.start()
    assert q.get(timeout=120) == "ok"
    proc.join(30)
    assert proc.exitcode == 0
    assert greedy(server, model) == hf_greedy(tiny_llama_perturbed, PROMPTS, len(original[0]))
    assert TrainerClient(server.base_url).weight_version() == "fb"
    TrainerClient(server.base_url).update_weights_from_disk(model)

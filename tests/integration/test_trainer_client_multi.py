"""TrainerClient over two tern servers: every weight update is one transaction across them (prepare
on all with finished=false, then /finish_weights_update commits on all; a failure on one server
rolls every server back), and pause/sleep act on both."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from frontend.client.trainer import MultiServerError, TrainerClient

pytestmark = pytest.mark.timeout(300)
PROMPT = [1, 5, 9, 13, 17, 21]


def greedy(url: str) -> list[int]:
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def test_update_commits_on_all_or_none(
    launch_server, tiny_llama: Path, tiny_llama_perturbed: Path
) -> None:
    a = launch_server("--model", str(tiny_llama)).base_url
    b = launch_server("--model", str(tiny_llama)).base_url
    client = TrainerClient([a, b])
    before = greedy(a)
    assert greedy(b) == before and client.weight_versions() == ["default", "default"]

    # Both load the new checkpoint, then both commit: same new outputs, one version.
    result = client.update_weights_from_disk(str(tiny_llama_perturbed), weight_version="v1")
    assert result["weight_version"] == "v1" and client.weight_version() == "v1"
    after = greedy(a)
    assert after != before and greedy(b) == after

    # The first bucket is loaded (held) on both, then a bucket with a wrong shape is refused:
    # both servers must be back on the committed weights.
    state = load_file(str(tiny_llama / "model.safetensors"))
    good = {k: v for k, v in state.items() if "embed" in k}
    name = next(k for k in state if "q_proj" in k)
    bad = {name: torch.zeros(3, 3, dtype=state[name].dtype)}
    with pytest.raises((MultiServerError, RuntimeError)):
        client.update_weights_from_tensors({**good, **bad}, bucket_bytes=1)
    assert client.weight_versions() == ["v1", "v1"]
    assert greedy(a) == after and greedy(b) == after


def test_failure_on_one_server_rolls_back_the_other(
    launch_server, tiny_llama: Path, tiny_llama_perturbed: Path
) -> None:
    a = launch_server("--model", str(tiny_llama)).base_url
    b = launch_server("--model", str(tiny_llama)).base_url
    client = TrainerClient([a, b])
    before = greedy(a)
    # Server b's weights are asleep: its prepare fails while a's succeeds; a must roll back.
    TrainerClient(b).post("/release_memory_occupation", {"tags": ["kv_cache"]})
    TrainerClient(b).post("/sleep", {"tags": ["weights"]})
    with pytest.raises(MultiServerError) as e:
        client.update_weights_from_disk(str(tiny_llama_perturbed), weight_version="v2")
    assert list(e.value.errors) == [b]
    assert TrainerClient(a).weight_version() == "default"
    assert greedy(a) == before
    # Nothing is left open on a: a later update over both commits normally.
    TrainerClient(b).wake_up()
    client.update_weights_from_disk(str(tiny_llama_perturbed), weight_version="v3")
    assert client.weight_versions() == ["v3", "v3"] and greedy(a) == greedy(b) != before


def test_pause_and_sleep_apply_to_every_server(launch_server, tiny_llama: Path) -> None:
    urls = [launch_server("--model", str(tiny_llama)).base_url for _ in range(2)]
    client = TrainerClient(urls)
    client.sleep(level=1)
    assert all(httpx.get(f"{u}/is_sleeping", timeout=10).json()["is_sleeping"] for u in urls)
    client.wake_up()
    assert not any(httpx.get(f"{u}/is_sleeping", timeout=10).json()["is_sleeping"] for u in urls)
    client.pause(mode="abort")
    client.resume()
    assert greedy(urls[0]) == greedy(urls[1])

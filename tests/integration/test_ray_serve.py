"""tern on Ray Serve (frontend/ray_serve/): build_dev_openai_app's application on a local Ray
instance, reached with the openai SDK through Serve's HTTP proxy; its ranks are Ray actors in each
replica's placement group. Compared with a tern server launched directly."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from safetensors.torch import load_file

from enginecore.executor import free_port
from frontend.client.trainer import TrainerClient
from tests.unit.test_engine_inproc import hf_greedy

ray = pytest.importorskip("ray")  # in the test extra: present wherever scripts/test runs
from ray import serve  # noqa: E402

from frontend.ray_serve.builders import build_dev_openai_app  # noqa: E402

MODEL_ID = "tiny-on-serve"
PROMPT = "The capital of France is"
PROMPT_IDS = [101, 2024, 318, 257]
MESSAGES = [{"role": "user", "content": "Name three colors."}]


def llm_config(model: Path, num_replicas: int) -> dict[str, Any]:
    return {
        "model_loading_config": {"model_id": MODEL_ID, "model_source": str(model)},
        "engine_kwargs": {"dtype": "float32", "kv_cache_memory": 0.1},
        "deployment_config": {"num_replicas": num_replicas},
    }


@pytest.fixture(scope="module")
def model(tiny_llama_with_tokenizer: Path) -> Path:
    return tiny_llama_with_tokenizer


@pytest.fixture(scope="module")
def serve_url() -> Iterator[str]:
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=128 * 2**20,
             log_to_driver=False, configure_logging=False)  # fmt: skip
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def direct(module_server: Any, model: Path) -> dict[str, Any]:
    """What a tern server launched directly answers (greedy)."""
    server = module_server(
        "--model", str(model), "--served-model-name", MODEL_ID, "--dtype", "float32",
        "--kv-cache-memory", "0.1",
    )  # fmt: skip
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", timeout=60)
    answers = _answers(client)
    server.shut_down()
    return answers


def _answers(client: openai.OpenAI) -> dict[str, Any]:
    completion = client.completions.create(
        model=MODEL_ID, prompt=PROMPT, max_tokens=10, temperature=0
    )
    chat = client.chat.completions.create(
        model=MODEL_ID, messages=MESSAGES, max_tokens=10, temperature=0
    )
    streamed = client.chat.completions.create(
        model=MODEL_ID, messages=MESSAGES, max_tokens=10, temperature=0, stream=True
    )
    return {
        "completion": completion.choices[0].text,
        "chat": chat.choices[0].message.content,
        "chat_streamed": "".join(c.choices[0].delta.content or "" for c in streamed if c.choices),
    }


def _deploy(model: Path, num_replicas: int) -> None:
    serve.run(
        build_dev_openai_app({"llm_configs": [llm_config(model, num_replicas)]}),
        name="tern",
        route_prefix="/",
    )


def _replica_states() -> dict[str, int]:
    (deployment,) = serve.status().applications["tern"].deployments.values()
    return dict(deployment.replica_states)


def test_a_replica_answers_as_tern_does_with_its_ranks_in_its_bundles(
    serve_url: str, model: Path, direct: dict[str, Any]
) -> None:
    _deploy(model, 1)
    client = openai.OpenAI(base_url=f"{serve_url}/v1", api_key="x", timeout=60)
    assert _answers(client) == direct
    streamed = client.completions.create(
        model=MODEL_ID, prompt=PROMPT, max_tokens=10, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == direct["completion"]
    # A bad request is tern's own OpenAI error, through Serve.
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=10, temperature=-1)
    assert bad.value.body["param"] == "temperature", bad.value.body
    # The replica's placement group: one bundle, holding the replica and its rank's actor (the
    # bundle's CPUs all taken; nothing taken outside it: the rank is in Ray's accounting).
    groups = ray.util.placement_group_table()
    (group_id,) = [k for k, g in groups.items() if g["state"] == "CREATED"]
    assert groups[group_id]["bundles"] == {0: {"CPU": 2.0}}, groups[group_id]
    workers = [
        a for a in ray._private.state.actors().values()
        if a["State"] == "ALIVE" and (a["Name"] or "").startswith("tern-worker-")
    ]  # fmt: skip
    assert len(workers) == 1, workers
    free = ray.available_resources()
    assert free.get(f"CPU_group_0_{group_id}", 0.0) == 0.0 and free["CPU"] == 2.0, free


def test_a_trainer_updates_a_replicas_weights_through_serve(
    serve_url: str, model: Path, tiny_llama_perturbed: Path
) -> None:
    """TrainerClient's tensor path through Serve's proxy (one replica: with several, each update
    reaches the one replica Serve picks; docs/ray.md)."""
    _deploy(model, 1)
    client = TrainerClient(serve_url)
    perturbed = load_file(next(tiny_llama_perturbed.glob("*.safetensors")))
    original = load_file(next(model.glob("*.safetensors")))
    client.update_weights_from_tensors(perturbed, weight_version="perturbed")
    try:
        assert client.weight_version() == "perturbed"
        r = httpx.post(
            f"{serve_url}/v1/completions",
            json={"model": MODEL_ID, "prompt": PROMPT_IDS, "max_tokens": 8, "temperature": 0,
                  "ignore_eos": True, "return_token_ids": True},
            timeout=60,
        )  # fmt: skip
        expected = hf_greedy(tiny_llama_perturbed, [PROMPT_IDS], 8)[0]
        assert r.json()["choices"][0]["token_ids"] == expected, r.text
    finally:
        client.update_weights_from_tensors(original, weight_version="original")


def _every_replica(method: str) -> list[Any]:
    """Each replica's own answer (Ray Serve LLM's broadcast, which runs beside an event loop)."""
    from ray.llm._internal.serve.utils.broadcast import broadcast

    async def ask() -> list[Any]:
        handle = serve.get_deployment_handle(MODEL_ID, "tern")
        return await asyncio.to_thread(broadcast, handle, method)

    return asyncio.run(ask())


def test_two_replicas_answer_and_the_dev_routes_reach_both(
    serve_url: str, model: Path, direct: dict[str, Any]
) -> None:
    _deploy(model, 2)
    deadline = time.monotonic() + 120
    while _replica_states().get("RUNNING", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _replica_states() == {"RUNNING": 2}
    client = openai.OpenAI(base_url=f"{serve_url}/v1", api_key="x", timeout=60)
    for _ in range(6):  # Serve's router spreads them: both replicas answer the same
        r = httpx.post(
            f"{serve_url}/v1/completions",
            json={"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 10, "temperature": 0},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == direct["completion"]
    http = httpx.Client(base_url=serve_url, timeout=120)
    assert http.get("/is_sleeping", params={"model": MODEL_ID}).json() == {"is_sleeping": False}
    assert http.post("/sleep", json={"model": MODEL_ID, "options": {"level": 1}}).status_code == 200
    assert _every_replica("is_sleeping") == [True, True]
    assert http.post("/v1/completions", json={"model": MODEL_ID, "prompt": PROMPT,
                                              "max_tokens": 2}).status_code == 503  # fmt: skip
    assert http.get("/is_sleeping", params={"model": MODEL_ID}).json() == {"is_sleeping": True}
    assert http.post("/wakeup", json={"model": MODEL_ID}).status_code == 200
    assert http.get("/is_sleeping", params={"model": MODEL_ID}).json() == {"is_sleeping": False}
    assert (
        http.post("/pause", json={"model": MODEL_ID, "options": {"mode": "keep"}}).status_code
        == 200
    )
    assert http.get("/is_paused", params={"model": MODEL_ID}).json() == {"is_paused": True}
    assert _every_replica("is_paused") == [True, True]
    assert http.post("/resume", json={"model": MODEL_ID}).status_code == 200
    assert http.get("/is_paused", params={"model": MODEL_ID}).json() == {"is_paused": False}
    assert _every_replica("is_paused") == [False, False]
    assert http.post("/reset_prefix_cache", json={"model": MODEL_ID}).status_code == 200
    bad = http.post("/sleep", json={"model": MODEL_ID, "options": {"level": 1, "bogus": 2}})
    assert bad.status_code == 400 and "bogus" in bad.json()["error"]["message"], bad.text
    assert http.post("/sleep", json={"model": "other"}).status_code == 404
    assert (
        client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=10, temperature=0)
        .choices[0]
        .text
        == direct["completion"]
    )

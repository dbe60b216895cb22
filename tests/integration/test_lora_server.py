"""LoRA adapters over HTTP, on one server: chosen by the OpenAI `model` (the official client),
SGLang's `base:adapter` and /generate `lora_path` (one per prompt), LMDeploy's `adapter_name`;
listed by /v1/models with their parent; loaded and unloaded at run time (vLLM's and SGLang's
routes) under 32 concurrent requests on four adapters with nothing failed or mixed; pushed as
safetensors tensors (SGLang's /load_lora_adapter_from_tensors, the RL trainer's path) with each
answer naming its version, malformed pushes refused with the old version still serving.

References: each adapter's answers to the same prompt asked alone (that those equal Hugging Face
PEFT's is tests/unit/test_lora.py's job).
"""

from __future__ import annotations

import asyncio
import base64
import json
import pickle
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from safetensors.torch import load_file, save

from scripts.make_tiny_model import make_lora_adapter

pytestmark = pytest.mark.timeout(600)

PROMPT = "The capital of France is"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama_with_tokenizer: Path, tmp_path_factory: Any) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora_server")
    specs = {"a0": (4, 1), "a1": (8, 2), "a2": (16, 3), "churn": (8, 4), "v1": (8, 5), "v2": (4, 6)}
    return {
        name: make_lora_adapter(tiny_llama_with_tokenizer, root / name, rank=rank, seed=seed)
        for name, (rank, seed) in specs.items()
    }


@pytest.fixture(scope="module")
def server(module_server: Any, tiny_llama_with_tokenizer: Path, adapter_dirs: dict) -> Any:
    return module_server(
        "--model", str(tiny_llama_with_tokenizer), "--served-model-name", "base",
        "--dtype", "float32", "--kv-cache-memory", "0.25",
        "--lora-modules", f"a0={adapter_dirs['a0']}",
        json.dumps({"name": "a1", "path": str(adapter_dirs["a1"])}),
        "--max-loras", "4", "--max-cpu-loras", "8", "--max-lora-rank", "16",
    )  # fmt: skip


def post(server: Any, path: str, body: Any) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=120)


def complete(server: Any, model: str, prompt: str = PROMPT) -> dict:
    r = post(server, "/v1/completions", {"model": model, "prompt": prompt,
                                         "max_tokens": MAX_TOKENS, "temperature": 0,
                                         "ignore_eos": True})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


def load(server: Any, name: str, path: Path, route: str = "/v1/load_lora_adapter") -> None:
    r = post(server, route, {"lora_name": name, "lora_path": str(path)})
    assert r.status_code == 200, r.text


async def unload_churn_during(
    server: Any,
    start: Callable[[openai.AsyncOpenAI], list[asyncio.Task]],
    ready: Callable[[], Awaitable[Any]],
) -> list:
    """The results of the requests `start` begins, `churn` unloaded once `ready` returns."""
    async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="none",
                                  max_retries=0) as client:  # fmt: skip
        tasks = start(client)
        await ready()
        async with httpx.AsyncClient(timeout=120) as http:
            r = await http.post(f"{server.base_url}/v1/unload_lora_adapter",
                                json={"lora_name": "churn"})  # fmt: skip
            assert r.status_code == 200, r.text
        return await asyncio.gather(*tasks)


def test_adapters_are_listed_and_chosen_by_model_name(server: Any, adapter_dirs: dict) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"base", "a0", "a1"}
    assert models["a0"].model_extra["parent"] == "base"
    assert models["a0"].model_extra["root"] == str(adapter_dirs["a0"].resolve())
    texts = {}
    for model in ("base", "a0", "a1", "base:a1"):
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                        temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
        texts[model] = out.choices[0].text
        version = (out.model_extra or {}).get("lora_version")
        assert version == (None if model == "base" else "1")
        assert out.model == model.removeprefix("base:")  # the adapter's name, as vLLM answers
    assert texts["a1"] == texts["base:a1"]
    assert len({texts["base"], texts["a0"], texts["a1"]}) == 3
    chat = client.chat.completions.create(
        model="a0", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert chat.choices[0].message.content is not None
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)


def test_sglang_and_lmdeploy_name_adapters_per_prompt(server: Any) -> None:
    refs = {m: complete(server, m)["choices"][0]["text"] for m in ("base", "a0", "a1")}
    r = post(server, "/generate", {"text": [PROMPT] * 3, "lora_path": ["a1", None, "a0"],
                                   "sampling_params": {"max_new_tokens": MAX_TOKENS,
                                                       "temperature": 0, "ignore_eos": True}})  # fmt: skip
    assert r.status_code == 200, r.text
    assert [o["text"] for o in r.json()] == [refs["a1"], refs["base"], refs["a0"]]
    assert r.json()[0]["meta_info"]["lora_version"] == "1"
    r = post(server, "/generate", {"prompt": PROMPT, "adapter_name": "a0", "max_tokens": MAX_TOKENS,
                                   "temperature": 0, "ignore_eos": True})  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["text"] == refs["a0"]
    r = post(server, "/generate", {"text": PROMPT, "lora_path": "missing"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_path"
    # Routers forward SGLang's lora_path in OpenAI bodies too.
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    r = post(server, "/v1/completions", {**body, "lora_path": "a1"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == refs["a1"], r.text
    r = post(server, "/v1/completions", {**body, "model": "a0", "lora_path": "a1"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"


def test_load_use_unload_reload_under_32_concurrent_requests(
    server: Any, adapter_dirs: dict
) -> None:
    """Three rounds: load `churn`, send 32 requests over a0, a1, a2 and churn at once, unload
    churn while they run (its requests finish on it), then reload it; every answer is its
    adapter's and none fails."""
    load(server, "a2", adapter_dirs["a2"], "/load_lora_adapter")
    load(server, "churn", adapter_dirs["churn"])
    names = ["a0", "a1", "a2", "churn"]
    refs = {m: complete(server, m)["choices"][0]["text"] for m in names}
    assert len(set(refs.values())) == 4
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    assert "vllm:lora_requests_info{" in metrics and 'max_lora="4"' in metrics

    async def one(client: openai.AsyncOpenAI, model: str) -> tuple[str, str]:
        out = await client.completions.create(
            model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return model, out.choices[0].text

    def round_() -> Coroutine[Any, Any, list[tuple[str, str]]]:
        def requests(client: openai.AsyncOpenAI) -> list[asyncio.Task]:
            return [asyncio.create_task(one(client, names[i % 4])) for i in range(32)]

        return unload_churn_during(server, requests, lambda: asyncio.sleep(0.05))

    for _ in range(3):
        for model, text in asyncio.run(round_()):
            assert text == refs[model], model
        r = post(server, "/v1/completions", {"model": "churn", "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 404
        load(server, "churn", adapter_dirs["churn"])
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "churn"}).status_code == 200


def test_requests_racing_an_unload_run_on_the_adapter_or_get_a_404(
    server: Any, adapter_dirs: dict
) -> None:
    """Clients send on `churn` back to back while it is unloaded: each answer is churn's or the
    404 of a name not served, never a failure (a request the frontend admitted after the engine
    had unloaded it, before the frontend knew, was a 500)."""

    async def client_loop(client: openai.AsyncOpenAI, ref: str, busy: asyncio.Event) -> int:
        served = 0
        for _ in range(200):  # bounded: the unload comes after each client's first answer
            try:
                out = await client.completions.create(
                    model="churn", prompt=PROMPT, max_tokens=2, temperature=0
                )
            except openai.NotFoundError:
                return served
            assert out.choices[0].text == ref
            served += 1
            busy.set()
        raise AssertionError("the adapter was never unloaded")

    async def round_(ref: str) -> list[int]:
        busy = asyncio.Event()

        def loops(client: openai.AsyncOpenAI) -> list[asyncio.Task]:
            return [asyncio.create_task(client_loop(client, ref, busy)) for _ in range(8)]

        return await unload_churn_during(server, loops, lambda: asyncio.wait_for(busy.wait(), 60))

    for _ in range(3):
        load(server, "churn", adapter_dirs["churn"])
        body = {"model": "churn", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
        ref = post(server, "/v1/completions", body).json()["choices"][0]["text"]
        assert sum(asyncio.run(round_(ref))) > 0


def _tensors_body(name: str, adapter: Path, blob: bytes | None = None) -> dict:
    config = json.loads((adapter / "adapter_config.json").read_text())
    if blob is None:
        blob = save(load_file(adapter / "adapter_model.safetensors"))
    return {"lora_name": name, "config_dict": config,
            "serialized_tensors": base64.b64encode(blob).decode()}  # fmt: skip


def test_adapters_pushed_as_tensors_serve_at_once_and_bad_pushes_change_nothing(
    server: Any, adapter_dirs: dict
) -> None:
    load(server, "ref1", adapter_dirs["v1"])
    load(server, "ref2", adapter_dirs["v2"])
    ref1 = complete(server, "ref1")["choices"][0]["text"]
    ref2 = complete(server, "ref2")["choices"][0]["text"]
    assert ref1 != ref2
    r = post(server, "/load_lora_adapter_from_tensors", _tensors_body("rl", adapter_dirs["v1"]))
    assert r.status_code == 200 and r.json()["version"] == "1", r.text
    out = complete(server, "rl")
    assert (out["choices"][0]["text"], out["lora_version"]) == (ref1, "1")

    tensors = load_file(adapter_dirs["v2"] / "adapter_model.safetensors")
    b_name = next(n for n in tensors if n.endswith("q_proj.lora_B.weight"))
    bad_shape = {**tensors, b_name: tensors[b_name][:-1].contiguous()}
    unknown = {**tensors, b_name.replace("q_proj", "rotary"): tensors[b_name].clone()}
    for blob, message in [
        (save(bad_shape), "do not fit|shape"),
        (save(unknown), "not served"),
        (pickle.dumps({"x": 1}), "pickled"),
        (b"not safetensors at all", "not a safetensors"),
    ]:
        r = post(server, "/load_lora_adapter_from_tensors",
                 _tensors_body("rl", adapter_dirs["v2"], blob))  # fmt: skip
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] and __import__("re").search(
            message, r.json()["error"]["message"]
        ), r.text
        out = complete(server, "rl")
        assert (out["choices"][0]["text"], out["lora_version"]) == (ref1, "1")
    body = _tensors_body("rl", adapter_dirs["v2"])
    body["config_dict"]["use_dora"] = True
    assert post(server, "/load_lora_adapter_from_tensors", body).status_code == 400

    body = {**_tensors_body("rl", adapter_dirs["v2"]), "version": "step-7"}
    r = post(server, "/load_lora_adapter_from_tensors", body)
    assert r.status_code == 200 and r.json()["version"] == "step-7", r.text
    out = complete(server, "rl")
    assert (out["choices"][0]["text"], out["lora_version"]) == (ref2, "step-7")


def test_control_errors(server: Any, adapter_dirs: dict) -> None:
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "never-loaded"})
    assert r.status_code == 400 and "never-loaded" in r.json()["error"]["message"]
    r = post(
        server, "/v1/load_lora_adapter", {"lora_name": "a0", "lora_path": str(adapter_dirs["v1"])}
    )
    assert r.status_code == 400 and "load_inplace" in r.json()["error"]["message"]
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/such/dir"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    # Control routes are guarded as the others: the OpenAPI document lists them.
    paths = httpx.get(f"{server.base_url}/openapi.json", timeout=30).json()["paths"]
    assert {"/v1/load_lora_adapter", "/load_lora_adapter_from_tensors"} <= set(paths)


def test_trainer_client_pushes_only_the_adapter_over_http_and_a_process_group(
    server: Any, adapter_dirs: dict, tiny_llama_with_tokenizer: Path
) -> None:
    import peft
    import torch
    import transformers

    from enginecore.executor import free_port
    from frontend.client.trainer import TrainerClient

    load(server, "ref1", adapter_dirs["v1"], "/load_lora_adapter")
    load(server, "ref2", adapter_dirs["v2"], "/load_lora_adapter")
    refs = [complete(server, f"ref{i}")["choices"][0]["text"] for i in (1, 2)]
    base = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_llama_with_tokenizer, dtype=torch.float32
    )
    policy = peft.PeftModel.from_pretrained(base, adapter_dirs["v1"], is_trainable=True)
    client = TrainerClient(server.base_url)
    assert client.update_lora("policy", policy, version="s1")["version"] == "s1"
    out = complete(server, "policy")
    assert (out["choices"][0]["text"], out["lora_version"]) == (refs[0], "s1")

    # The second version's tensors broadcast over the trainer's group (state dict + config).
    tensors = load_file(adapter_dirs["v2"] / "adapter_model.safetensors")
    config = json.loads((adapter_dirs["v2"] / "adapter_config.json").read_text())
    client.init_weights_update_group("127.0.0.1", free_port(), tern_world_size=1)
    try:
        client.update_lora("policy", tensors, version="s2", config=config, via="distributed")
    finally:
        client.destroy_weights_update_group()
    out = complete(server, "policy")
    assert (out["choices"][0]["text"], out["lora_version"]) == (refs[1], "s2")
    client.unload_lora("policy")


def test_streams_samples_and_grammars_run_on_the_adapter(server: Any) -> None:
    """A stream names the adapter's version on its last chunk; n samples and a json_schema
    constraint run on the adapter too (the stream's text equals the non-streamed answer)."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    ref = complete(server, "a0")["choices"][0]["text"]
    chunks = list(client.completions.create(
        model="a0", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    ))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref
    assert chunks[-1].model == "a0"
    assert [c.model_extra.get("lora_version") for c in chunks if c.choices][-1] == "1"
    two = client.completions.create(model="a0", prompt=PROMPT, max_tokens=4, n=2, temperature=0)
    assert len(two.choices) == 2 and two.choices[0].text == two.choices[1].text
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
              "additionalProperties": False}  # fmt: skip
    chat = client.chat.completions.create(
        model="a1", messages=[{"role": "user", "content": "x?"}], max_tokens=96, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
    )  # fmt: skip
    assert isinstance(json.loads(chat.choices[0].message.content)["x"], int)
    assert chat.model == "a1"

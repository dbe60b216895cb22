"""Prefill/decode disaggregation behind the real routers: a tern producer and a tern consumer on
a tiny Llama, with vllm-router (--vllm-pd-disaggregation: producer first with max_tokens 1, then
the consumer with the producer's kv_transfer_params) and sglang-router (--pd-disaggregation: both
at once with bootstrap_host / _port / _room) in front, and TensorRT-LLM's two-step flow
(disaggregated_params context_only, then generation_only) driven as trtllm-serve's disagg server
drives it. Outputs equal one plain server's (the producer, asked directly); the consumer
computes at most one block of each prompt (metrics); lent blocks go back (KV usage idle again).

Every process started here is stopped, and psutil checks that none survived.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from openai import OpenAI

from enginecore.executor import free_port
from tests.integration.test_routers import Router, metric

pytestmark = pytest.mark.timeout(300)

BLOCK = 16
LENGTHS = [3, 16, 33, 64, 600]  # block-aligned and not, one block and many


def kv_config(role: str, **extra: object) -> str:
    return json.dumps(
        {"kv_connector": "TernConnector", "kv_role": role, "kv_load_failure_policy": "recompute",
         "kv_connector_extra_config": {"reply_timeout_s": 2, **extra}}
    )  # fmt: skip


class PDRouter(Router):
    """A router in PD mode (its workers are named by --prefill / --decode, not --worker-urls)."""

    def __init__(self, binary: str, args: list[str]) -> None:
        super().__init__(binary, args, [])


def start_pair(launch, model: Path, *args: str) -> dict:
    """A producer and a consumer of `model` (each with `args`), by `launch` (module_server for
    the module's pair, else launch_server: each server holds its KV cache until it stops):
    their URLs, the producer's bootstrap port, the served model's name."""
    port = free_port()
    producer = launch(
        "--model", str(model), *args,
        "--kv-transfer-config", kv_config("kv_producer", bootstrap_port=port),
    )  # fmt: skip
    consumer = launch(
        "--model", str(model), *args, "--kv-transfer-config", kv_config("kv_consumer")
    )
    name = httpx.get(f"{producer.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
    return {"producer": producer.base_url, "consumer": consumer.base_url, "port": port,
            "model": name}  # fmt: skip


def vllm_pd_router(pair: dict) -> PDRouter:
    return PDRouter(
        "vllm-router",
        ["--vllm-pd-disaggregation", "--policy", "round_robin",
         "--prefill", pair["producer"], "--decode", pair["consumer"]],
    )  # fmt: skip


@pytest.fixture(scope="module")
def pd(module_server, tiny_llama_with_tokenizer: Path) -> dict:
    return start_pair(module_server, tiny_llama_with_tokenizer)


def prompt_ids(length: int, salt: int = 0) -> list[int]:
    return [(7 * j + length + salt) % 300 + 5 for j in range(length)]


def completion(url: str, model: str, prompt: list[int], stream: bool, **kw: object) -> str:
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    args = dict(model=model, prompt=prompt, max_tokens=10, temperature=0, **kw)
    if not stream:
        return client.completions.create(**args).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(**args, stream=True))


def chat(url: str, model: str, text: str, stream: bool, **kw: object) -> str:
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    args = dict(model=model, messages=[{"role": "user", "content": text}], max_tokens=10, **kw)
    if not stream:
        return client.chat.completions.create(**args).choices[0].message.content or ""
    chunks = client.chat.completions.create(**args, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def consumer_counts(pd: dict) -> tuple[float, float]:
    """(prompt tokens pulled, prompt tokens computed) on the consumer so far."""
    url = pd["consumer"]
    return (metric(url, "tern:external_prefix_cache_hits_total"),
            metric(url, "tern:computed_prompt_tokens_total"))  # fmt: skip


@pytest.fixture(scope="module")
def vllm_pd(pd: dict) -> Iterator[Router]:
    router = vllm_pd_router(pd)
    yield router
    router.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_router_completions_equal_one_server(vllm_pd: Router, pd: dict, stream: bool):
    for length in LENGTHS:
        prompt = prompt_ids(length, salt=int(stream))  # not in the consumer's prefix cache yet
        ref = completion(pd["producer"], pd["model"], prompt, False)
        pulled0, computed0 = consumer_counts(pd)
        got = completion(vllm_pd.url, pd["model"], prompt, stream)
        assert got == ref, length
        pulled, computed = consumer_counts(pd)
        assert pulled - pulled0 == (length - 1) // BLOCK * BLOCK
        assert computed - computed0 == length - (length - 1) // BLOCK * BLOCK <= BLOCK


def test_vllm_router_chat_greedy_and_seeded(vllm_pd: Router, pd: dict):
    text = "Tell me about the number seven. " * 12
    for stream in (False, True):
        assert chat(vllm_pd.url, pd["model"], text, stream, temperature=0) == chat(
            pd["producer"], pd["model"], text, False, temperature=0
        )
    seeded = dict(temperature=0.9, seed=1234)
    assert chat(vllm_pd.url, pd["model"], text, False, **seeded) == chat(
        pd["producer"], pd["model"], text, False, **seeded
    )


def test_32_concurrent_then_both_sides_idle(vllm_pd: Router, pd: dict):
    prompts = [prompt_ids(20 + 7 * i) for i in range(32)]
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda p: completion(vllm_pd.url, pd["model"], p, False), prompts))
    assert got == [completion(pd["producer"], pd["model"], p, False) for p in prompts]
    for url in (pd["producer"], pd["consumer"]):
        assert metric(url, "tern:kv_leases_held") == 0
        assert metric(url, "tern:num_requests_running") == 0
    # every block went back: only the prefix cache keeps them, and a reset frees them all
    for url in (pd["producer"], pd["consumer"]):
        assert httpx.post(f"{url}/reset_prefix_cache", timeout=10).status_code == 200
        assert metric(url, "tern:kv_cache_usage_perc") == 0


def test_vllm_router_on_sglang_generate(vllm_pd: Router, pd: dict):
    """vllm-router's PD mode on SGLang's /generate: the producer's stage (SGLang's body with
    vLLM's kv_transfer_params, max_tokens 1 and min_tokens 1 beside it) answers
    kv_transfer_params; the consumer pulls the blocks and decodes. Answers equal one server's."""
    for length in (20, 70):
        body = {"input_ids": prompt_ids(length, salt=17),
                "sampling_params": {"max_new_tokens": 8, "temperature": 0}}  # fmt: skip
        pulled0, _ = consumer_counts(pd)
        got = httpx.post(f"{vllm_pd.url}/generate", json=body, timeout=60).json()
        pulled, _ = consumer_counts(pd)
        ref = httpx.post(f"{pd['producer']}/generate", json=body, timeout=60).json()
        assert got["output_ids"] == ref["output_ids"] and got["text"] == ref["text"]
        assert pulled - pulled0 == (length - 1) // BLOCK * BLOCK
    # Without a producer's stage, max_tokens is SGLang's length in the wrong place.
    r = httpx.post(f"{pd['producer']}/generate", json={**body, "max_tokens": 3}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_sglang_router_chat_and_generate(pd: dict):
    router = PDRouter(
        "sglang-router",
        ["launch", "--pd-disaggregation", "--policy", "round_robin",
         "--prefill", pd["producer"], str(pd["port"]), "--decode", pd["consumer"]],
    )  # fmt: skip
    try:
        text = "Which number comes after forty one? " * 5
        for stream in (False, True):
            assert chat(router.url, pd["model"], text, stream, temperature=0) == chat(
                pd["producer"], pd["model"], text, False, temperature=0
            )
        body = {"input_ids": prompt_ids(50), "sampling_params": {"max_new_tokens": 8,
                "temperature": 0}}  # fmt: skip
        ref = httpx.post(f"{pd['producer']}/generate", json=body, timeout=60).json()
        got = httpx.post(f"{router.url}/generate", json=body, timeout=60).json()
        assert got["output_ids"] == ref["output_ids"] and got["text"] == ref["text"]
    finally:
        router.stop()


def test_tensorrt_llm_two_steps_and_a_first_token_that_ends_it(pd: dict):
    model, prompt = pd["model"], prompt_ids(70)
    ref = httpx.post(f"{pd['producer']}/v1/completions", timeout=60,
                     json={"model": model, "prompt": prompt, "max_tokens": 10,
                           "temperature": 0}).json()  # fmt: skip
    ctx = httpx.post(f"{pd['producer']}/v1/completions", timeout=60,
                     json={"model": model, "prompt": prompt, "max_tokens": 10, "temperature": 0,
                           "disaggregated_params": {"request_type": "context_only"}}).json()  # fmt: skip
    choice = ctx["choices"][0]
    assert choice["finish_reason"] is None and ctx["prompt_token_ids"] == prompt
    params = choice["disaggregated_params"]
    assert params["request_type"] == "generation_only" and len(params["first_gen_tokens"]) == 1
    gen = httpx.post(f"{pd['consumer']}/v1/completions", timeout=60,
                     json={"model": model, "prompt": prompt, "max_tokens": 10, "temperature": 0,
                           "disaggregated_params": params}).json()  # fmt: skip
    assert gen["choices"][0]["text"] == ref["choices"][0]["text"]
    # max_tokens 1: the context server's token is the whole answer, and nothing is lent
    one = httpx.post(f"{pd['producer']}/v1/completions", timeout=60,
                     json={"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                           "disaggregated_params": {"request_type": "context_only"}}).json()  # fmt: skip
    assert one["choices"][0]["finish_reason"] == "length"


def test_a_dead_producer_is_recomputed_not_waited_for(pd: dict):
    """The consumer here recomputes (kv_load_failure_policy "recompute"); one that fails is
    tests/integration/test_kv_transfer_engine.py's."""
    prompt = prompt_ids(40)
    ref = completion(pd["producer"], pd["model"], prompt, False)
    failures = metric(pd["consumer"], "tern:kv_pull_failures_total")
    gone = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "x",
            "remote_request_id": "nothing", "remote_block_ids": [1, 2],
            "remote_host": "127.0.0.1", "remote_port": free_port(), "tp_size": 1}  # fmt: skip
    got = completion(pd["consumer"], pd["model"], prompt, False,
                     extra_body={"kv_transfer_params": gone})  # fmt: skip
    assert got == ref
    assert metric(pd["consumer"], "tern:kv_pull_failures_total") == failures + 1


@pytest.mark.parametrize(
    ("family", "tp"),
    [("tiny_qwen3_5", 1), ("tiny_qwen3_5", 2), ("tiny_gemma3", 1), ("tiny_mistral", 1)],
)
def test_hybrid_and_sliding_window_models_resume_from_the_producers_blocks(
    request: pytest.FixtureRequest, launch_server, family: str, tp: int
):
    """Qwen3.5 (Gated DeltaNet layers between its attention layers): the producer's lease keeps
    the linear-attention states after the prompt's last full block (a prefix-cache state
    checkpoint) and the consumer pulls them with the blocks (each rank its own heads' at
    `--tp 2`). Gemma 3 (sliding-window layers beside full ones: two KV-cache groups) and Mistral
    (every layer slides, window 8): the producer keeps a lent prompt's sliding-window blocks and
    the consumer pulls every group's. Either way the consumer computes at most one block, and
    the outputs equal the producer's own, asked directly, behind vllm-router."""
    model = request.getfixturevalue(family)
    hybrid = start_pair(launch_server, model, "--tp", str(tp), "--kv-cache-memory", "0.05")
    router = vllm_pd_router(hybrid)
    try:
        for length in LENGTHS:
            prompt = prompt_ids(length, salt=3)
            pulled0, computed0 = consumer_counts(hybrid)
            got = completion(router.url, hybrid["model"], prompt, False)
            pulled, computed = consumer_counts(hybrid)
            assert got == completion(hybrid["producer"], hybrid["model"], prompt, False), length
            assert pulled - pulled0 == (length - 1) // BLOCK * BLOCK
            assert computed - computed0 == length - (length - 1) // BLOCK * BLOCK
        for url in (hybrid["producer"], hybrid["consumer"]):
            assert metric(url, "tern:kv_leases_held") == 0
    finally:
        router.stop()


def test_routed_experts_of_pulled_positions_travel_with_the_blocks(
    launch_server, tiny_qwen3_moe: Path
):
    """--enable-return-routed-experts on both sides (a tiny Qwen3-MoE): the producer's lease
    carries the routing rows of the positions it lent, so the consumer's answer returns every
    computed token's experts, the prompt's pulled ones included, equal to one server's."""
    pair = start_pair(launch_server, tiny_qwen3_moe, "--enable-return-routed-experts")
    router = vllm_pd_router(pair)
    try:
        for length in (3, 40, 100):
            prompt = prompt_ids(length, salt=5)
            pulled0, _ = consumer_counts(pair)
            got = _routed_completion(router.url, pair["model"], prompt)
            pulled, _ = consumer_counts(pair)
            assert pulled - pulled0 == (length - 1) // BLOCK * BLOCK
            assert got == _routed_completion(pair["producer"], pair["model"], prompt), length
            assert len(got[1]) == length + len(got[0]) - 1  # every computed token's row
    finally:
        router.stop()


def _routed_completion(url: str, model: str, prompt: list[int]) -> tuple[list[int], list]:
    """(the greedy answer's tokens, each computed token's experts)."""
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    choice = client.completions.create(
        model=model, prompt=prompt, max_tokens=6, temperature=0,
        extra_body={"return_token_ids": True},
    ).choices[0]  # fmt: skip
    rows = np.load(io.BytesIO(base64.b64decode(choice.model_extra["routed_experts"])))
    return choice.model_extra["token_ids"], rows.tolist()


def test_a_lora_adapters_prompt_is_pulled_and_decoded_on_the_adapter(
    launch_server, tiny_llama_with_tokenizer: Path, tmp_path_factory: pytest.TempPathFactory
):
    """Both servers serve the same LoRA adapter: the producer computes the prompt on it, the
    consumer pulls the blocks (hashed under the adapter there too) and decodes on it; answers
    equal the producer's own on the adapter, and differ from the base model's."""
    from scripts.make_tiny_model import make_lora_adapter

    adapter = make_lora_adapter(
        tiny_llama_with_tokenizer, tmp_path_factory.mktemp("pd-lora"), rank=8, seed=3
    )
    pair = start_pair(
        launch_server, tiny_llama_with_tokenizer, "--lora-modules", f"ad={adapter}",
        "--max-lora-rank", "8",
    )  # fmt: skip
    router = vllm_pd_router(pair)
    try:
        for length in (20, 70):
            prompt = prompt_ids(length, salt=11)
            pulled0, _ = consumer_counts(pair)
            got = completion(router.url, "ad", prompt, False)
            pulled, _ = consumer_counts(pair)
            assert pulled - pulled0 == (length - 1) // BLOCK * BLOCK
            assert got == completion(pair["producer"], "ad", prompt, False)
            assert got != completion(pair["producer"], pair["model"], prompt, False)
    finally:
        router.stop()


def test_a_draft_models_kv_travels_with_the_blocks(launch_server, tiny_llama_with_tokenizer: Path):
    """Both servers draft with the same draft model (here the served model itself, so a draft
    read from the right KV is always accepted): its KV of the pulled positions comes with the
    blocks, so the consumer accepts every draft, as one server does; the answers equal one
    server's. (Without it, the draft model would read zeros for the prompt.)"""
    spec = json.dumps({"method": "draft_model", "model": str(tiny_llama_with_tokenizer),
                       "num_speculative_tokens": 3})  # fmt: skip
    # NOTE: this test's own servers, stopped at its end: each server sizes its KV cache from the
    # memory left, the module's pairs stay up until its end, and --dp 2 pairs follow.
    pair = start_pair(
        launch_server, tiny_llama_with_tokenizer, "--dtype", "float32", "--speculative-config", spec
    )
    router = vllm_pd_router(pair)
    try:
        for length in (40, 100):
            prompt = prompt_ids(length, salt=13)
            for url in (pair["producer"], router.url):
                side = pair["producer"] if url == pair["producer"] else pair["consumer"]
                before = _spec_counts(side)
                got = completion(url, pair["model"], prompt, False)
                accepted, drafted = (a - b for a, b in zip(_spec_counts(side), before))
                assert drafted > 0 and accepted == drafted, (length, url, accepted, drafted)
            assert got == completion(pair["producer"], pair["model"], prompt, False)
    finally:
        router.stop()


def _spec_counts(url: str) -> tuple[float, float]:
    """(draft tokens accepted, draft tokens verified) on a server so far."""
    return (metric(url, "tern:spec_decode_num_accepted_tokens_total"),
            metric(url, "tern:spec_decode_num_draft_tokens_total"))  # fmt: skip


def test_producers_and_consumers_at_dp2_behind_one_router(launch_server, tiny_llama_with_tokenizer):
    """Two replicas on each side: the bootstrap answers for the replica that lent the blocks,
    every consumer replica pulls; outputs equal one server's."""
    model = str(tiny_llama_with_tokenizer)
    producer = launch_server("--model", model, "--dp", "2", "--kv-transfer-config",
                             kv_config("kv_producer", bootstrap_port=free_port()))  # fmt: skip
    consumer = launch_server("--model", model, "--dp", "2", "--kv-transfer-config",
                             kv_config("kv_consumer"))  # fmt: skip
    router = PDRouter(
        "vllm-router",
        ["--vllm-pd-disaggregation", "--policy", "round_robin",
         "--prefill", producer.base_url, "--decode", consumer.base_url],
    )  # fmt: skip
    try:
        name = httpx.get(f"{producer.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
        prompts = [prompt_ids(40 + 9 * i, salt=7) for i in range(8)]
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda p: completion(router.url, name, p, False), prompts))
        assert got == [completion(producer.base_url, name, p, False) for p in prompts]
        assert metric(consumer.base_url, "tern:kv_pulls_total") == 8
        assert metric(producer.base_url, "tern:kv_leases_held") == 0
    finally:
        router.stop()


def test_weight_updates_and_sleep_reach_both_roles_as_one(vllm_pd: Router, pd: dict,
                                                          tiny_llama_perturbed: Path):  # fmt: skip
    """TrainerClient over the producer and the consumer: one transaction; what the pair serves
    afterwards is what one server with the new weights serves."""
    from frontend.client.trainer import TrainerClient

    prompt = prompt_ids(45, salt=3)
    before = completion(vllm_pd.url, pd["model"], prompt, False)
    client = TrainerClient([pd["producer"], pd["consumer"]])
    client.update_weights_from_disk(str(tiny_llama_perturbed), weight_version="v1")
    assert client.weight_versions() == ["v1", "v1"]
    after = completion(vllm_pd.url, pd["model"], prompt, False)
    assert after == completion(pd["producer"], pd["model"], prompt, False) != before
    client.sleep(level=1)
    client.wake_up()
    assert completion(vllm_pd.url, pd["model"], prompt_ids(45, salt=4), False) == completion(
        pd["producer"], pd["model"], prompt_ids(45, salt=4), False
    )

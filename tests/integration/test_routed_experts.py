"""Routing replay for RL (--enable-return-routed-experts) on a real server with a tiny Qwen3-MoE
(8 experts, top 2, a dense layer between its two expert layers): the experts returned for every
computed token (prompt and outputs but the last) equal Hugging Face's router top-k
(`output_router_logits`) on the same tokens, in vLLM's shape (completions and chat choices'
`routed_experts`, base64 .npy of uint8) and SGLang's (/generate's meta_info.routed_experts, base64
int32 from `routed_experts_start_len`); again when the prompt comes from the prefix cache, from a
stream's last chunk, and after a weight update (new weights, new routing)."""

from __future__ import annotations

import base64
import io
import random
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
import transformers

from tests.conftest import make_tiny_model

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path | None) -> dict:
    if tokenizer_dir is None:
        pytest.skip("needs the default model's tokenizer")
    root = tmp_path_factory.mktemp("moe")
    return {
        "original": make_tiny_model("qwen3_moe", root / "original", tokenizer_dir),
        "trained": make_tiny_model("qwen3_moe", root / "trained", tokenizer_dir, seed=1),
    }


@pytest.fixture(scope="module")
def server(module_server: Any, models: dict) -> Any:
    return module_server(
        "--model", str(models["original"]), "--served-model-name", "moe", "--block-size", "4",
        "--dtype", "float32",
        "--enable-return-routed-experts",
    )  # fmt: skip


def hf_routing(model_dir: Path, tokens: list[int]) -> np.ndarray:
    """(len(tokens), MoE layers, top_k): Hugging Face's router top-k of each token."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), output_router_logits=True)
    k = hf.config.num_experts_per_tok
    tops = [
        torch.topk(logits.float().softmax(-1), k, dim=-1).indices for logits in out.router_logits
    ]
    return torch.stack(tops, dim=1).numpy()


def vllm_rows(choice: Any) -> np.ndarray:
    rows = np.load(io.BytesIO(base64.b64decode(choice.model_extra["routed_experts"])))
    assert rows.dtype == np.uint8  # 8 experts
    return rows


def test_completions_and_generate_return_hf_routing(server: Any, models: dict) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(21)]
    body = {"ignore_eos": True, "return_token_ids": True}
    first = client.completions.create(
        model="moe", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body=body
    )
    output = first.choices[0].model_extra["token_ids"]
    expected = hf_routing(models["original"], prompt + output[:-1])
    assert expected.shape == (len(prompt) + MAX_TOKENS - 1, 2, 2)
    np.testing.assert_array_equal(vllm_rows(first.choices[0]), expected)
    # The same prompt again: its blocks and their routing come from the prefix cache.
    again = client.completions.create(
        model="moe", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body=body
    )
    assert again.usage.prompt_tokens_details.cached_tokens == 20
    np.testing.assert_array_equal(vllm_rows(again.choices[0]), expected)
    # A stream: its last chunk carries the choice's routing.
    chunks = list(
        client.completions.create(
            model="moe", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            extra_body=body,
        )
    )  # fmt: skip
    assert all(c.choices[0].model_extra.get("routed_experts") is None for c in chunks[:-1])
    np.testing.assert_array_equal(vllm_rows(chunks[-1].choices[0]), expected)
    # SGLang's /generate, from position 5 on.
    r = httpx.post(
        f"{server.base_url}/generate",
        json={"input_ids": prompt, "return_routed_experts": True, "routed_experts_start_len": 5,
              "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0,
                                  "ignore_eos": True}},
        timeout=60,
    )  # fmt: skip
    meta = r.json()["meta_info"]
    rows = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
    np.testing.assert_array_equal(rows.reshape(-1, 2, 2), expected[5:])


def test_chat_routing_covers_the_templated_prompt(server: Any, models: dict) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    chat = client.chat.completions.create(
        model="moe", messages=[{"role": "user", "content": "Route me through your experts."}],
        max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    prompt = chat.model_extra["prompt_token_ids"]
    output = chat.choices[0].model_extra["token_ids"]
    expected = hf_routing(models["original"], prompt + output[:-1])
    np.testing.assert_array_equal(vllm_rows(chat.choices[0]), expected)


def test_a_weight_update_changes_the_routing_returned(server: Any, models: dict) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    prompt = list(range(1000, 1017))
    body = {"ignore_eos": True, "return_token_ids": True}
    r = httpx.post(
        f"{server.base_url}/update_weights_from_disk",
        json={"model_path": str(models["trained"])}, timeout=120,
    )  # fmt: skip
    assert r.status_code == 200 and r.json()["success"], r.text
    try:
        done = client.completions.create(
            model="moe", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body=body
        )
        output = done.choices[0].model_extra["token_ids"]
        trained = hf_routing(models["trained"], prompt + output[:-1])
        assert not np.array_equal(trained, hf_routing(models["original"], prompt + output[:-1]))
        np.testing.assert_array_equal(vllm_rows(done.choices[0]), trained)
    finally:
        httpx.post(
            f"{server.base_url}/update_weights_from_disk",
            json={"model_path": str(models["original"])}, timeout=120,
        )  # fmt: skip


def test_metrics_count_the_tokens_each_expert_took(server: Any) -> None:
    """tern:moe_expert_tokens: every computed token counts once for each of its top-2 experts in
    each of the 2 MoE layers (the stats reach /metrics within 0.5 s of a step)."""
    import re
    import time

    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    client.completions.create(model="moe", prompt=list(range(2000, 2013)), max_tokens=3)
    pattern = re.compile(r'^tern:moe_expert_tokens_total\{.*layer="(\d)".*\} (\S+)$', re.M)
    for _ in range(50):
        per_layer = [0.0, 0.0]
        for layer, value in pattern.findall(httpx.get(f"{server.base_url}/metrics").text):
            per_layer[int(layer)] += float(value)
        if per_layer[0] >= 2 * 15:  # this request's 15 computed tokens at least
            break
        time.sleep(0.1)
    assert per_layer[0] == per_layer[1] and per_layer[0] >= 30 and per_layer[0] % 2 == 0

"""`tern launch --logprobs-mode processed_logprobs` end to end (tiny Llama, float32, Hugging Face as
the oracle): /v1/completions and /v1/chat/completions at temperature 0.7 with top_k 5 return the
logprobs of the distribution sampled from (the top 5 renormalised: their exps sum to 1); the default
mode still returns HF's raw log_softmax; /server_info shows the mode. At --tp 2 (engine core and
real worker processes, without HTTP) the driver rank computes the same.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import tokenizers
import torch
from transformers import AutoModelForCausalLM

from enginecore.core import EngineCore
from enginecore.executor import MultiprocExecutor
from enginecore.messages import SamplingParams
from tests.integration.test_parallel import parallel_config
from tests.unit.test_processed_logprobs import reference
from tests.unit.test_sampling_engine import run

pytestmark = pytest.mark.timeout(300)

ATOL = 1e-3
SAMPLING: dict[str, Any] = {
    "temperature": 0.7,
    "top_k": 5,
    "seed": 1234,
    "max_tokens": 4,
    "ignore_eos": True,
}
IDS = {"return_tokens_as_token_ids": True, "return_token_ids": True}


def token_id(s: str) -> int:
    assert s.startswith("token_id:"), s
    return int(s.removeprefix("token_id:"))


def hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """(len(ids), V) float32: row i is the distribution of token i + 1."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def expected_row(row: torch.Tensor, processed: bool) -> torch.Tensor:
    return reference(row, 0.7, top_k=5) if processed else row.log_softmax(-1)


def check_position(
    token: int, logprob: float, top: dict[int, float], row: torch.Tensor, processed: bool
) -> None:
    """One sampled position against HF's logits `row` (V,)."""
    ref = expected_row(row, processed)
    assert abs(logprob - float(ref[token])) < ATOL
    assert token in top and len(top) == 5
    for t, lp in top.items():
        assert abs(lp - float(ref[t])) < ATOL
    mass = sum(math.exp(lp) for lp in top.values())
    if processed:
        assert mass == pytest.approx(1.0, abs=1e-4)
        assert set(top) == set(row.topk(5).indices.tolist())
    else:
        assert mass < 0.999  # a random tiny model's top 5 never hold all the mass


def check_completion(server: Any, hf: torch.nn.Module, prompt: list[int], processed: bool) -> None:
    body = {"model": "tiny", "prompt": prompt, "logprobs": 5, **SAMPLING, **IDS}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    out, lp = choice["token_ids"], choice["logprobs"]
    assert [token_id(s) for s in lp["tokens"]] == out and len(out) == 4
    logits = hf_logits(hf, prompt + out[:-1])
    for i, token in enumerate(out):
        top = {token_id(k): v for k, v in lp["top_logprobs"][i].items()}
        row = logits[len(prompt) - 1 + i]
        check_position(token, lp["token_logprobs"][i], top, row, processed)


def check_chat(server: Any, hf: torch.nn.Module) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Name three colours."}],
        "logprobs": True,
        "top_logprobs": 5,
        **SAMPLING,
        **IDS,
    }
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    reply = r.json()
    prompt, out = reply["prompt_token_ids"], reply["choices"][0]["token_ids"]
    content = reply["choices"][0]["logprobs"]["content"]
    assert [token_id(c["token"]) for c in content] == out
    logits = hf_logits(hf, prompt + out[:-1])
    for i, c in enumerate(content):
        top = {token_id(t["token"]): t["logprob"] for t in c["top_logprobs"]}
        check_position(out[i], c["logprob"], top, logits[len(prompt) - 1 + i], True)


def test_processed_logprobs_are_the_sampled_distribution(
    launch_server: Any, tiny_llama_with_tokenizer: Path
) -> None:
    model = str(tiny_llama_with_tokenizer)
    common = ("--model", model, "--dtype", "float32", "--max-model-len", "256")
    common += ("--served-model-name", "tiny")
    # Started together: most of a start-up is imports, spread over the cores.
    servers = {
        "processed_logprobs": launch_server(*common, "--logprobs-mode", "processed_logprobs",
                                            wait=False),
        "raw_logprobs": launch_server(*common, wait=False),
    }  # fmt: skip
    for server in servers.values():
        server.wait_ready()
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    tok = tokenizers.Tokenizer.from_file(str(tiny_llama_with_tokenizer / "tokenizer.json"))
    prompt = tok.encode("The quick brown fox jumps over the lazy").ids
    for mode, server in servers.items():
        assert server.server_info()["config"]["model"]["logprobs_mode"] == mode
        check_completion(server, hf, prompt, processed=mode == "processed_logprobs")
    check_chat(servers["processed_logprobs"], hf)
    # More top logprobs than top_k keeps: the masked ones show as -9999.0 (JSON has no -inf).
    body = {"model": "tiny", "prompt": prompt, "logprobs": 8, **SAMPLING, **IDS, "max_tokens": 1}
    r = httpx.post(f"{servers['processed_logprobs'].base_url}/v1/completions", json=body)
    values = sorted(r.json()["choices"][0]["logprobs"]["top_logprobs"][0].values(), reverse=True)
    assert len(values) == 8 and values[5:] == [-9999.0] * 3 and min(values[:5]) > -9999.0
    # Stopped together too (the fixture then only checks that nothing survived).
    with ThreadPoolExecutor(len(servers)) as pool:
        list(pool.map(lambda server: server.stop(), servers.values()))


def test_processed_logprobs_at_tp2(tiny_llama: Path) -> None:
    """The driver rank computes them: two real worker processes (gloo), no HTTP, HF's oracle."""
    config = parallel_config(tiny_llama, 2, 1)
    config = config.replace(model=replace(config.model, logprobs_mode="processed_logprobs"))
    prompt = list(range(3, 40, 3))
    params = SamplingParams(logprobs=5, **SAMPLING)
    core = EngineCore(config, MultiprocExecutor(config))
    try:
        lp = run(core, {"r": (prompt, params)})["r"].all_logprobs
    finally:
        core.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    out = lp.token_ids
    logits = hf_logits(hf, prompt + out[:-1])
    for i, token in enumerate(out):
        top = dict(lp.top(i))
        check_position(token, lp.logprobs[i], top, logits[len(prompt) - 1 + i], True)

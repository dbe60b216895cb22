"""SGLang's native POST /generate end to end, beside LMDeploy's on the same path: one real
`tern launch` serving a tiny random Llama in float32, Hugging Face as the oracle.

Greedy batches (text and input_ids) give HF's tokens, and output / input logprobs are HF's
log_softmax; streamed events are cumulative (the last is the whole output); n = 4 with a seed gives
/v1/completions' samples; a rid aborts through /abort_request; json_schema / regex constrain the
output; bad input is a 400 naming the field; LMDeploy-shaped bodies still reach LMDeploy's route.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import tokenizers
import torch
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.timeout(300)

ATOL = 1e-3
PROMPTS = ["The quick brown fox", "Once upon a time", "Hello", "In 1492, Columbus sailed the"]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(shared_server: Any, tiny_llama_with_tokenizer: Path) -> Any:
    return shared_server(
        "--model", str(tiny_llama_with_tokenizer), "--dtype", "float32", "--max-model-len", "512",
        "--served-model-name", "tiny",
    )  # fmt: skip


@pytest.fixture(scope="module")
def hf(tiny_llama_with_tokenizer: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        tiny_llama_with_tokenizer, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def tok(tiny_llama_with_tokenizer: Path) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(tiny_llama_with_tokenizer / "tokenizer.json"))


def hf_logprobs(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """(len(ids), V): row i is the distribution of token i + 1."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def hf_greedy(hf: torch.nn.Module, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    out, logprobs = [], []
    for _ in range(n):
        row = hf_logprobs(hf, ids + out)[-1]
        out.append(int(row.argmax()))
        logprobs.append(float(row.max()))
    return out, logprobs


def post(server: Any, body: Any, path: str = "/generate") -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60)


def generate(server: Any, body: dict[str, Any]) -> Any:
    r = post(server, body)
    assert r.status_code == 200, r.text
    return r.json()


def events(server: Any, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{server.base_url}/generate", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def encode(tok: tokenizers.Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=True).ids


# --------------------------------------------------------------------------- greedy and logprobs


def test_greedy_batch_matches_hf_with_text_and_input_ids(server: Any, hf, tok) -> None:
    body = {"text": PROMPTS, "sampling_params": GREEDY, "return_logprob": True, "rid": "batch"}
    outs = generate(server, body)
    assert isinstance(outs, list) and len(outs) == 4
    for i, (prompt, out) in enumerate(zip(PROMPTS, outs)):
        ids = encode(tok, prompt)
        ref_ids, ref_logprobs = hf_greedy(hf, ids, 8)
        assert out["output_ids"] == ref_ids
        assert out["text"] == tok.decode(ref_ids, skip_special_tokens=True)
        meta = out["meta_info"]
        assert meta["id"] == f"batch_{i}"
        assert meta["finish_reason"] == {"type": "length", "length": 8}
        assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(ids), 8)
        assert meta["cached_tokens"] >= 0 and "weight_version" in meta
        entries = meta["output_token_logprobs"]
        assert [e[1] for e in entries] == ref_ids and all(e[2] is None for e in entries)
        torch.testing.assert_close(
            torch.tensor([e[0] for e in entries]), torch.tensor(ref_logprobs), atol=ATOL, rtol=0
        )
        # Default logprob_start_len: the last prompt token only, with SGLang's null logprob.
        assert meta["input_token_logprobs"] == [[None, ids[-1], None]]
        assert "output_top_logprobs" not in meta
    by_ids = generate(
        server, {"input_ids": [encode(tok, p) for p in PROMPTS], "sampling_params": GREEDY}
    )
    assert [o["output_ids"] for o in by_ids] == [o["output_ids"] for o in outs]
    assert "output_token_logprobs" not in by_ids[0]["meta_info"]


def test_input_logprobs_and_top_logprobs_match_hf(server: Any, hf, tok) -> None:
    prompt = "The capital of France is"
    ids = encode(tok, prompt)
    body = {
        "text": prompt, "sampling_params": {**GREEDY, "max_new_tokens": 3}, "return_logprob": True,
        "logprob_start_len": 1, "top_logprobs_num": 3, "return_text_in_logprobs": True,
    }  # fmt: skip
    meta = generate(server, body)["meta_info"]
    rows = hf_logprobs(hf, ids)
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == ids[1:] and entries[0][0] is None
    assert [e[2] for e in entries] == [tok.decode([t], skip_special_tokens=False) for t in ids[1:]]
    ref = [float(rows[j - 1, ids[j]]) for j in range(2, len(ids))]
    torch.testing.assert_close(
        torch.tensor([e[0] for e in entries[1:]]), torch.tensor(ref), atol=ATOL, rtol=0
    )
    tops = meta["input_top_logprobs"]
    assert tops[0] is None and len(tops) == len(ids) - 1
    for j, top in zip(range(2, len(ids)), tops[1:]):
        ref_top = rows[j - 1].topk(3).values
        torch.testing.assert_close(torch.tensor([e[0] for e in top]), ref_top, atol=ATOL, rtol=0)
    assert [len(t) for t in meta["output_top_logprobs"]] == [3, 3, 3]
    assert meta["output_token_logprobs_length"] == 3

    # max_new_tokens 0: the prompt runs for its logprobs, nothing is generated.
    body["sampling_params"] = {"max_new_tokens": 0}
    out = generate(server, body)
    assert out["output_ids"] == [] and out["text"] == ""
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert [e[1] for e in out["meta_info"]["input_token_logprobs"]] == ids[1:]


# --------------------------------------------------------------------------- streaming, n, seeds


def test_stream_events_are_cumulative(server: Any) -> None:
    body = {
        "text": PROMPTS[0],
        "sampling_params": {**GREEDY, "max_new_tokens": 12},
        "return_logprob": True,
    }
    whole = generate(server, body)
    streamed = events(server, {**body, "stream": True})
    assert len(streamed) > 1 and "index" not in streamed[0]
    for prev, cur in zip(streamed, streamed[1:]):
        assert cur["text"].startswith(prev["text"])
        assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
        assert len(cur["meta_info"]["output_token_logprobs"]) == len(cur["output_ids"])
    assert all(e["meta_info"]["finish_reason"] is None for e in streamed[:-1])
    last = streamed[-1]
    assert (last["text"], last["output_ids"]) == (whole["text"], whole["output_ids"])
    assert last["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]

    batch = events(server, {"text": PROMPTS[:2], "sampling_params": GREEDY, "stream": True})
    finals = {e["index"]: e for e in batch if e["meta_info"]["finish_reason"] is not None}
    assert sorted(finals) == [0, 1]
    whole = generate(server, {"text": PROMPTS[:2], "sampling_params": GREEDY})
    assert [finals[i]["output_ids"] for i in (0, 1)] == [o["output_ids"] for o in whole]


def test_n_with_a_seed_gives_the_completions_samples(server: Any) -> None:
    sampling = {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True, "n": 4}
    outs = generate(
        server, {"text": PROMPTS[1], "sampling_params": {**sampling, "sampling_seed": 7}}
    )
    assert len(outs) == 4 and len({o["meta_info"]["id"] for o in outs}) == 4
    completion = post(
        server,
        {
            "prompt": PROMPTS[1], "n": 4, "seed": 7, "max_tokens": 8, "temperature": 1.0,
            "top_p": 1.0, "top_k": -1, "min_p": 0.0, "ignore_eos": True, "return_token_ids": True,
        },
        "/v1/completions",
    ).json()  # fmt: skip
    assert [o["output_ids"] for o in outs] == [c["token_ids"] for c in completion["choices"]]
    assert len({tuple(o["output_ids"]) for o in outs}) > 1


# --------------------------------------------------------------------------- abort, constraints


def test_rid_aborts_through_abort_request(server: Any) -> None:
    body = {"text": "Go", "rid": "sg-abort", "stream": True,
            "sampling_params": {"max_new_tokens": 480, "ignore_eos": True}}  # fmt: skip
    seen: list[dict[str, Any]] = []
    started = threading.Event()

    def run() -> None:
        with httpx.stream("POST", f"{server.base_url}/generate", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    seen.append(json.loads(line[6:]))
                    started.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(30)
    duplicate = post(server, {**body, "stream": False})
    assert duplicate.status_code == 400 and duplicate.json()["error"]["param"] == "rid"
    r = post(server, {"rid": "sg-abort"}, "/abort_request")
    assert r.status_code == 200, r.text
    thread.join(30)
    final = seen[-1]["meta_info"]
    assert final["finish_reason"]["type"] == "abort" and final["completion_tokens"] < 480

    thread = threading.Thread(target=run, daemon=True)
    seen.clear()
    started.clear()
    thread.start()
    assert started.wait(30)
    assert post(server, {"abort_all": True}, "/abort_request").status_code == 200
    thread.join(30)
    assert seen[-1]["meta_info"]["finish_reason"]["type"] == "abort"


def test_structured_output(server: Any) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    sampling = {"temperature": 1.0, "max_new_tokens": 300, "sampling_seed": 1}
    out = generate(
        server,
        {"text": "JSON:", "sampling_params": {**sampling, "json_schema": json.dumps(schema)}},
    )
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    assert isinstance(json.loads(out["text"])["ok"], bool)
    out = generate(
        server, {"text": "Answer:", "sampling_params": {**sampling, "regex": "(yes|no)"}}
    )
    assert re.fullmatch("yes|no", out["text"]), out


# --------------------------------------------------------------------------- errors, dispatch


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"text": "x", "input_ids": [1]}, "text"),
        ({"text": []}, "text"),
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [[1, 2], []]}, "input_ids"),
        ({"input_ids": [[1, 2], [10**9]]}, "input_ids"),
        ({"text": "x", "frobnicate": 1}, "frobnicate"),
        ({"text": "x", "sampling_params": {"frobnicate": 1}}, "sampling_params.frobnicate"),
        ({"text": "x", "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
        ({"text": "x", "lora_path": "adapter"}, "lora_path"),
        ({"text": "x", "sampling_params": {"stop_regex": "a+"}}, "sampling_params.stop_regex"),
        ({"text": "x", "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
        ({"text": "x", "sampling_params": {"n": 0}}, "sampling_params.n"),
        ({"text": "x", "sampling_params": {"json_schema": "{bad"}}, "sampling_params.json_schema"),
        (
            {"text": "x", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}},
            "sampling_params.ebnf",
        ),
        ({"text": ["a", "b"], "rid": ["only-one"]}, "rid"),
        ({"text": "x", "return_logprob": True, "logprob_start_len": 99}, "logprob_start_len"),
        ({"text": "x", "return_logprob": True, "top_logprobs_num": 99}, "top_logprobs_num"),
        ({"text": "x", "prompt": "y"}, "prompt"),
        # This server records no routing (--enable-return-routed-experts: test_routed_experts.py).
        ({"text": "x", "return_routed_experts": True}, "return_routed_experts"),
        ({"text": "x", "routed_experts_start_len": -1}, "routed_experts_start_len"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server: Any, body: dict[str, Any], param: str) -> None:
    for stream in (False, True):
        r = post(server, {**body, "stream": stream})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error
        assert set(error) == {"message", "type", "param", "code"}


def test_lmdeploy_bodies_still_reach_lmdeploy(server: Any, tok) -> None:
    for body in (
        {"prompt": "Hello", "max_tokens": 3},
        {"input_ids": encode(tok, "Hello"), "max_tokens": 3},
    ):
        out = generate(server, {**body, "temperature": 0, "ignore_eos": True})
        assert set(out["meta_info"]) == {
            "prompt_tokens", "completion_tokens", "finish_reason", "output_token_logprobs",
            "routed_experts",
        }  # fmt: skip
        assert out["meta_info"]["finish_reason"] == {"type": "length"}
    r = post(server, {"prompt": "x", "top_logprobs_num": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs_num"

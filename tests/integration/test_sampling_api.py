"""End to end, every sampling parameter through the official `openai` client against one real
`tern launch` serving a tiny random Llama in float32, with Hugging Face as the oracle: logprobs,
top_logprobs, prompt_logprobs and echo are log_softmax of HF's logits; the penalties give what HF's
RepetitionPenaltyLogitsProcessor and OpenAI's formula give on HF's logits; logit_bias,
allowed_token_ids, min_tokens, n with a seed, return_token_ids, chat prompt_token_ids,
truncate_prompt_tokens, skip_special_tokens; LMDeploy's /generate with return_logprob. What is
still unsupported is a 400 naming the parameter.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import tokenizers
import torch
from transformers import AutoModelForCausalLM

from tests.unit.test_api_protocols import LMDEPLOY_GENERATE_EXAMPLE, NOT_YET
from tests.unit.test_sampling_engine import hf_penalized_greedy

pytestmark = pytest.mark.timeout(600)

MODEL = "tiny"
ATOL = 1e-3


@pytest.fixture(scope="module")
def model_dir(tiny_llama: Path, tokenizer_dir: Path | None) -> Path:
    if tokenizer_dir is None:
        pytest.skip("needs the default model's tokenizer (python -m frontend.model_prep)")
    return tiny_llama


@pytest.fixture(scope="module")
def server(shared_server: Any, model_dir: Path) -> Any:
    return shared_server(
        "--model", str(model_dir), "--dtype", "float32", "--max-model-len", "1024",
        "--served-model-name", MODEL,
    )  # fmt: skip


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def hf_logprobs(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """(len(ids), V): row i is the distribution of token i + 1."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def post(server: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60)


def sse_data(server: Any, path: str, body: dict[str, Any]) -> list[Any]:
    with httpx.stream("POST", f"{server.base_url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def extra(obj: Any, name: str) -> Any:
    """A vLLM field the openai client does not know (kept as an extra attribute)."""
    return (obj.model_extra or {}).get(name)


def greedy_ids(client: openai.OpenAI, prompt: list[int], n: int = 6, **body: Any) -> list[int]:
    r = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=n,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True, **body},
    )
    return extra(r.choices[0], "token_ids")


def check_top(values: list[float], strings: list[str], row: torch.Tensor, tok: Any) -> None:
    """Top-k logprobs (values, token strings) against HF's row: same values; same tokens where
    no near-tie can swap them."""
    ref = row.topk(len(values))
    torch.testing.assert_close(torch.tensor(values), ref.values, atol=ATOL, rtol=0)
    for j, (s, t) in enumerate(zip(strings, ref.indices.tolist())):
        gaps = [abs(float(ref.values[j] - ref.values[i])) for i in (j - 1, j + 1) if 0 <= i < 5]
        if all(g > ATOL for g in gaps if g is not None):
            assert s == tok.decode([t], skip_special_tokens=False)


# --------------------------------------------------------------------------- logprobs


def test_chat_logprobs_and_top_logprobs_match_hf(client: openai.OpenAI, hf, tok) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        extra_body={"return_token_ids": True, "ignore_eos": True, "prompt_logprobs": 2},
    )
    choice = r.choices[0]
    prompt, tokens = extra(r, "prompt_token_ids"), extra(choice, "token_ids")
    assert len(tokens) == r.usage.completion_tokens == 6 and len(prompt) == r.usage.prompt_tokens
    ref = hf_logprobs(hf, prompt + tokens[:-1])
    content = choice.logprobs.content
    assert [c.token for c in content] == [
        tok.decode([t], skip_special_tokens=False) for t in tokens
    ]
    for i, c in enumerate(content):
        row = ref[len(prompt) - 1 + i]
        assert abs(c.logprob - float(row[tokens[i]])) < ATOL
        assert c.bytes == list(c.token.encode())  # ASCII-safe tokens of this vocabulary
        assert len(c.top_logprobs) == 5 and c.top_logprobs[0].token == c.token  # greedy
        check_top([t.logprob for t in c.top_logprobs], [t.token for t in c.top_logprobs], row, tok)
    # vLLM's prompt_logprobs: None, then per prompt token its logprob, rank and the top 2.
    prompt_lp = extra(r, "prompt_logprobs")
    assert len(prompt_lp) == len(prompt) and prompt_lp[0] is None
    for j in range(1, len(prompt)):
        entry = prompt_lp[j][str(prompt[j])]
        assert abs(entry["logprob"] - float(ref[j - 1, prompt[j]])) < ATOL
        assert entry["decoded_token"] == tok.decode([prompt[j]], skip_special_tokens=False)
        ranks = sorted(e["rank"] for k, e in prompt_lp[j].items() if k != str(prompt[j]))
        assert ranks in ([1, 2], [1], [2])  # the top 2, minus the prompt token if among them
    # Streamed, the chunks carry the same logprobs.
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    streamed = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content or []
    assert [(c.token, round(c.logprob, 4)) for c in streamed] == [
        (c.token, round(c.logprob, 4)) for c in content
    ]


def test_completion_logprobs_echo_and_prompt_logprobs_match_hf(
    client: openai.OpenAI, hf, tok
) -> None:
    ids = tok.encode("The quick brown fox jumps over the lazy").ids
    r = client.completions.create(
        model=MODEL,
        prompt=ids,
        max_tokens=4,
        temperature=0,
        logprobs=3,
        echo=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    c = r.choices[0]
    out = extra(c, "token_ids")
    seq = ids + out
    ref = hf_logprobs(hf, seq[:-1])
    lp = c.logprobs
    assert c.text == tok.decode(ids) + tok.decode(out)
    assert (
        len(lp.tokens) == len(seq) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    )
    expected = ref[torch.arange(len(seq) - 1), torch.tensor(seq[1:])]
    torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:]), expected, atol=ATOL, rtol=0)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(len(seq))]
    for j in range(1, len(seq)):
        top = lp.top_logprobs[j]
        assert lp.tokens[j] in top and 3 <= len(top) <= 4  # the token and the 3 most likely
        assert abs(max(top.values()) - float(ref[j - 1].max())) < ATOL
    # Output positions only, without echo; and the prompt scored alone (echo, max_tokens 0).
    plain = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=4, temperature=0, logprobs=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert plain.choices[0].logprobs.token_logprobs == pytest.approx(
        lp.token_logprobs[len(ids) :], abs=ATOL
    )
    assert plain.choices[0].logprobs.text_offset[0] == 0
    scored = client.completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=0, echo=True, logprobs=1
    )
    s = scored.choices[0]
    assert s.text == "The quick brown fox" and s.finish_reason == "length"
    assert scored.usage.completion_tokens == 0 and len(s.logprobs.tokens) == 4
    assert s.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:4], abs=ATOL)


def test_streamed_line_separators_survive_a_client_that_splits_lines(
    server: Any, client: openai.OpenAI
) -> None:
    """U+2028, U+2029 and U+0085 in streamed text (here echoed) are JSON escapes on the wire:
    httpx's iter_lines, which breaks lines where str.splitlines() does, still reads whole
    events; the openai client reads the same text."""
    prompt = "one\u2028two\u2029three\x85four"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, "echo": True}
    events = sse_data(server, "/v1/completions", {**body, "stream": True})  # json.loads each
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert text.startswith(prompt)
    stream = client.completions.create(**body, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == text


def test_completion_stream_with_echo_and_logprobs(server: Any, client: openai.OpenAI) -> None:
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": 2,
        "echo": True,
        "ignore_eos": True,
        "prompt_logprobs": 1,
        "return_token_ids": True,
    }
    full = post(server, "/v1/completions", body).json()["choices"][0]
    events = sse_data(server, "/v1/completions", {**body, "stream": True})
    choices = [e["choices"][0] for e in events if e["choices"]]
    assert "".join(ch["text"] for ch in choices) == full["text"]
    joined = {k: [v for ch in choices for v in ch["logprobs"][k]] for k in full["logprobs"]}
    assert joined == full["logprobs"]
    assert choices[0]["prompt_logprobs"] == full["prompt_logprobs"]
    assert choices[0]["prompt_token_ids"] == full["prompt_token_ids"]
    assert [t for ch in choices for t in ch["token_ids"] or []] == full["token_ids"]


# --------------------------------------------------------------------------- penalties


def batch_greedy_ids(client: openai.OpenAI, prompts: list[list[int]], **body: Any) -> list:
    r = client.completions.create(
        model=MODEL,
        prompt=prompts,
        max_tokens=8,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True, **body},
    )
    return [extra(c, "token_ids") for c in r.choices]


@pytest.fixture(scope="module")
def penalty_prompts(client: openai.OpenAI, tok) -> list[list[int]]:
    """Prompts that hold the token greedy picks first (a random model never repeats a token within
    a few steps by itself): then a repetition penalty above 1 has something to push away."""
    prompts = []
    for text in ("Penalties make a model say new things", "Say it again", "Colours: red"):
        ids = tok.encode(text).ids
        for _ in range(8):
            first = greedy_ids(client, ids, 1)[0]
            if first in ids:
                break
            ids = [first, *ids]
        prompts.append(ids)
    return prompts


# NOTE: positive frequency and presence penalties change nothing on outputs that never repeat, so
# most cases reward repeats instead (negative values, a repetition penalty below 1).
@pytest.mark.parametrize(
    ("rep", "freq", "pres"),
    [(1.5, 0.0, 0.0), (0.7, 0.0, 0.0), (1.0, -2.0, 0.0), (1.0, 0.0, -2.0), (1.2, -1.5, 0.5)],
)
def test_penalties_match_hf_logits_processors(
    client: openai.OpenAI,
    hf,
    penalty_prompts: list[list[int]],
    rep: float,
    freq: float,
    pres: float,
) -> None:
    penalties = {"repetition_penalty": rep, "frequency_penalty": freq, "presence_penalty": pres}
    got = batch_greedy_ids(client, penalty_prompts, **penalties)
    expected = [hf_penalized_greedy(hf, p, rep, freq, pres, 8) for p in penalty_prompts]
    assert got == expected
    assert expected != batch_greedy_ids(client, penalty_prompts)  # the penalty mattered
    # The same through chat, with the prompt as token ids.
    r = client.chat.completions.create(
        model=MODEL, messages=[], max_tokens=8, temperature=0, presence_penalty=pres,
        frequency_penalty=freq,
        extra_body={"prompt_token_ids": penalty_prompts[0], "repetition_penalty": rep,
                    "ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    assert extra(r.choices[0], "token_ids") == expected[0]


# --------------------------------------------------------------------------- logits processing


def test_logit_bias_forbids_and_forces_a_token(client: openai.OpenAI, tok) -> None:
    ids = tok.encode("Bias decides").ids
    base = greedy_ids(client, ids)
    forbidden = greedy_ids(client, ids, logit_bias={str(base[0]): -100})
    assert base[0] not in forbidden and forbidden != base
    forced_id = tok.encode(" cat").ids[0]
    assert greedy_ids(client, ids, logit_bias={str(forced_id): 100}) == [forced_id] * 6
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say anything."}],
        max_tokens=4,
        temperature=1.0,
        seed=3,
        logit_bias={str(forced_id): 100},
    )
    assert r.choices[0].message.content == " cat" * 4


def test_allowed_token_ids_and_min_tokens(client: openai.OpenAI, tok) -> None:
    ids = tok.encode("Only these words").ids
    allowed = tok.encode(" red green blue").ids
    got = greedy_ids(client, ids, 6, allowed_token_ids=allowed)
    assert set(got) <= set(allowed)
    base = greedy_ids(client, ids)
    stop = base[0]
    r = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=6, temperature=0,
        extra_body={"stop_token_ids": [stop], "return_token_ids": True},
    )  # fmt: skip
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1
    r = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=6, temperature=0,
        extra_body={"stop_token_ids": [stop], "min_tokens": 4, "return_token_ids": True},
    )  # fmt: skip
    tokens = extra(r.choices[0], "token_ids")
    assert len(tokens) >= 4 and stop not in tokens[:4]


def test_skip_special_tokens_and_spaces_between_them(client: openai.OpenAI, tok) -> None:
    special = tok.token_to_id("<|im_start|>")

    def text(**body: Any) -> str:
        r = client.completions.create(
            model=MODEL, prompt="x", max_tokens=2, temperature=0,
            extra_body={"logit_bias": {str(special): 100}, **body},
        )  # fmt: skip
        return r.choices[0].text

    assert text() == "" and text(spaces_between_special_tokens=True) == ""
    shown = text(skip_special_tokens=False)
    assert shown == "<|im_start|><|im_start|>"  # joined without spaces, as vLLM's fast path
    assert text(skip_special_tokens=False, spaces_between_special_tokens=False) == shown
    with pytest.raises(openai.BadRequestError) as info:
        text(skip_special_tokens=False, spaces_between_special_tokens=True)
    assert info.value.param == "spaces_between_special_tokens"


# --------------------------------------------------------------------------- n, token ids


def test_n_seeded_samples_are_reproducible_across_runs_and_batches(
    server: Any, client: openai.OpenAI
) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "prompt": "Once upon a time there was a little",
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 42,
        "n": 4,
        "extra_body": {"ignore_eos": True},
    }
    first = client.completions.create(**kwargs)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2, 3] and len(set(texts)) > 1
    assert first.usage.completion_tokens == 32
    one = client.completions.create(**{**kwargs, "n": 1})
    assert first.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    assert one.choices[0].text == texts[0]  # sample i has seed + i

    async def with_neighbours() -> list[str]:
        aclient = openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120
        )
        async with aclient:
            others = [
                aclient.completions.create(
                    model=MODEL, prompt=f"Other request {i}", max_tokens=12, temperature=0.7
                )
                for i in range(3)
            ]
            results = await asyncio.gather(aclient.completions.create(**kwargs), *others)
        return [c.text for c in results[0].choices]

    assert asyncio.run(with_neighbours()) == texts
    assert [c.text for c in client.completions.create(**kwargs).choices] == texts
    # Batched prompts: choice index = prompt index x n + sample index.
    batch = client.completions.create(**{**kwargs, "prompt": [kwargs["prompt"], "Hi"], "n": 2})
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices[:2]] == texts[:2]


def test_chat_n_streamed_and_not(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a joke."}],
        "max_tokens": 6,
        "temperature": 0.9,
        "seed": 7,
        "n": 3,
        "extra_body": {"ignore_eos": True},
    }
    full = client.chat.completions.create(**kwargs)
    assert [c.index for c in full.choices] == [0, 1, 2]
    texts = {c.index: c.message.content for c in full.choices}
    streamed: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert streamed == texts and finishes == {0: "length", 1: "length", 2: "length"}


def test_return_token_ids_prompt_token_ids_and_truncation(
    server: Any, client: openai.OpenAI, tok
) -> None:
    messages = [{"role": "user", "content": "What is a token?"}]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    prompt_ids = extra(r, "prompt_token_ids")
    tokens = extra(r.choices[0], "token_ids")
    assert prompt_ids == post(server, "/tokenize", {"messages": messages}).json()["tokens"]
    assert (
        len(tokens) == r.usage.completion_tokens
        and tok.decode(tokens) == r.choices[0].message.content
    )
    by_ids = client.chat.completions.create(
        model=MODEL, messages=[], max_tokens=5, temperature=0,
        extra_body={"prompt_token_ids": prompt_ids, "ignore_eos": True},
    )  # fmt: skip
    assert by_ids.choices[0].message.content == r.choices[0].message.content
    assert by_ids.usage.prompt_tokens == len(prompt_ids)
    # truncate_prompt_tokens keeps the last k prompt tokens.
    ids = tok.encode("one two three four five six seven eight nine ten").ids
    cut = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=3, temperature=0,
        extra_body={"truncate_prompt_tokens": 4, "return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    assert cut.usage.prompt_tokens == 4 and extra(cut.choices[0], "prompt_token_ids") == ids[-4:]
    assert extra(cut.choices[0], "token_ids") == greedy_ids(client, ids[-4:], 3)


def test_chat_echo(client: openai.OpenAI) -> None:
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How"},
    ]
    r = client.chat.completions.create(
        model=MODEL, messages=history, max_tokens=3, temperature=0,
        extra_body={"echo": True, "continue_final_message": True, "add_generation_prompt": False},
    )  # fmt: skip
    assert r.choices[0].message.content.startswith("Hello! How")
    plain = client.chat.completions.create(
        model=MODEL, messages=history[:1], max_tokens=3, temperature=0, extra_body={"echo": True}
    )
    assert not plain.choices[0].message.content.startswith("Hi")  # the reply's role differs


# --------------------------------------------------------------------------- native, errors


def test_lmdeploy_generate_example_with_return_logprob(server: Any, hf) -> None:
    body = {**LMDEPLOY_GENERATE_EXAMPLE, **NOT_YET}
    del body["prompt"]
    assert body["return_logprob"] is True
    ref = hf_logprobs(hf, body["input_ids"])[-1]
    for stream in (False, True):
        body["session_id"] = 201 + stream
        if stream:
            events = sse_data(server, "/generate", {**body, "stream": True})
            ids = [i for e in events for i in e["output_ids"]]
            pairs = [p for e in events for p in e["meta_info"]["output_token_logprobs"]]
        else:
            r = post(server, "/generate", {**body, "stream": False})
            assert r.status_code == 200, r.text
            ids = r.json()["output_ids"]
            pairs = r.json()["meta_info"]["output_token_logprobs"]
        # top_k 1: the most likely token, with its raw logprob.
        assert ids == [int(ref.argmax())] and [p[1] for p in pairs] == ids
        assert abs(pairs[0][0] - float(ref.max())) < ATOL


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/completions", "use_beam_search", True),
        ("/v1/completions", "bad_words", ["x"]),
        ("/v1/completions", "best_of", 3),
        ("/v1/completions", "logprobs", 21),
        ("/v1/completions", "suffix", "end"),
        ("/v1/chat/completions", "top_logprobs", 3),  # without logprobs: true
        ("/v1/chat/completions", "logit_bias", {"999999": 5}),
        ("/v1/chat/completions", "min_tokens", 50),
        ("/generate", "top_logprobs_num", 2),
    ],
)
def test_still_unsupported_or_invalid_is_400_naming_the_parameter(
    server: Any, path: str, field: str, value: Any
) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 4, field: value}
    if path == "/v1/completions":
        body["prompt"] = "x"
    elif path == "/generate":
        body = {"prompt": "x", field: value}
    else:
        body["messages"] = [{"role": "user", "content": "x"}]
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field

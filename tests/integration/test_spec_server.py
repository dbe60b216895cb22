"""Speculative decoding through a real server and the clients users run.

Two servers on the default model in float32, one plain and one with ngram drafts
(`--speculative-config`); on prompts the model copies from, most drafts are accepted. Every answer
of the speculative server equals the plain one's: greedy and seeded sampled text, n > 1, streams,
logprobs (within 1e-5), stop strings that fall inside accepted drafts, json_schema outputs; and
it stays so across a retract pause (every running request preempted mid-stream) and a weight
update mid-stream. The metrics count drafts under tern's and vLLM's names. The MTP and EAGLE-3
draft heads serve Hugging Face's greedy tokens from servers of their own.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import httpx
import pytest

from tests.integration.test_server import client_for

TEXT = (
    "The committee met on Tuesday to review the budget for the new library. After a long "
    "discussion, members agreed to fund the reading room, the children's corner and a small "
    "cafe, and to delay the roof repairs until the spring."
)
MODEL = "SmolLM2-135M-Instruct"


def copy_messages(text: str = TEXT) -> list[dict]:
    return [{"role": "user", "content": f"Repeat this text exactly:\n\n{text}"}]


@pytest.fixture(scope="module")
def servers(module_server: Any, shared_server: Any, tokenizer_dir: Any) -> tuple[Any, Any]:
    if tokenizer_dir is None:
        pytest.skip("the default model is not prepared (scripts/setup_env prepares it)")
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 8})
    plain = shared_server("--dtype", "float32")
    speculative = module_server("--dtype", "float32", "--speculative-config", spec)
    return plain, speculative


def both(servers: tuple[Any, Any], **kw: Any) -> tuple[Any, Any]:
    return tuple(client_for(s).chat.completions.create(model=MODEL, **kw) for s in servers)


def spec_counters(server: Any) -> dict[str, float]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    pattern = r"^(vllm|tern):spec_decode_(num_\w+?)_total\{[^}]*\} (\S+)$"
    out: dict[str, float] = {}
    for prefix, name, value in re.findall(pattern, text, re.M):
        out[f"{prefix}:{name}"] = out.get(f"{prefix}:{name}", 0.0) + float(value)
    return out


def test_greedy_text_streams_and_logprobs_equal_plain(servers: tuple[Any, Any]) -> None:
    before = spec_counters(servers[1])
    plain, spec = both(servers, messages=copy_messages(), max_tokens=80, temperature=0,
                       logprobs=True, top_logprobs=2)  # fmt: skip
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert "reading room" in spec.choices[0].message.content  # it copies
    assert spec.usage.completion_tokens == plain.usage.completion_tokens
    got = [t.logprob for t in spec.choices[0].logprobs.content]
    want = [t.logprob for t in plain.choices[0].logprobs.content]
    assert [t.token for t in spec.choices[0].logprobs.content] == [
        t.token for t in plain.choices[0].logprobs.content
    ]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-5)
    after = spec_counters(servers[1])
    accepted = after["tern:num_accepted_tokens"] - before.get("tern:num_accepted_tokens", 0)
    assert accepted > 0.6 * spec.usage.completion_tokens  # most tokens came from drafts
    assert after["vllm:num_accepted_tokens"] == after["tern:num_accepted_tokens"]
    assert after["tern:num_drafts"] > 0 and after["tern:num_draft_tokens"] >= accepted
    assert not any(spec_counters(servers[0]).values())  # the plain server drafts nothing
    stream = client_for(servers[1]).chat.completions.create(
        model=MODEL, messages=copy_messages(), max_tokens=80, temperature=0, stream=True
    )
    chunks = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(chunks) == plain.choices[0].message.content


def test_seeded_sampling_and_n_equal_plain(servers: tuple[Any, Any]) -> None:
    for kw in (
        dict(temperature=0.8, top_p=0.9, seed=11, n=3),
        dict(temperature=1.0, frequency_penalty=0.5, presence_penalty=0.2, seed=12, n=2),
        dict(temperature=0.6, logit_bias={"13": -100}, seed=13),
    ):
        plain, spec = both(servers, messages=copy_messages(), max_tokens=60, **kw)
        assert [c.message.content for c in spec.choices] == [
            c.message.content for c in plain.choices
        ], kw


def test_stop_strings_inside_accepted_drafts(servers: tuple[Any, Any]) -> None:
    plain, spec = both(servers, messages=copy_messages(), max_tokens=80, temperature=0,
                       stop=["children"])  # fmt: skip
    text = spec.choices[0].message.content
    assert text == plain.choices[0].message.content
    full = client_for(servers[1]).chat.completions.create(
        model=MODEL, messages=copy_messages(), max_tokens=80, temperature=0
    )
    full_text = full.choices[0].message.content
    assert text == full_text[: full_text.index("children")]
    assert spec.choices[0].finish_reason == "stop"
    stream = client_for(servers[1]).chat.completions.create(
        model=MODEL, messages=copy_messages(), max_tokens=80, temperature=0, stop=["children"],
        stream=True,
    )  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


def test_json_schema_outputs(servers: tuple[Any, Any]) -> None:
    schema = {
        "type": "object",
        "properties": {"topic": {"type": "string"}, "months": {"type": "integer"}},
        "required": ["topic", "months"],
        "additionalProperties": False,
    }
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    messages = copy_messages('{"topic": "the library budget", "months": 6}')
    plain, spec = both(servers, messages=messages, max_tokens=60, temperature=0,
                       response_format=rf)  # fmt: skip
    assert spec.choices[0].message.content == plain.choices[0].message.content
    value = json.loads(spec.choices[0].message.content)
    assert set(value) == {"topic", "months"}


def _stream_while(server: Any, action: Any) -> str:
    """A greedy copy streamed while `action()` runs once the first tokens arrived."""
    stream = client_for(server).chat.completions.create(
        model=MODEL, messages=copy_messages(), max_tokens=80, temperature=0, stream=True
    )
    parts, worker = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        if len(parts) == 3 and worker is None:
            worker = threading.Thread(target=action)
            worker.start()
    assert worker is not None
    worker.join(timeout=60)
    return "".join(parts)


def test_retract_pause_and_weight_update_mid_stream(servers: tuple[Any, Any]) -> None:
    """A retract pause preempts the request mid-speculation; a weight update (the same weights
    from disk) lands mid-stream: the text is still plain decoding's."""
    plain, spec = servers
    want = client_for(plain).chat.completions.create(
        model=MODEL, messages=copy_messages(), max_tokens=80, temperature=0
    )
    want_text = want.choices[0].message.content

    def retract() -> None:
        r = httpx.post(f"{spec.base_url}/pause_generation", json={"mode": "retract"}, timeout=60)
        assert r.status_code == 200, r.text
        r = httpx.post(f"{spec.base_url}/resume_generation", json={}, timeout=60)
        assert r.status_code == 200, r.text

    assert _stream_while(spec, retract) == want_text
    model_path = spec.server_info()["model_path"]

    def update() -> None:
        r = httpx.post(f"{spec.base_url}/update_weights_from_disk",
                       json={"model_path": model_path}, timeout=120)  # fmt: skip
        assert r.status_code == 200 and r.json()["success"], r.text

    assert _stream_while(spec, update) == want_text


def test_mtp_and_eagle3_heads_serve_hf_greedy_tokens(
    module_server: Any,
    tokenizer_dir: Any,
    tiny_qwen3_5_mtp: Any,
    tiny_llama: Any,
    tiny_llama_eagle3: Any,
) -> None:
    """The draft heads in a real multi-process server, as users start them: the tiny Qwen3.5 with
    its (random) MTP head through SGLang's flags (`--speculative-algorithm NEXTN
    --speculative-num-steps 2`), the tiny Llama with an EAGLE-3 head through vLLM's JSON. The
    openai client's completions (prompt token ids, greedy) carry Hugging Face's greedy tokens,
    and the metrics count the verified drafts."""
    from tests.unit.test_engine_inproc import hf_greedy, make_prompts, vocab_of

    if tokenizer_dir is None:
        pytest.skip("the tiny checkpoints need the default model's tokenizer to be served")
    eagle = json.dumps({"method": "eagle3", "model": str(tiny_llama_eagle3),
                        "num_speculative_tokens": 3})  # fmt: skip
    setups = [
        (tiny_qwen3_5_mtp, ("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2")),
        (tiny_llama, ("--speculative-config", eagle)),
    ]
    for model_dir, flags in setups:
        server = module_server("--model", str(model_dir), "--dtype", "float32", *flags)
        prompts = make_prompts(vocab_of(model_dir), n=4)
        client = client_for(server)
        for prompt, want in zip(prompts, hf_greedy(model_dir, prompts, 12)):
            reply = client.completions.create(
                model=str(model_dir), prompt=prompt, max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )  # fmt: skip
            assert reply.choices[0].token_ids == want, flags
        assert spec_counters(server)["tern:num_draft_tokens"] > 0

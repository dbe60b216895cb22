"""Structured output in the engine core (EngineCore + InProcExecutor, tiny random Llama): the
grammar holds from the first token, or from the token after the reasoning's end; preemption keeps
the matcher in step with the tokens."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from enginecore.messages import (
    EngineCoreRequest,
    FinishReason,
    SamplingParams,
    StructuredOutputKind,
    StructuredOutputSpec,
)
from tests.unit.test_engine_inproc import drain, make_core

REGEX = r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"


@pytest.fixture(scope="module")
def model_dir(tiny_llama_with_tokenizer: Path) -> Path:
    return tiny_llama_with_tokenizer


def _run(core, requests: dict[str, EngineCoreRequest]) -> dict[str, tuple[list[int], object]]:
    for req in requests.values():
        assert core.add_request(req) == []
    outs, finish = drain(core)
    return {k: (outs.get(k, []), finish[k]) for k in requests}


def test_constraint_from_the_start_and_after_reasoning(model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(model_dir)
    core = make_core(model_dir)
    prompt = tok.encode("contact:")
    free = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, seed=1)
    [(free_ids, _)] = _run(core, {"free": EngineCoreRequest("free", prompt, free)}).values()
    end = free_ids[:1]  # the greedy model's first token "ends its reasoning"

    def request(name: str, temperature: float, seed: int, reasoning_end: list[int]):
        spec = StructuredOutputSpec(StructuredOutputKind.REGEX, REGEX, reasoning_end_token_ids=end)
        spec.reasoning_end_token_ids = reasoning_end
        params = SamplingParams(
            temperature=temperature, max_tokens=64, eos_token_ids=[2], seed=seed
        )
        return EngineCoreRequest(name, prompt, params, structured_output=spec)

    requests = {f"c{i}": request(f"c{i}", 1.0, i, []) for i in range(4)}
    # Greedy, so the first (unconstrained) token is the end of the reasoning.
    requests["r"] = request("r", 0.0, 0, end)
    results = _run(core, requests)
    for name, (ids, finish) in results.items():
        assert finish == FinishReason.STOP, (name, finish)
        if name == "r":
            assert ids[0] == end[0]
            ids = ids[1:]
        text = tok.decode(ids, skip_special_tokens=True)
        assert re.fullmatch(REGEX, text), (name, text)


def test_preempted_requests_keep_their_grammar(model_dir: Path) -> None:
    """A 12-block cache for 6 requests growing to 3-7 blocks each: they preempt one another."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    core = make_core(model_dir, num_blocks=12)
    schema = (
        '{"type": "array", "items": {"enum": ["alpha", "beta"]}, "minItems": 8, "maxItems": 10}'
    )
    requests = {
        f"p{i}": EngineCoreRequest(
            f"p{i}",
            tok.encode(f"list {i}:"),
            SamplingParams(temperature=1.0, max_tokens=100, eos_token_ids=[2], seed=i),
            structured_output=StructuredOutputSpec(
                StructuredOutputKind.JSON, schema, any_whitespace=False
            ),
        )
        for i in range(6)
    }
    results = _run(core, requests)
    assert core.scheduler.num_preempted_total > 0
    for name, (ids, finish) in results.items():
        assert finish == FinishReason.STOP, (name, finish)
        items = json.loads(tok.decode(ids, skip_special_tokens=True))
        assert 8 <= len(items) <= 10 and set(items) <= {"alpha", "beta"}


def test_json_strings_are_strict_json(model_dir: Path) -> None:
    """No raw control character in any JSON string, length-bounded or not (xgrammar's own grammar
    lets bounded ones hold tabs); the bounds still hold."""
    import xgrammar as xgr

    from enginecore.structured_output import GrammarCompiler

    config = json.loads((model_dir / "config.json").read_text())
    compiler = GrammarCompiler(model_dir, config["vocab_size"])
    schema = {
        "type": "object",
        "properties": {
            "short": {"type": "string", "minLength": 1, "maxLength": 4},
            "free": {"type": "string"},
        },
    }
    spec = StructuredOutputSpec(StructuredOutputKind.JSON, json.dumps(schema))
    compiled = compiler.submit(spec, [2]).result()
    compiler.shutdown()

    def accepts(text: str) -> bool:
        return xgr.GrammarMatcher(compiled).accept_string(text)

    assert accepts('{"short": "abc", "free": "x\\ny"}')  # an escaped newline: fine
    assert not accepts('{"short": "a\tb"}')
    assert not accepts('{"free": "a\tb"}')
    assert not accepts('{"short": "abcde"}')

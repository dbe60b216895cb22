"""Bounded JSON grammars (enginecore/json_grammar.py): numbers of at most 17 significant digits and
a 3-digit exponent, whitespace of at most one newline plus indentation, schema bounds kept; and,
at temperature 1 on a tiny random model, 200 schemas' outputs all finish, validate and stay within
the number bound."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import jsonschema
import pytest
import xgrammar as xgr
from transformers import AutoTokenizer
from xgrammar.testing import _is_grammar_accept_string

from enginecore.json_grammar import MAX_EXPONENT_DIGITS, MAX_SIGNIFICANT_DIGITS
from enginecore.messages import (
    EngineCoreRequest,
    FinishReason,
    SamplingParams,
    StructuredOutputKind,
    StructuredOutputSpec,
)
from enginecore.structured_output import any_json_grammar, json_schema_grammar
from tests.unit.test_engine_inproc import drain, make_core

NUMBERS = {
    "type": "object",
    "properties": {"i": {"type": "integer"}, "x": {"type": "number"}},
    "required": ["i", "x"],
}


def _accepts(ebnf: str, text: str) -> bool:
    return _is_grammar_accept_string(xgr.Grammar.from_ebnf(ebnf), text)


def _doc(i: str, x: str) -> str:
    return f'{{"i": {i}, "x": {x}}}'


@pytest.mark.parametrize(
    ("i", "x", "ok"),
    [
        ("1", "2.5", True),
        ("-12345678901234567", "0.12345678901234567", True),  # 17 digits each, "0." not counted
        ("123456789012345678", "1", False),  # 18 digits
        ("1", "1234567890.1234567", True),  # 10 + 7
        ("1", "1234567890.12345678", False),  # 10 + 8
        ("1", "-1.5e+308", True),
        ("1", "1e1234", False),  # a 4-digit exponent
        ("01", "1", False),  # still JSON
    ],
)
def test_schema_numbers_are_bounded(i: str, x: str, ok: bool) -> None:
    assert _accepts(json_schema_grammar(json.dumps(NUMBERS), True), _doc(i, x)) is ok
    any_ok = ok and not i.startswith("0")
    assert _accepts(any_json_grammar(True), _doc(i, x)) is any_ok


def test_the_number_bound_can_be_lifted() -> None:
    long = _doc("123456789012345678901234567890", "1.5")
    assert _accepts(json_schema_grammar(json.dumps(NUMBERS), True, bound_numbers=False), long)
    assert _accepts(any_json_grammar(True, bound_numbers=False), long)


def test_whitespace_is_bounded_but_pretty_printing_fits() -> None:
    deep = {"a": [{"b": {"c": [1, 2, {"d": 3.25}]}}]}
    for grammar in (
        any_json_grammar(True),
        json_schema_grammar(json.dumps({"type": "object"}), True),
    ):
        assert _accepts(grammar, json.dumps(deep, indent=2))
        assert _accepts(grammar, json.dumps(deep, indent="\t"))
        assert _accepts(grammar, json.dumps(deep))
        assert not _accepts(grammar, '{\n\n"a": 1}')  # two newlines in one gap
        assert not _accepts(grammar, '{"a":    1}')  # four spaces
    compact = any_json_grammar(False)
    assert _accepts(compact, '{"a":[1,2]}') and not _accepts(compact, '{"a": 1}')


def test_schema_bounds_are_enforced() -> None:
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 1, "maximum": 10},
            "x": {"type": "number", "exclusiveMinimum": 0},
            "l": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2},
            "s": {"type": "string", "minLength": 2, "maxLength": 3},
        },
        "required": ["n", "x", "l", "s"],
    }
    grammar = json_schema_grammar(json.dumps(schema), True)

    def doc(n: str = "5", x: str = "0.5", items: str = "[1]", s: str = '"ab"') -> str:
        return f'{{"n": {n}, "x": {x}, "l": {items}, "s": {s}}}'

    assert _accepts(grammar, doc())
    for bad in (
        doc(n="11"), doc(n="0"), doc(x="0"), doc(x="-1"), doc(items="[]"),
        doc(items="[1, 2, 3]"), doc(s='"a"'), doc(s='"abcd"'),
    ):  # fmt: skip
        assert not _accepts(grammar, bad), bad


# --------------------------------------------------------------------------- property test

_NUMBER = re.compile(r"-?(\d+)(?:\.(\d+))?(?:[eE][+-]?(\d+))?")


def _random_schema(rng: random.Random, depth: int = 0) -> dict:
    """Objects, bounded arrays, numbers, integers, booleans and enums: no free strings, whose
    length a random model would not bound."""
    kinds = ["number", "integer", "boolean", "enum"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "object":
        names = [f"k{i}" for i in range(rng.randint(1, 3))]
        props = {n: _random_schema(rng, depth + 1) for n in names}
        return {"type": "object", "properties": props, "required": names,
                "additionalProperties": False}  # fmt: skip
    if kind == "array":
        return {"type": "array", "items": _random_schema(rng, depth + 1), "maxItems": 3}
    if kind == "enum":
        return {"enum": ["red", "green", 7]}
    schema: dict = {"type": kind}
    if rng.random() < 0.3:
        schema["minimum"] = rng.randint(-50, 0)
    if rng.random() < 0.3:
        schema["maximum"] = rng.randint(1, 10**6)
    return schema


def test_random_schemas_at_temperature_1_finish_valid_and_bounded(
    tiny_llama_with_tokenizer: Path,
) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_llama_with_tokenizer)
    core = make_core(tiny_llama_with_tokenizer)
    rng = random.Random(0)
    schemas = [{"type": "object", "properties": {"v": _random_schema(rng)}, "required": ["v"]}
               for _ in range(200)]  # fmt: skip
    prompt = tok.encode("JSON:")
    for i, schema in enumerate(schemas):
        spec = StructuredOutputSpec(StructuredOutputKind.JSON, json.dumps(schema))
        params = SamplingParams(temperature=1.0, max_tokens=256, eos_token_ids=[2], seed=i)
        assert (
            core.add_request(EngineCoreRequest(f"s{i}", prompt, params, structured_output=spec))
            == []
        )
    outs, finish = drain(core)
    for i, schema in enumerate(schemas):
        text = tok.decode(outs[f"s{i}"], skip_special_tokens=True)
        assert finish[f"s{i}"] == FinishReason.STOP, (schema, text)
        jsonschema.validate(json.loads(text), schema)
        for literal in _NUMBER.findall(text):
            integer, fraction, exponent = literal
            digits = (integer.lstrip("0") or "") + fraction if integer != "0" else fraction
            assert len(digits) <= MAX_SIGNIFICANT_DIGITS, text
            assert len(exponent) <= MAX_EXPONENT_DIGITS, text


@pytest.mark.parametrize("maxlen", [None, 4])
def test_strings_refuse_control_characters_and_surrogates(maxlen: int | None) -> None:
    """xgrammar's strings (length-bounded ones above all) take raw control characters, which
    json.loads refuses, and a surrogate's three bytes, which decode to three replacement characters
    where the grammar counted one: both are refused, at the byte level the sampler works at."""
    string = {"type": "string"} if maxlen is None else {"type": "string", "maxLength": maxlen}
    schema = {"type": "object", "properties": {"s": string}, "required": ["s"]}
    vocab = xgr.TokenizerInfo([bytes([b]) for b in range(256)])
    compiled = xgr.GrammarCompiler(vocab).compile_grammar(
        json_schema_grammar(json.dumps(schema), True)
    )

    def accepts(raw: bytes) -> bool:
        return xgr.GrammarMatcher(compiled).accept_string(b'{"s": "' + raw + b'"}')

    assert accepts("ab€".encode()) and accepts(b"\xed\x9f\xbf")
    assert accepts(b"\\t") == (maxlen is None)  # xgrammar's bounded strings take no escapes
    for bad in (b"\x01", b"\t", b"\xed\xa0\x80", b"\xed\xbf\xbf"):
        assert not accepts(bad), bad

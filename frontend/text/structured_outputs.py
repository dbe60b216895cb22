"""Structured-output requests, in every shape clients send them, to one checked StructuredOutputSpec.

The shapes (vLLM's, OpenAI's, LMDeploy's and TensorRT-LLM's):
- `response_format`: {"type": "text" | "json_object"}, {"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}}, {"type": "structural_tag", ...}, LMDeploy's {"type": "regex_schema",
  "regex_schema"}, TensorRT-LLM's {"type": "json", "schema"} / {"type": "regex", "regex"} /
  {"type": "ebnf", "ebnf"};
- vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object,
  structural_tag, with disable_any_whitespace;
- vLLM's older top-level `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

A request may use one of them. Each is checked here by building its xgrammar Grammar (no tokenizer
needed, milliseconds), so a bad schema, regex or grammar is the client's 400 naming the problem;
the engine core compiles it against the vocabulary off its step loop. Checks are cached.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from enginecore.messages import StructuredOutputKind, StructuredOutputSpec
from enginecore.structured_output import json_schema_grammar, structural_tag_args
from frontend.common.errors import bad_request

_K = StructuredOutputKind
_STRUCTURED_OUTPUTS_KINDS = {
    "json": _K.JSON,
    "regex": _K.REGEX,
    "choice": _K.GRAMMAR,
    "grammar": _K.GRAMMAR,
    "json_object": _K.JSON_OBJECT,
    "structural_tag": _K.STRUCTURAL_TAG,
}
# structured_outputs options: accepted values that change nothing here.
_NEUTRAL_OPTIONS = {"disable_fallback": (False, True), "disable_additional_properties": (False,)}
_GUIDED_BACKENDS = (None, "auto", "xgrammar")
_GUIDED_KINDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_MAX_CHECKED = 512  # specs whose check is cached


def structured_output_spec(
    response_format: Any = None,
    structured_outputs: Any = None,
    guided: dict[str, Any] | None = None,
    guided_decoding_backend: str | None = None,
) -> StructuredOutputSpec | None:
    """The request's output constraint, or None. Raises APIError (400) naming the field.

    `guided`: vLLM's older fields by name (guided_json, guided_regex, ...), None when unset.
    """
    found: list[tuple[str, StructuredOutputSpec]] = []
    if response_format is not None:
        spec = from_response_format(response_format, "response_format")
        if spec is not None:
            found.append(("response_format", spec))
    if structured_outputs is not None:
        found.append(("structured_outputs", _from_structured_outputs(structured_outputs)))
    for name, value in (guided or {}).items():
        if value is not None:
            kind = _GUIDED_KINDS[name]
            found.append((name, _build(kind, value, name, any_whitespace=True)))
    if guided_decoding_backend not in _GUIDED_BACKENDS:
        raise bad_request(
            f"guided_decoding_backend {guided_decoding_backend!r} is not available; this server "
            "uses xgrammar",
            "guided_decoding_backend",
        )
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise bad_request(f"set at most one output constraint; got {names}", found[1][0])
    return found[0][1] if found else None


# response_format's types -> the keys each defines besides "type" (any other key is a 400).
_RESPONSE_FORMAT_KEYS: dict[str, tuple[str, ...]] = {
    "text": (),
    "json_object": ("schema",),  # with a schema: that schema (TensorRT-LLM's and instructor's)
    "json_schema": ("json_schema",),
    "structural_tag": ("structures", "triggers", "format"),
    "regex_schema": ("regex_schema",),  # LMDeploy's
    "regex": ("regex",),  # TensorRT-LLM's
    "json": ("schema",),  # TensorRT-LLM's
    "ebnf": ("ebnf",),  # TensorRT-LLM's
}
_JSON_SCHEMA_KEYS = ("name", "schema", "strict", "description")


def from_response_format(value: Any, param: str) -> StructuredOutputSpec | None:
    """OpenAI's response_format (and LMDeploy's / TensorRT-LLM's variants); None for text."""
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_request(f"{param} must be an object with a string 'type'", param)
    kind = value["type"]
    if kind not in _RESPONSE_FORMAT_KEYS:
        raise bad_request(
            f"{param}.type {kind!r} is not supported; use one of "
            f"{', '.join(_RESPONSE_FORMAT_KEYS)}",
            f"{param}.type",
        )
    _check_keys(value, ("type", *_RESPONSE_FORMAT_KEYS[kind]), f"{param}", f"type {kind!r}")
    if kind == "text":
        return None
    if kind in ("json_object", "json"):
        schema = value.get("schema")
        if schema is None:
            if kind == "json":
                raise bad_request(f"{param}.schema is required", f"{param}.schema")
            return _build("json_object", True, param)
        return _build("json", schema, f"{param}.schema")
    if kind == "json_schema":
        schema_spec = value.get("json_schema")
        if not isinstance(schema_spec, dict):
            raise bad_request(f"{param}.json_schema must be an object", f"{param}.json_schema")
        _check_keys(schema_spec, _JSON_SCHEMA_KEYS, f"{param}.json_schema", "json_schema")
        schema = schema_spec.get("schema")
        if schema is None:  # OpenAI: a json_schema format without a schema is any JSON object
            return _build("json_object", True, param)
        return _build("json", schema, f"{param}.json_schema.schema")
    if kind == "structural_tag":
        return _build("structural_tag", dict(value), param)
    if kind in ("regex_schema", "regex"):
        return _build("regex", value.get(kind), f"{param}.{kind}")
    return _build("grammar", value.get("ebnf"), f"{param}.ebnf")


def _check_keys(value: dict[str, Any], known: tuple[str, ...], param: str, what: str) -> None:
    for key in value:
        if key not in known:
            raise bad_request(
                f"{param}.{key} is not a field of {what} (it has: {', '.join(known)})",
                f"{param}.{key}",
            )


def json_schema_spec(schema: dict[str, Any], param: str) -> StructuredOutputSpec:
    """The constraint of one JSON schema (checked: a bad schema is a 400 naming `param`)."""
    return _build("json", schema, param)


def _from_structured_outputs(value: Any) -> StructuredOutputSpec:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise bad_request(f"{param} must be an object", param)
    kinds = [k for k in _STRUCTURED_OUTPUTS_KINDS if value.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise bad_request(
            f"{param} needs exactly one of {', '.join(_STRUCTURED_OUTPUTS_KINDS)}; got "
            f"{', '.join(kinds) or 'none'}",
            param,
        )
    known = {*_STRUCTURED_OUTPUTS_KINDS, "disable_any_whitespace", *_NEUTRAL_OPTIONS}
    for key, option in value.items():
        if key not in known:
            raise bad_request(f"{param}.{key} is not supported by this server", f"{param}.{key}")
        if key in _NEUTRAL_OPTIONS and option not in _NEUTRAL_OPTIONS[key]:
            raise bad_request(f"{param}.{key}: {option!r} is not supported", f"{param}.{key}")
    disable_ws = value.get("disable_any_whitespace", False)
    if not isinstance(disable_ws, bool):
        raise bad_request(f"{param}.disable_any_whitespace must be a boolean", param)
    kind = kinds[0]
    return _build(kind, value[kind], f"{param}.{kind}", any_whitespace=not disable_ws)


def _build(kind: str, value: Any, param: str, any_whitespace: bool = True) -> StructuredOutputSpec:
    """The spec of one constraint (kind: a structured_outputs key), checked."""
    so_kind = _STRUCTURED_OUTPUTS_KINDS[kind]
    if kind == "json":
        value = _parsed(value, param)
        if not isinstance(value, (dict, bool)):
            raise bad_request(f"{param} must be a JSON schema (an object)", param)
        text = json.dumps(value, ensure_ascii=False)
    elif kind == "json_object":
        text = ""
    elif kind == "choice":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise bad_request(f"{param} must be a non-empty list of non-empty strings", param)
        text = choice_grammar(value)
    elif kind == "structural_tag":
        value = _parsed(value, param)
        if not isinstance(value, dict):
            raise bad_request(f"{param} must be a structural tag object", param)
        text = json.dumps(value, ensure_ascii=False)
    else:
        if not isinstance(value, str) or not value:
            raise bad_request(f"{param} must be a non-empty string", param)
        text = value
    error = _check(so_kind, text, any_whitespace)
    if error is not None:
        raise bad_request(f"{param}: {error}", param)
    return StructuredOutputSpec(so_kind, text, any_whitespace=any_whitespace)


def _parsed(value: Any, param: str) -> Any:
    """A JSON value given as an object or as its JSON text."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise bad_request(f"{param} is not valid JSON: {e}", param) from None


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices`."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@functools.lru_cache(maxsize=_MAX_CHECKED)
def _check(kind: StructuredOutputKind, text: str, any_whitespace: bool) -> str | None:
    """None when xgrammar accepts the constraint, else its complaint."""
    import xgrammar as xgr

    try:
        if kind == _K.JSON:
            json_schema_grammar(text, any_whitespace)  # raises on a bad schema
        elif kind == _K.REGEX:
            xgr.Grammar.from_regex(text)
        elif kind == _K.GRAMMAR:
            xgr.Grammar.from_ebnf(text)
        elif kind == _K.STRUCTURAL_TAG:
            xgr.Grammar.from_structural_tag(*structural_tag_args(text))
    except Exception as e:  # xgrammar raises RuntimeError, ValueError, its own errors...
        return _clean_error(e)
    return None


def _clean_error(e: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    message = str(e).strip() or type(e).__name__
    first, _, rest = message.partition(": ")
    if rest and (".cc:" in first or first.startswith("[")):
        return rest.strip()
    return message

"""Structured-output requests to specs (frontend/text/structured_outputs.py): every key of
response_format is one its type defines, and json_object with a schema follows the schema."""

from __future__ import annotations

import json

import pytest

from enginecore.messages import StructuredOutputKind
from frontend.common.errors import APIError
from frontend.text.structured_outputs import structured_output_spec

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def test_json_object_with_a_schema_constrains_to_the_schema() -> None:
    spec = structured_output_spec({"type": "json_object", "schema": SCHEMA})
    assert spec is not None and spec.kind == StructuredOutputKind.JSON
    assert json.loads(spec.spec) == SCHEMA
    plain = structured_output_spec({"type": "json_object"})
    assert plain is not None and plain.kind == StructuredOutputKind.JSON_OBJECT


@pytest.mark.parametrize(
    ("response_format", "param"),
    [
        ({"type": "json_object", "json_schema": SCHEMA}, "response_format.json_schema"),
        ({"type": "text", "schema": SCHEMA}, "response_format.schema"),
        ({"type": "json_schema", "schema": SCHEMA}, "response_format.schema"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strcit": True}},
            "response_format.json_schema.strcit",
        ),
        ({"type": "regex_schema", "regex_schema": "a+", "flags": "i"}, "response_format.flags"),
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json"}, "response_format.schema"),
    ],
)
def test_keys_the_type_does_not_define_are_400s_naming_them(
    response_format: dict, param: str
) -> None:
    with pytest.raises(APIError) as e:
        structured_output_spec(response_format)
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_structured_outputs_keys_are_strict_too() -> None:
    with pytest.raises(APIError) as e:
        structured_output_spec(structured_outputs={"json": SCHEMA, "whitespace": "none"})
    assert e.value.param == "structured_outputs.whitespace"


def test_at_most_one_constraint() -> None:
    with pytest.raises(APIError) as e:
        structured_output_spec({"type": "json_object"}, guided={"guided_regex": "a+"})
    assert e.value.param == "guided_regex"

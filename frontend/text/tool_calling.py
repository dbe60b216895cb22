"""A chat request's `tools` and `tool_choice` -> what the template sees, how the output is parsed,
and the grammar that guarantees the calls (as vLLM does it).

- `none`: the tools are rendered (the template may mention them); the output is plain content.
- `auto`: the model decides; `--tool-call-parser` finds the calls in its text (needs
  `--enable-auto-tool-choice`, as vLLM).
- `required`: the output is constrained to a JSON array of {"name", "parameters"} objects, each
  valid against its tool's parameters schema (one element when parallel_tool_calls is false).
- a named function: the output is constrained to that function's parameters object.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from enginecore.messages import StructuredOutputSpec
from frontend.common.errors import bad_request
from frontend.text.chat_options import ChatOptions
from frontend.text.structured_outputs import json_schema_spec
from frontend.text.tool_parsers import (
    JsonArrayToolCallParser,
    NamedToolCallParser,
    StreamingToolParser,
    make_tool_parser,
)


@dataclass
class ToolPlan:
    tools: list[dict[str, Any]] | None  # for the chat template
    new_parser: Callable[[], StreamingToolParser] | None  # None: the output is plain content
    constraint: StructuredOutputSpec | None  # the grammar of the output (tools or response_format)
    max_calls: int | None  # None: no limit (parallel_tool_calls)


def plan_tools(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None,
    response_constraint: StructuredOutputSpec | None,
    options: ChatOptions,
) -> ToolPlan:
    """Checks tools (in chat completions' shape), tool_choice ("none", "auto", "required" or
    {"type": "function", "function": {"name"}}) and the output constraint together. Raises
    APIError (400); other APIs turn their tools into this shape first."""
    tools = _checked_tools(tools)
    choice = tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    max_calls = 1 if parallel_tool_calls is False else None
    if choice == "none":
        return ToolPlan(tools or None, None, response_constraint, None)
    if not tools:
        raise bad_request(f"tool_choice {_show(choice)} needs tools", "tool_choice")
    if choice == "auto":
        if not (options.enable_auto_tool_choice and options.tool_call_parser):
            raise bad_request(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set on the server",
                "tool_choice",
            )
        parser_name = options.tool_call_parser
        return ToolPlan(
            tools, lambda: make_tool_parser(parser_name), response_constraint, max_calls
        )
    if response_constraint is not None:
        raise bad_request(
            f"tool_choice {_show(choice)} constrains the output itself; it cannot be combined "
            "with response_format or structured_outputs",
            "tool_choice",
        )
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    if choice == "required":
        schema = _calls_schema(list(by_name.values()), max_calls)
        return ToolPlan(tools, JsonArrayToolCallParser, _json_spec(schema), max_calls)
    name = _named_choice(choice)
    if name not in by_name:
        raise bad_request(
            f"tool_choice names function {name!r}, which is not among the tools "
            f"({', '.join(by_name)})",
            "tool_choice",
        )
    schema = _parameters(by_name[name])
    return ToolPlan(tools, lambda: NamedToolCallParser(name), _json_spec(schema), 1)


def _checked_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    if not tools:
        return []
    names: set[str] = set()
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise bad_request("each tool must be {'type': 'function', 'function': {...}}", param)
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request("a tool needs function.name (a string)", f"{param}.function")
        if not function["name"] or function["name"] in names:
            raise bad_request("tool names must be non-empty and unique", f"{param}.function.name")
        names.add(function["name"])
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_request(
                "function.parameters must be a JSON schema object", f"{param}.function.parameters"
            )
    return tools


def _named_choice(choice: Any) -> str:
    function = choice.get("function") if isinstance(choice, dict) else None
    if (
        not isinstance(choice, dict)
        or choice.get("type", "function") != "function"
        or not isinstance(function, dict)
        or not isinstance(function.get("name"), str)
    ):
        raise bad_request(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    return function["name"]


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object", "properties": {}}


def _calls_schema(functions: list[dict[str, Any]], max_calls: int | None) -> dict[str, Any]:
    call_schemas = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [f["name"]]},
                "parameters": _parameters(f),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    items = call_schemas[0] if len(call_schemas) == 1 else {"anyOf": call_schemas}
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    return schema


def _json_spec(schema: dict[str, Any]) -> StructuredOutputSpec:
    # NOTE: the tools' schemas are the client's: a bad one is a 400 like any other json_schema.
    return json_schema_spec(schema, "tools")


def _show(choice: Any) -> str:
    return json.dumps(choice) if not isinstance(choice, str) else f'"{choice}"'

"""Tool calls sampled at temperature 1 from a tiny random-weight checkpoint, through the Responses
API (openai SDK) and the Messages API (anthropic SDK): with a seed, the streamed call reassembles to
exactly the unstreamed one, and every call's arguments validate against the tool's schema. A random
model explores far more of the grammar than the default model does at temperature 0."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

MODEL = "tiny"
SEEDS = range(6)
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Lyon", "Nice"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "metric": {"type": "boolean"},
        "threshold": {"type": "number"},
    },
    "required": ["city", "days", "metric", "threshold"],
    "additionalProperties": False,
}
DESCRIPTION = "The weather forecast for a city."
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server(shared_server: Any, tiny_llama_with_tokenizer: Path) -> Any:
    return shared_server(
        "--model", str(tiny_llama_with_tokenizer), "--dtype", "float32",
        "--served-model-name", MODEL, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    )  # fmt: skip


def test_responses_function_calls(server: Any) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
    tools = [{"type": "function", "name": "forecast", "description": DESCRIPTION,
              "parameters": SCHEMA}]  # fmt: skip
    for seed in SEEDS:
        kwargs = {
            "model": MODEL, "input": QUESTION, "tools": tools, "tool_choice": "required",
            "parallel_tool_calls": False, "temperature": 1.0, "max_output_tokens": 200,
            "extra_body": {"seed": seed},
        }  # fmt: skip
        whole = client.responses.create(**kwargs)
        with client.responses.stream(**kwargs) as stream:
            streamed = stream.get_final_response()
        calls = [(o.name, o.arguments) for o in whole.output if o.type == "function_call"]
        assert calls == [
            (o.name, o.arguments) for o in streamed.output if o.type == "function_call"
        ]
        assert whole.status == streamed.status == "completed", (seed, whole.output)
        ((name, arguments),) = calls
        assert name == "forecast"
        jsonschema.validate(json.loads(arguments), SCHEMA)


def test_messages_tool_use(server: Any) -> None:
    client = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0)
    tools = [{"name": "forecast", "description": DESCRIPTION, "input_schema": SCHEMA}]
    for seed in SEEDS:
        kwargs: dict[str, Any] = {
            "model": MODEL, "max_tokens": 200, "tools": tools,
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "messages": [{"role": "user", "content": QUESTION}],
            "extra_body": {"temperature": 1.0, "seed": seed},
        }  # fmt: skip
        whole = client.messages.create(**kwargs)
        with client.messages.stream(**kwargs) as stream:
            streamed = stream.get_final_message()
        uses = [(b.name, b.input) for b in whole.content if b.type == "tool_use"]
        assert uses == [(b.name, b.input) for b in streamed.content if b.type == "tool_use"]
        assert whole.stop_reason == streamed.stop_reason == "tool_use", (seed, whole.content)
        ((name, arguments),) = uses
        assert name == "forecast"
        jsonschema.validate(arguments, SCHEMA)

"""Anthropic's Messages API through the real `anthropic` SDK against a real server on the default
model: text, a tool_use -> tool_result round trip, streaming that reassembles to the unstreamed
message, count_tokens, stop reasons, structured output, Anthropic-shaped errors, x-api-key."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import pytest

MODEL = "SmolLM2-135M-Instruct"
GREEDY = {"temperature": 0}  # the 2026 SDK sends sampling parameters only as extra_body
TOOLS = [
    {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
]
QUESTION = "What is the weather in Paris? Answer in one short sentence."


@pytest.fixture(scope="module")
def server(shared_server: Any) -> Any:
    return shared_server("--enable-auto-tool-choice", "--tool-call-parser", "hermes")


@pytest.fixture
def client(server: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0)


def _blocks(message: Any) -> list[dict]:
    """The content without the ids a second request cannot repeat."""
    return [{k: v for k, v in b.model_dump().items() if k != "id"} for b in message.content]


def test_text(client: anthropic.Anthropic) -> None:
    r = client.messages.create(
        model=MODEL,
        max_tokens=64,
        system="You are a helpful assistant.",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        extra_body=GREEDY,
    )
    assert r.type == "message" and r.role == "assistant" and r.stop_reason == "end_turn"
    assert r.content[0].type == "text" and "Paris" in r.content[0].text
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 64


def test_tool_use_round_trip(client: anthropic.Anthropic) -> None:
    first = client.messages.create(
        model=MODEL,
        max_tokens=200,
        tools=TOOLS,
        tool_choice={"type": "any"},
        messages=[{"role": "user", "content": QUESTION}],
        extra_body=GREEDY,
    )
    assert first.stop_reason == "tool_use"
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and isinstance(call.input["city"], str)
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 C, sunny"}],
        },
    ]
    second = client.messages.create(
        model=MODEL, max_tokens=200, tools=TOOLS, messages=messages, extra_body=GREEDY
    )
    assert second.stop_reason in ("end_turn", "tool_use")
    assert second.content


@pytest.mark.parametrize("tool_choice", [None, {"type": "any"}])
def test_streaming_reassembles_to_the_unstreamed_message(
    client: anthropic.Anthropic, tool_choice: dict | None
) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 200,
        "messages": [{"role": "user", "content": QUESTION}],
        "extra_body": GREEDY,
    }
    if tool_choice is not None:
        kwargs |= {"tools": TOOLS, "tool_choice": tool_choice}
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        kinds = {event.type for event in stream}
        streamed = stream.get_final_message()
    assert {"message_start", "content_block_start", "content_block_stop", "message_stop"} <= kinds
    assert _blocks(streamed) == _blocks(whole)
    assert streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == whole.usage.output_tokens


def test_count_tokens_matches_the_prompt_of_a_create(client: anthropic.Anthropic) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    count = client.messages.count_tokens(model=MODEL, messages=messages, tools=TOOLS)
    made = client.messages.create(
        model=MODEL, max_tokens=1, messages=messages, tools=TOOLS, extra_body=GREEDY
    )
    assert count.input_tokens == made.usage.input_tokens > 0


def test_stop_reasons(client: anthropic.Anthropic) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    cut = client.messages.create(model=MODEL, max_tokens=2, messages=messages, extra_body=GREEDY)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2
    stopped = client.messages.create(
        model=MODEL, max_tokens=64, messages=messages, stop_sequences=["Paris"], extra_body=GREEDY
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "Paris"
    assert "Paris" not in stopped.content[0].text


def test_output_config_format_follows_the_schema(client: anthropic.Anthropic) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    r = client.messages.create(
        model=MODEL,
        max_tokens=200,
        messages=[{"role": "user", "content": "Describe Paris."}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body=GREEDY,
    )
    value = json.loads(r.content[0].text)
    assert set(value) == {"city", "population"} and r.stop_reason == "end_turn"


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        (
            {
                "max_tokens": 8,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "x", "content": "1"}],
                    }
                ],
            },
            "messages[0].content[0].tool_use_id",
        ),
        (
            {
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            "tools[0].type",
        ),
        (
            {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "container": "c"},
            "container",
        ),
    ],
)
def test_bad_requests_are_anthropic_errors_naming_the_field(
    client: anthropic.Anthropic, body: dict, named: str
) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        client.post("/v1/messages", cast_to=object, body={"model": MODEL, **body})
    error = e.value.body
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert named in error["error"]["message"]


def test_x_api_key(launch_server: Any) -> None:
    server = launch_server("--api-key", "sekret")
    messages = [{"role": "user", "content": "hi"}]
    good = anthropic.Anthropic(base_url=server.base_url, api_key="sekret", max_retries=0)
    assert good.messages.create(model=MODEL, max_tokens=2, messages=messages).content
    bad = anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=MODEL, max_tokens=2, messages=messages)
    assert e.value.body["error"]["type"] == "authentication_error"
    # The OpenAI routes take the same key as x-api-key too.
    r = httpx.get(f"{server.base_url}/v1/models", headers={"x-api-key": "sekret"}, timeout=30)
    assert r.status_code == 200

"""Anthropic Messages requests to chat messages, tools and tool_choice in OpenAI's shape."""

from __future__ import annotations

import json

import msgspec
import pytest

from frontend.anthropic.protocol import MessagesRequest
from frontend.common.decoding import decode_request
from frontend.common.errors import APIError


def decode(**fields) -> MessagesRequest:
    return decode_request(msgspec.json.encode({"max_tokens": 16, **fields}), MessagesRequest)


def test_blocks_become_chat_messages() -> None:
    req = decode(
        system=[{"type": "text", "text": "Be brief."}],
        messages=[
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": ""},
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [{"type": "text", "text": "18 C"}],
                    },
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ],
    )
    out = req.chat_messages()
    assert [m["role"] for m in out] == ["system", "user", "assistant", "tool", "user"]
    assert out[0]["content"] == "Be brief." and out[2]["content"] == "Let me look."
    call = out[2]["tool_calls"][0]
    assert call["id"] == "t1" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert out[3] == {"role": "tool", "tool_call_id": "t1", "content": "18 C"}


def test_tools_and_tool_choice() -> None:
    schema = {"type": "object", "properties": {}}
    req = decode(
        messages=[{"role": "user", "content": "x"}],
        tools=[{"name": "w", "description": "weather", "input_schema": schema}],
        tool_choice={"type": "tool", "name": "w", "disable_parallel_tool_use": True},
    )
    assert req.chat_tools() == [
        {
            "type": "function",
            "function": {"name": "w", "parameters": schema, "description": "weather"},
        }
    ]
    assert req.chat_tool_choice() == ({"type": "function", "function": {"name": "w"}}, False)
    assert decode(
        messages=[{"role": "user", "content": "x"}], tool_choice={"type": "any"}
    ).chat_tool_choice() == ("required", None)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            "messages[0].content[0].type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0].source",
        ),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": 1.5}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "top_k": -3}, "top_k"),
        (
            {"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "on"}},
            "thinking.type",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "output_config": {"effort": "high"}},
            "output_config.effort",
        ),
    ],
)
def test_what_is_not_served_is_a_400_naming_it(fields: dict, param: str) -> None:
    with pytest.raises(APIError) as e:
        decode(**fields).chat_messages()
    assert e.value.status == 400 and e.value.param == param

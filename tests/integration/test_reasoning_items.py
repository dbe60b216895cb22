"""Reasoning in the Responses and Messages APIs (--reasoning-parser deepseek_r1, which reads the
output as reasoning until </think>; the default model never closes it, so its whole answer is
reasoning): `reasoning` output items and `thinking` blocks, streamed exactly as unstreamed."""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "What is the capital of France?"


@pytest.fixture(scope="module")
def server(shared_server: Any) -> Any:
    return shared_server("--reasoning-parser", "deepseek_r1")


def test_responses_reasoning_items(server: Any) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
    kwargs = {"model": MODEL, "input": PROMPT, "temperature": 0, "max_output_tokens": 48}
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        kinds = {event.type for event in stream}
        streamed = stream.get_final_response()
    assert whole.output[0].type == "reasoning" and whole.output[0].content[0].text
    assert {"response.reasoning_text.delta", "response.reasoning_text.done"} <= kinds
    shape = [(o.type, o.content[0].text) for o in whole.output]
    assert [(o.type, o.content[0].text) for o in streamed.output] == shape


def test_messages_thinking_blocks(server: Any) -> None:
    client = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0)
    kwargs = {
        "model": MODEL,
        "max_tokens": 48,
        "messages": [{"role": "user", "content": PROMPT}],
        "thinking": {"type": "enabled", "budget_tokens": 16},
        "extra_body": {"temperature": 0},
    }
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    assert whole.content[0].type == "thinking" and whole.content[0].thinking
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in whole.content]

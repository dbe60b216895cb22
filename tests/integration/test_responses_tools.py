"""The Responses API with tools through the real `openai` SDK and the OpenAI Agents SDK, against a
real server on the default model: the function tool round trip (by resending the input and by
previous_response_id), streamed == unstreamed, tool_choice, text.format, stored responses, and
the 400s that name what is wrong."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the weather in Paris? Answer in one short sentence."
TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
]
GREEDY = {"model": MODEL, "temperature": 0, "max_output_tokens": 200}


pytestmark = pytest.mark.usefixtures("no_length_finish")


@pytest.fixture(scope="module")
def server(shared_server: Any) -> Any:
    return shared_server("--enable-auto-tool-choice", "--tool-call-parser", "hermes")


@pytest.fixture
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def _call(response: Any) -> Any:
    (call,) = [item for item in response.output if item.type == "function_call"]
    return call


def _shape(response: Any) -> list[tuple]:
    """The output without its random ids."""
    return [
        (o.type, getattr(o, "name", None), getattr(o, "arguments", None),
         o.content[0].text if o.type == "message" else None)
        for o in response.output
    ]  # fmt: skip


@pytest.mark.parametrize("by_previous_id", [False, True])
def test_function_tool_round_trip(client: openai.OpenAI, by_previous_id: bool) -> None:
    first = client.responses.create(input=QUESTION, tools=TOOLS, tool_choice="required", **GREEDY)
    assert first.status == "completed"
    call = _call(first)
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}
    if by_previous_id:
        second = client.responses.create(
            previous_response_id=first.id, input=[answer], tools=TOOLS, **GREEDY
        )
    else:
        turn = call.model_dump(exclude_none=True)
        history = [{"role": "user", "content": QUESTION}, turn, answer]
        second = client.responses.create(input=history, tools=TOOLS, **GREEDY)
    assert second.status == "completed" and second.output


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_streamed_equals_unstreamed(client: openai.OpenAI, tool_choice: Any) -> None:
    kwargs = {"input": QUESTION, "tools": TOOLS, "tool_choice": tool_choice, **GREEDY}
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert _shape(streamed) == _shape(whole) and _shape(whole)[0][0] == "function_call"
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert "response.function_call_arguments.delta" in kinds
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]


def test_text_streamed_equals_unstreamed(client: openai.OpenAI) -> None:
    kwargs = {"input": "What is the capital of France?", **GREEDY}
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        streamed = stream.get_final_response()
    assert _shape(streamed) == _shape(whole) and "Paris" in whole.output_text


def test_tool_choice_none_answers_in_text(client: openai.OpenAI) -> None:
    r = client.responses.create(input=QUESTION, tools=TOOLS, tool_choice="none", **GREEDY)
    assert [o.type for o in r.output] == ["message"] and r.tool_choice == "none"


def test_text_format_json_schema(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    r = client.responses.create(
        input="Describe Paris.",
        text={"format": {"type": "json_schema", "name": "city", "schema": schema}},
        **GREEDY,
    )
    assert set(json.loads(r.output_text)) == {"city", "population"}


def test_stored_responses(client: openai.OpenAI) -> None:
    r = client.responses.create(input="Hi", **GREEDY)
    assert client.responses.retrieve(r.id).output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unstored = client.responses.create(input="Hi", store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
            "input[0].call_id",
        ),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "previous_response_id": "resp_unknown"}, "previous_response_id"),
        ({"input": "x", "background": True}, "background"),
    ],
)
def test_bad_requests_name_the_field(client: openai.OpenAI, fields: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, **fields)
    assert e.value.body["param"] == param


@pytest.mark.parametrize("model_class", [OpenAIResponsesModel, OpenAIChatCompletionsModel])
def test_openai_agents_sdk_runs_a_function_tool(server: Any, model_class: type) -> None:
    set_tracing_disabled(True)
    called: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        called.append(city)
        return "18 C, sunny"

    async def run() -> Any:
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
        agent = Agent(
            name="weather",
            instructions="Answer in one short sentence.",
            tools=[get_weather],
            model=model_class(model=MODEL, openai_client=client),
            # The SDK resets tool_choice after the first call (reset_tool_choice), so the next
            # turn answers in text.
            model_settings=ModelSettings(tool_choice="required", max_tokens=200, temperature=0),
        )
        return await Runner.run(agent, "What is the weather in Paris?", max_turns=4)

    result = asyncio.run(run())
    assert called and isinstance(result.final_output, str) and result.final_output

"""The client libraries agents are built with, end to end against one real server on the default
model (its real chat template): the `openai` SDK, instructor, langchain-openai and pydantic-ai,
each making the calls its users make and sending what it really sends. Every call must return the
typed object or dispatch the tool, and no request may end by length (`max_tokens` <= 200): the
server's own length counter must not move during a test.

The OpenAI Agents SDK and the Responses API are in test_responses_tools.py, the `anthropic` SDK in
test_anthropic_messages.py. Prompts are plain ones a user would write; the 135M model is weak, so
the structure comes from the server's constraints, not from the model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx
import instructor
import openai
import pytest
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel
from pydantic_ai import Agent
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

MAX_TOKENS = 200


class City(BaseModel):
    name: str
    country: str


class CityFacts(BaseModel):
    name: str
    population: int
    area_km2: float


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


pytestmark = pytest.mark.usefixtures("no_length_finish")


@pytest.fixture(scope="module")
def server(shared_server: Any) -> Any:
    return shared_server("--enable-auto-tool-choice", "--tool-call-parser", "hermes")


@pytest.fixture(scope="module")
def model_name(server: Any) -> str:
    return httpx.get(f"{server.base_url}/v1/models", timeout=30).json()["data"][0]["id"]


@pytest.fixture
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


# --------------------------------------------------------------------------- openai


def test_openai_parse_returns_the_typed_object(client: openai.OpenAI, model_name: str) -> None:
    r = client.chat.completions.parse(
        model=model_name,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=CityFacts,
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(r.choices[0].message.parsed, CityFacts)


@pytest.mark.parametrize("stream", [False, True])
def test_openai_tool_round_trip_with_exclude_none_history(
    client: openai.OpenAI, model_name: str, stream: bool
) -> None:
    messages: list[Any] = [
        {"role": "user", "content": "What is the weather in Paris? Answer in one short sentence."}
    ]
    kwargs = {"model": model_name, "tools": [WEATHER_TOOL], "max_tokens": MAX_TOKENS}
    if stream:
        with client.chat.completions.stream(
            messages=messages, tool_choice="required", temperature=0, **kwargs
        ) as s:
            first = s.get_final_completion()
    else:
        first = client.chat.completions.create(
            messages=messages, tool_choice="required", temperature=0, **kwargs
        )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    # What agent loops send back: the assistant turn without `content`, then the tool's answer.
    turn = choice.message.model_dump(exclude_none=True)
    if stream:  # the stream's first chunk carries content "" (as vLLM's): drop it as null
        assert turn.pop("content") == ""
    assert "content" not in turn
    messages += [turn, {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    second = client.chat.completions.create(messages=messages, temperature=0, **kwargs)
    assert second.choices[0].finish_reason in ("stop", "tool_calls")
    null_content = {**turn, "content": None}
    messages[1] = null_content
    third = client.chat.completions.create(messages=messages, temperature=0, **kwargs)
    assert third.choices[0].message == second.choices[0].message


# --------------------------------------------------------------------------- instructor

# Modes whose output the server constrains (JSON_SCHEMA: response_format json_object + schema;
# TOOLS: a named tool call) and the two whose JSON only the prompt asks for (JSON: json_object
# without a schema; MD_JSON: nothing at all), with a prompt the default model answers in shape.
INSTRUCTOR_CASES = [
    ("JSON_SCHEMA", "Paris is a city in France."),
    ("TOOLS", "Paris is a city in France."),
    ("JSON", "Name a city and its country."),
    ("MD_JSON", "Name a city and its country in JSON."),
]


@pytest.mark.parametrize(("mode", "prompt"), INSTRUCTOR_CASES)
def test_instructor_modes(server: Any, model_name: str, mode: str, prompt: str) -> None:
    base = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
    client = instructor.from_openai(base, mode=getattr(instructor.Mode, mode))
    city = client.chat.completions.create(
        model=model_name,
        response_model=City,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        max_retries=0,
    )
    assert isinstance(city, City) and city.name


# --------------------------------------------------------------------------- langchain-openai


@pytest.fixture
def llm(server: Any, model_name: str) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=f"{server.base_url}/v1",
        api_key="none",
        model=model_name,
        max_tokens=MAX_TOKENS,
        temperature=0,
        max_retries=0,
    )


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_langchain_with_structured_output(llm: ChatOpenAI, method: str) -> None:
    structured = llm.with_structured_output(City, method=method)
    city = structured.invoke("Paris is a city in France. Answer in JSON with name and country.")
    assert isinstance(city, City) and city.name


@tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return "18 C, sunny"


@pytest.mark.parametrize("stream", [False, True])
def test_langchain_bind_tools(llm: ChatOpenAI, stream: bool) -> None:
    bound = llm.bind_tools([get_weather], tool_choice="required")
    if stream:
        message: Any = None
        for chunk in bound.stream("What is the weather in Paris?"):
            message = chunk if message is None else message + chunk
    else:
        message = bound.invoke("What is the weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    assert get_weather.invoke(call["args"]) == "18 C, sunny"


# --------------------------------------------------------------------------- pydantic-ai


@pytest.fixture
def pydantic_model(server: Any, model_name: str) -> OpenAIChatModel:
    provider = OpenAIProvider(base_url=f"{server.base_url}/v1", api_key="none")
    return OpenAIChatModel(model_name, provider=provider)


def test_pydantic_ai_typed_output(pydantic_model: OpenAIChatModel) -> None:
    agent = Agent(
        pydantic_model,
        output_type=CityFacts,
        model_settings={"max_tokens": MAX_TOKENS, "temperature": 0},
    )
    assert isinstance(agent.run_sync("Describe Paris.").output, CityFacts)


@dataclass
class _ToolFirst(AbstractCapability):
    """Forces the first step to call `tool` (pydantic-ai's per-step tool_choice), as an agent
    that must look something up does; later steps choose freely."""

    tool: str

    def get_model_settings(self) -> Any:
        return lambda ctx: {"tool_choice": [self.tool]} if ctx.run_step == 1 else {}


def test_pydantic_ai_tool_round_trip(pydantic_model: OpenAIChatModel) -> None:
    called: list[str] = []
    agent = Agent(
        pydantic_model,
        model_settings={"max_tokens": MAX_TOKENS, "temperature": 0},
        capabilities=[_ToolFirst("get_forecast")],
    )

    @agent.tool_plain
    def get_forecast(city: str) -> str:
        """The weather forecast for a city."""
        called.append(city)
        return "sunny, 18 C"

    result = agent.run_sync("What is the weather in Paris?")
    assert called and isinstance(result.output, str) and result.output
    kinds = [type(part).__name__ for m in result.all_messages() for part in m.parts]
    assert kinds[:3] == ["UserPromptPart", "ToolCallPart", "ToolReturnPart"]

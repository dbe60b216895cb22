"""Structured output, tool calling and reasoning through `tern launch` on tiny random-weight models.

Their output is noise, so only the grammar makes it valid: every sampled answer (temperature 1)
must validate against its JSON schema, full-match its regex, be one of its choices, or be a tool
call whose arguments validate. The same holds with n = 4, at --tp 2 --pp 2 with a KV cache small
enough to preempt, and with prefix caching. Streamed tool calls and reasoning reassemble to the
unstreamed message; bad constraints are 400s naming the problem.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.timeout(900)

MODEL = "tiny"
MAX_TOKENS = 400  # a random model pads with whitespace (17 characters per gap at most)

# ChatML as Qwen2.5 / SmolLM2 render tools (hermes), with Qwen3's enable_thinking switch.
TEMPLATE = """{%- if tools %}<|im_start|>system
You may call functions. <tools>
{%- for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>
Reply with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% elif m.tool_calls %}<|im_start|>assistant
{% for c in m.tool_calls %}<tool_call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined %}{% if enable_thinking %}<think>
{% else %}<think>

</think>

{% endif %}{% endif %}{% endif %}"""

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "user", "guest"]},
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 6},
            "minItems": 1,
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {
                "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
                "city": {"enum": ["Paris", "Lyon"]},
            },
            "required": ["zip", "city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "code", "tags", "address"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,8}@[a-z]{2,6}\.(com|org|net)"
CHOICES = ["positive", "negative", "neutral"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": -100, "maximum": 100},
                    "b": {"type": "integer", "minimum": -100, "maximum": 100},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def model_dir(tiny_llama_with_tokenizer: Path) -> Path:
    return tiny_llama_with_tokenizer


def _launch(module_server: Any, model_dir: Path, *extra: str) -> Any:
    return module_server(
        "--model", str(model_dir), "--dtype", "float32", "--served-model-name", MODEL,
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser",
        "qwen3", "--chat-template", TEMPLATE, *extra,
    )  # fmt: skip


@pytest.fixture(scope="module")
def server(shared_server: Any, model_dir: Path) -> Any:
    return _launch(shared_server, model_dir, "--max-model-len", "1024")


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=300)


def _messages(i: int) -> list[dict[str, Any]]:
    return [
        {"role": "developer", "content": "Answer in JSON."},
        {"role": "user", "content": [{"type": "text", "text": f"Person number {i}?"}]},
    ]


def _json_answers(client: openai.OpenAI, requests: int, n: int) -> list[tuple[str, str]]:
    """(finish_reason, content) of `requests` x n samples under PERSON, sent concurrently."""

    def one(i: int) -> list[tuple[str, str]]:
        r = client.chat.completions.create(
            model=MODEL, messages=_messages(i), n=n, temperature=1.0, seed=i,
            max_tokens=MAX_TOKENS,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON, "strict": True},
            },
        )  # fmt: skip
        return [(c.finish_reason, c.message.content) for c in r.choices]

    with ThreadPoolExecutor(8) as pool:
        return [a for answers in pool.map(one, range(requests)) for a in answers]


def _check_json_answers(answers: list[tuple[str, str]]) -> None:
    for finish, content in answers:
        assert finish == "stop", (finish, content)
        jsonschema.validate(json.loads(content), PERSON)


def test_json_schema_answers_validate(client: openai.OpenAI) -> None:
    answers = _json_answers(client, 13, 4)  # 52 samples, n = 4
    assert len(answers) == 52
    _check_json_answers(answers)
    assert len({c for _, c in answers}) > 40, "temperature 1 gives varied answers"


def test_regex_and_choice_answers_match(client: openai.OpenAI) -> None:
    def regex(i: int) -> list[str]:
        r = client.completions.create(
            model=MODEL, prompt=f"mail {i}", n=10, temperature=1.0, seed=i, max_tokens=64,
            extra_body={"structured_outputs": {"regex": REGEX}},
        )  # fmt: skip
        assert all(c.finish_reason == "stop" for c in r.choices)
        return [c.text for c in r.choices]

    def choice(i: int) -> list[str]:
        r = client.chat.completions.create(
            model=MODEL, messages=_messages(i), n=10, temperature=1.0, seed=i, max_tokens=16,
            extra_body={"guided_choice": CHOICES},
        )  # fmt: skip
        return [c.message.content for c in r.choices]

    with ThreadPoolExecutor(5) as pool:
        mails = [t for ts in pool.map(regex, range(5)) for t in ts]
        picks = [t for ts in pool.map(choice, range(5)) for t in ts]
    assert len(mails) == 50 and all(re.fullmatch(REGEX, m) for m in mails), mails
    assert len(picks) == 50 and set(picks) <= set(CHOICES), picks


def test_every_sampling_parameter_logprobs_length_and_abort(
    client: openai.OpenAI, server: Any
) -> None:
    """The mask composes with top-k / top-p / min-p, penalties, logit bias and logprobs (taken from
    the raw logits); max_tokens first ends with "length"; a client that leaves mid-stream frees its
    request, and the next constrained one is served."""
    body: dict[str, Any] = {
        "model": MODEL, "messages": _messages(5), "temperature": 0.9, "top_p": 0.9, "seed": 5,
        "max_tokens": MAX_TOKENS, "frequency_penalty": 0.5, "presence_penalty": 0.3,
        "logprobs": True, "top_logprobs": 2, "logit_bias": {"90": 5},
        "extra_body": {"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1,
                       "structured_outputs": {"regex": REGEX}},
    }  # fmt: skip
    choice = client.chat.completions.create(**body).choices[0]
    assert re.fullmatch(REGEX, choice.message.content), choice.message.content
    tokens = choice.logprobs.content
    assert "".join(t.token for t in tokens[:-1]) == choice.message.content  # then EOS
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in tokens)
    short = client.chat.completions.create(
        model=MODEL, messages=_messages(5), max_tokens=5, temperature=1.0, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    ).choices[0]  # fmt: skip
    assert short.finish_reason == "length" and short.message.content.startswith("{")
    stream = client.chat.completions.create(
        model=MODEL, messages=_messages(6), max_tokens=MAX_TOKENS, temperature=1.0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    stats: dict[str, Any] = {}
    for _ in range(200):  # bounded: the abort reaches the engine within a step or two
        stats = httpx.get(f"{server.base_url}/server_info", timeout=30).json()["scheduler_stats"]
        if stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0:
            break
        time.sleep(0.1)
    assert stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0, stats
    _check_json_answers(_json_answers(client, 1, 1))


def test_structural_tag_and_json_object(client: openai.OpenAI) -> None:
    """A structural tag constrains what follows its trigger (xgrammar's two formats compile);
    json_object gives any JSON object."""
    tag = {
        "type": "structural_tag",
        "structures": [{"begin": "<f=add>", "schema": SCHEMAS["add"], "end": "</f>"}],
        "triggers": ["<f="],
    }
    r = client.chat.completions.create(
        model=MODEL, messages=_messages(3), max_tokens=16, temperature=1.0, seed=3,
        extra_body={"structured_outputs": {"structural_tag": json.dumps(tag)}},
    )  # fmt: skip
    assert r.choices[0].finish_reason in ("stop", "length")
    r = client.chat.completions.create(
        model=MODEL, messages=_messages(3), max_tokens=MAX_TOKENS, temperature=1.0, seed=4, n=4,
        response_format={"type": "json_object"},
    )  # fmt: skip
    for c in r.choices:
        if c.finish_reason == "stop":  # an open-ended object may run to max_tokens
            assert isinstance(json.loads(c.message.content), dict)


def _check_calls(calls: list[Any], max_calls: int | None = None) -> None:
    assert calls, "a required tool choice always calls"
    assert max_calls is None or len(calls) <= max_calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_tool_calls_parse_and_validate(client: openai.OpenAI) -> None:
    def one(i: int) -> list[Any]:
        r = client.chat.completions.create(
            model=MODEL, messages=_messages(i), n=5, temperature=1.0, seed=i,
            max_tokens=MAX_TOKENS, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=i % 2 == 0,
        )  # fmt: skip
        for c in r.choices:
            # NOTE: noise never stops adding parallel calls: those end at max_tokens, with the
            # complete calls parsed and the cut one dropped.
            allowed = ("tool_calls", "length") if i % 2 == 0 else ("tool_calls",)
            assert c.finish_reason in allowed and c.message.content is None
            _check_calls(c.message.tool_calls, None if i % 2 == 0 else 1)
        return r.choices

    with ThreadPoolExecutor(5) as pool:
        assert sum(len(c) for c in pool.map(one, range(10))) == 50


def test_named_tool_choice_and_round_trip(client: openai.OpenAI) -> None:
    history: list[dict[str, Any]] = [{"role": "user", "content": "What is 2 + 3?"}]
    first = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, temperature=1.0, seed=7,
        max_tokens=MAX_TOKENS, tool_choice={"type": "function", "function": {"name": "add"}},
    )  # fmt: skip
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    [call] = message.tool_calls
    assert call.function.name == "add"
    _check_calls([call])
    # The call and the tool's result go back; the model answers (tools off).
    history += [
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "5"},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="none", temperature=0,
        max_tokens=8, extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert second.choices[0].message.tool_calls in (None, [])
    assert isinstance(second.choices[0].message.content, str)
    # The template rendered the call and its result into the prompt.
    prompt = (
        client.completions.create(
            model=MODEL, prompt=second.model_extra["prompt_token_ids"], max_tokens=1, echo=True
        )
        .choices[0]
        .text
    )
    assert '<tool_call>{"name": "add"' in prompt and "<tool_response>5</tool_response>" in prompt


def test_openai_parse_returns_pydantic_object(client: openai.OpenAI) -> None:
    class City(BaseModel):
        name: str = Field(max_length=10)
        population: int = Field(ge=0, le=10_000)
        kind: Literal["town", "city"]

    r = client.chat.completions.parse(
        model=MODEL, messages=_messages(0), response_format=City, temperature=1.0, seed=3,
        max_tokens=MAX_TOKENS,
    )  # fmt: skip
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, City) and parsed.kind in ("town", "city")


def _stream_message(client: openai.OpenAI, **body: Any) -> dict[str, Any]:
    """A streamed choice reassembled: content, reasoning, tool calls (by index), finish."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **body):
        for choice in chunk.choices:
            d = choice.delta
            assert "<tool_call>" not in (d.content or ""), "markup never leaks into content"
            content += d.content or ""
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            for tc in d.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id and tc.function.name and tc.type == "function", tc
                    calls[tc.index] = [tc.function.name, ""]
                else:
                    assert tc.id is None and tc.function.name is None, "header once"
                calls[tc.index][1] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    assert sorted(calls) == list(range(len(calls)))
    return {
        "content": content or None,
        "reasoning": reasoning or None,
        "calls": [tuple(calls[i]) for i in sorted(calls)],
        "finish": finish,
    }


def _whole_message(client: openai.OpenAI, **body: Any) -> dict[str, Any]:
    choice = client.chat.completions.create(model=MODEL, **body).choices[0]
    m = choice.message
    return {
        "content": m.content,
        "reasoning": (m.model_extra or {}).get("reasoning_content"),
        "calls": [(c.function.name, c.function.arguments) for c in m.tool_calls or []],
        "finish": choice.finish_reason,
    }


@pytest.mark.parametrize(
    "body",
    [
        {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        # auto: the hermes parser reads the model's text (noise: mostly content).
        {"tools": TOOLS, "tool_choice": "auto", "max_tokens": 40},
        {"extra_body": {"chat_template_kwargs": {"enable_thinking": True}}, "max_tokens": 40},
    ],
    ids=["required", "named", "auto", "reasoning"],
)
def test_streamed_equals_unstreamed(client: openai.OpenAI, body: dict[str, Any]) -> None:
    body = {"messages": _messages(1), "temperature": 1.0, "seed": 11, "max_tokens": MAX_TOKENS,
            **body}  # fmt: skip
    streamed, whole = _stream_message(client, **body), _whole_message(client, **body)
    assert streamed == whole
    if "tool_choice" in body and body["tool_choice"] != "auto":
        assert whole["calls"] and whole["finish"] == "tool_calls"


def test_reasoning_goes_to_reasoning_content_and_constraint_follows_it(
    client: openai.OpenAI,
) -> None:
    thinking = {"chat_template_kwargs": {"enable_thinking": True}}
    r = client.chat.completions.create(
        model=MODEL, messages=_messages(2), max_tokens=12, temperature=0, extra_body=thinking
    )
    m = r.choices[0].message
    assert m.model_extra["reasoning_content"] and m.model_extra["reasoning"]
    hidden = client.chat.completions.create(
        model=MODEL, messages=_messages(2), max_tokens=12, temperature=0,
        extra_body={**thinking, "include_reasoning": False},
    ).choices[0].message  # fmt: skip
    assert hidden.model_extra.get("reasoning_content") is None
    assert (hidden.content or "") == (m.content or "")
    # Thinking off: the template closes the think block, so the constraint holds from the start.
    off = client.chat.completions.create(
        model=MODEL, messages=_messages(2), max_tokens=MAX_TOKENS, temperature=1.0, seed=2,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    ).choices[0]  # fmt: skip
    assert off.message.model_extra.get("reasoning_content") is None
    _check_json_answers([(off.finish_reason, off.message.content)])


def test_responses_and_generate_constraints(server: Any) -> None:
    r = httpx.post(
        f"{server.base_url}/v1/responses",
        json={
            "model": MODEL, "input": "a person", "max_output_tokens": MAX_TOKENS,
            "temperature": 1.0, "seed": 5,
            "text": {"format": {"type": "json_schema", "name": "p", "schema": PERSON}},
        },
        timeout=300,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["text"]["format"]["type"] == "json_schema"
    jsonschema.validate(json.loads(body["output"][0]["content"][0]["text"]), PERSON)
    r = httpx.post(
        f"{server.base_url}/generate",
        json={
            "prompt": "mail:", "max_tokens": 64, "temperature": 1.0,
            "response_format": {"type": "regex_schema", "regex_schema": REGEX},
        },
        timeout=300,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    assert re.fullmatch(REGEX, r.json()["text"]), r.json()


@pytest.mark.parametrize(
    ("path", "field", "value", "param", "says"),
    [
        (
            "/v1/chat/completions", "response_format",
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}},
            "response_format.json_schema.schema", "objekt",
        ),
        ("/v1/completions", "structured_outputs", {"regex": "a(b"}, "structured_outputs.regex",
         "parenthesis"),
        ("/v1/chat/completions", "structured_outputs", {"grammar": "root ::= nothing"},
         "structured_outputs.grammar", "nothing"),
        ("/v1/chat/completions", "guided_regex", "[z-a]", "guided_regex", "regex"),
        ("/v1/chat/completions", "tool_choice",
         {"type": "function", "function": {"name": "nope"}}, "tool_choice", "nope"),
        ("/v1/completions", "tools", TOOLS, "tools", "tools"),
        ("/v1/chat/completions", "structured_outputs", {"choice": ["a"], "regex": "b"},
         "structured_outputs", "exactly one"),
    ],
)  # fmt: skip
def test_bad_constraints_are_400_with_the_reason(
    server: Any, path: str, field: str, value: Any, param: str, says: str
) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 4, field: value}
    if path == "/v1/completions":
        body["prompt"] = "x"
    else:
        body["messages"] = [{"role": "user", "content": "x"}]
        if field == "tool_choice":
            body["tools"] = TOOLS
    r = httpx.post(f"{server.base_url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_parallel_tp_pp_preemption_and_prefix_caching(module_server: Any, model_dir: Path) -> None:
    """--tp 2 --pp 2 (the last stage's first rank samples), a 40-block KV cache (8 requests of ~300
    tokens preempt each other), prefix caching on (the n = 4 samples share their prompt's
    blocks), prompts prefilled in chunks of 64 tokens: every answer still validates, and so does
    every required tool call."""
    server = _launch(
        module_server, model_dir, "--tp", "2", "--pp", "2", "--num-gpu-blocks-override", "40",
        "--max-model-len", "600", "--max-num-seqs", "16", "--max-num-batched-tokens", "64",
    )  # fmt: skip
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0,
                           timeout=600)  # fmt: skip
    _check_json_answers(_json_answers(client, 4, 4))
    r = client.chat.completions.create(
        model=MODEL, messages=_messages(9), n=4, temperature=1.0, seed=9, max_tokens=300,
        tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
    )  # fmt: skip
    for choice in r.choices:
        _check_calls(choice.message.tool_calls, 1)
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    preempted = [line for line in metrics.splitlines() if line.startswith("tern:num_preemptions")]
    assert preempted and float(preempted[0].split()[-1]) > 0, preempted
    hits = [line for line in metrics.splitlines() if line.startswith("tern:prefix_cache_hits")]
    assert hits and float(hits[0].split()[-1]) > 0, hits

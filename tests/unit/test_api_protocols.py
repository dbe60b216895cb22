"""Request validation of /v1/responses, /generate, /abort_request and /tokenize: what is accepted,
what is a 400 naming the field; Responses input -> chat messages; request-id bookkeeping."""

from __future__ import annotations

import json
from typing import Any

import pytest

from frontend.common.decoding import decode_request
from frontend.common.errors import APIError
from frontend.lmdeploy.protocol import AbortRequest, GenerateRequest
from frontend.openai.responses_protocol import ResponsesRequest
from frontend.openai.tokenize import TokenizeChatRequest
from frontend.serving.generation import InflightRequests, unique_ids

# LMDeploy's /generate request example from its OpenAPI page (../shared/seeds), verbatim.
LMDEPLOY_GENERATE_EXAMPLE: dict[str, Any] = {
    "ignore_eos": True,
    "image_data": "string",
    "include_stop_str_in_output": True,
    "input_ids": [1],
    "max_tokens": 1,
    "min_p": 1.0,
    "mm_processor_kwargs": {},
    "prompt": "string",
    "repetition_penalty": 1.0,
    "return_logprob": True,
    "return_routed_experts": True,
    "session_id": 1,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "stop": "string",
    "stop_token_ids": [1],
    "stream": True,
    "temperature": 1.0,
    "top_k": 1,
    "top_p": 1.0,
}
# What of it these tests' text-only servers cannot honour: images (image_data is served for image
# models: tests/integration/test_generate_images.py) and MoE routing (return_logprob is served);
# and LMDeploy itself refuses a request with both prompt and input_ids.
NOT_YET = {"image_data": None, "return_routed_experts": False}


def decode(typ: type, **fields: Any) -> Any:
    return decode_request(json.dumps(fields).encode(), typ)


def rejects(typ: type, param: str, **fields: Any) -> APIError:
    with pytest.raises(APIError) as info:
        decode(typ, **fields)
    assert info.value.status == 400 and info.value.param == param, info.value.message
    return info.value


# --------------------------------------------------------------------------- /v1/responses


def test_responses_input_forms_become_chat_messages() -> None:
    req = decode(ResponsesRequest, input="hi", instructions="be brief")
    assert req.messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    req = decode(
        ResponsesRequest,
        input=[
            {"role": "developer", "content": "rules"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
            {"role": "user", "content": "c"},
        ],
    )
    assert [(m["role"], m["content"]) for m in req.messages()] == [
        ("system", "rules"),
        ("user", "a"),
        ("assistant", "b"),
        ("user", "c"),
    ]
    sampling = req.to_sampling()
    assert sampling.max_tokens is None and sampling.param("max_tokens") == "max_output_tokens"


@pytest.mark.parametrize(
    ("item", "param"),
    [
        ({"type": "function_call_output", "call_id": "x", "output": "1"}, "input[0].call_id"),
        (
            {"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]},
            "input[0].content[0]",
        ),
        ({"role": "wizard", "content": "hi"}, "input[0].role"),
        ({"role": "user", "content": 5}, "input[0].content"),
        ({"type": "web_search_call", "id": "w"}, "input[0].type"),
    ],
)
def test_responses_input_the_api_cannot_serve_is_400(item: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as info:
        decode(ResponsesRequest, input=[item]).messages()
    assert info.value.status == 400 and info.value.param == param


def test_responses_tool_round_trip_items_become_chat_turns() -> None:
    req = decode(
        ResponsesRequest,
        input=[
            {"role": "user", "content": "weather?"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"c": 1}'},
            {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "c2", "output": "rain"},
        ],
    )
    out = req.messages()
    assert [m["role"] for m in out] == ["user", "assistant", "tool", "tool"]
    assert [c["id"] for c in out[1]["tool_calls"]] == ["c1", "c2"] and out[1]["content"] == ""
    assert out[2] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("background", True),
        ("reasoning", {"effort": "low"}),
        ("top_logprobs", 2),
        ("include", ["message.output_text.logprobs"]),
        ("truncation", "auto"),
        ("conversation", "conv_1"),
        ("repetition_penalty", 1.1),
    ],
)
def test_responses_unsupported_fields_are_400(field: str, value: Any) -> None:
    err = rejects(ResponsesRequest, field, input="x", **{field: value})
    assert "not supported" in err.message


def test_responses_neutral_values_pass() -> None:
    decode(
        ResponsesRequest,
        input="x",
        tools=[],
        tool_choice="auto",
        store=False,
        text={"format": {"type": "text"}},
        truncation="disabled",
        top_logprobs=0,
        metadata={"k": "v"},
        user="u",
    )
    rejects(ResponsesRequest, "max_output_tokens", input="x", max_output_tokens=0)
    rejects(ResponsesRequest, "frobnicate", input="x", frobnicate=1)


# --------------------------------------------------------------------------- /generate, /abort


def test_lmdeploy_example_names_what_is_not_supported_yet() -> None:
    with pytest.raises(APIError) as info:
        decode(GenerateRequest, **LMDEPLOY_GENERATE_EXAMPLE)
    assert info.value.status == 400 and info.value.param in NOT_YET
    # Without those, and with one of prompt / input_ids, it is valid as it stands.
    for drop in ("prompt", "input_ids"):
        body = {**LMDEPLOY_GENERATE_EXAMPLE, **NOT_YET}
        del body[drop]
        req = decode(GenerateRequest, **body)
        assert req.stream and req.to_sampling().stop == ["string"] and req.max_tokens == 1
        assert req.return_logprob and req.repetition_penalty == 1.0


def test_generate_needs_exactly_one_of_prompt_and_input_ids() -> None:
    rejects(GenerateRequest, "prompt", prompt="a", input_ids=[1])
    rejects(GenerateRequest, "prompt")
    rejects(GenerateRequest, "input_ids", input_ids=[])
    rejects(GenerateRequest, "top_logprobs_num", prompt="a", top_logprobs_num=2)
    rejects(GenerateRequest, "repetition_penalty", prompt="a", repetition_penalty=0.0)
    assert decode(GenerateRequest, prompt="a", repetition_penalty=1.3).repetition_penalty == 1.3
    rejects(GenerateRequest, "top_k", prompt="a", top_k=-1)
    req = decode(GenerateRequest, prompt="a")
    assert req.session_id == -1 and req.max_tokens == 128 and req.temperature == 1.0


def test_abort_request_forms() -> None:
    assert decode(AbortRequest, abort_all=True).abort_all
    assert decode(AbortRequest, session_id=3).session_id == 3
    assert decode(AbortRequest, rid="cmpl-1").target_request_id == "cmpl-1"
    rejects(AbortRequest, "session_id")
    rejects(AbortRequest, "rid", request_id="a", rid="b")
    req = decode(AbortRequest, session_id=1, abort_message="bye", finished_reason={"x": 1})
    assert req.finish_info() == {"type": "abort", "message": "bye", "x": 1}


def test_tokenize_chat_checks() -> None:
    rejects(
        TokenizeChatRequest,
        "continue_final_message",
        messages=[{"role": "user", "content": "x"}],
        continue_final_message=True,
    )
    rejects(TokenizeChatRequest, "tools", messages=[], tools=[{"type": "function"}])


# --------------------------------------------------------------------------- request ids


def test_unique_engine_ids() -> None:
    taken = {"cmpl-x", "cmpl-y-1"}
    assert unique_ids("cmpl-x", 1, taken.__contains__) == ["cmpl-x.1"]
    assert unique_ids("cmpl-y", 2, taken.__contains__) == ["cmpl-y-0", "cmpl-y-1.1"]
    assert unique_ids("cmpl-z", 1, taken.__contains__) == ["cmpl-z"]


class _Group:
    def __init__(self, keys: list[str], session_id: int | None = None) -> None:
        self.keys, self.session_id = keys, session_id


def test_inflight_registry_finds_by_every_key() -> None:
    reg = InflightRequests()
    a, b = _Group(["cmpl-a", "a"]), _Group(["generate-b"], session_id=7)
    reg.add(a)  # type: ignore[arg-type]
    reg.add(b)  # type: ignore[arg-type]
    assert reg.find("a") == [a] and reg.find("cmpl-a") == [a] and reg.find_session(7) is b
    assert {id(g) for g in reg.all()} == {id(a), id(b)}
    reg.remove(a)  # type: ignore[arg-type]
    reg.remove(b)  # type: ignore[arg-type]
    assert reg.find("a") == [] and reg.find_session(7) is None and reg.all() == []

"""The field policy for request bodies (frontend/openai/peer_fields.py): routers' and SGLang
clients' fields are honoured under tern's names or accepted at their neutral values; anything else
is a 400 naming the field."""

from __future__ import annotations

import json

import pytest

from frontend.common.decoding import decode_request
from frontend.common.errors import APIError
from frontend.openai.protocol import ChatCompletionRequest, CompletionRequest

MESSAGES = [{"role": "user", "content": "hello"}]

# The bodies vllm-router 0.1.17 and sglang-router 0.3.2 forward (captured from the binaries).
VLLM_ROUTER_CHAT = {
    "model": "m", "messages": MESSAGES, "stream": False, "max_tokens": 4, "logprobs": False,
    "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
    "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
    "return_hidden_states": False, "include_reasoning": True,
}  # fmt: skip
ROUTER_COMPLETION = {
    "model": "m", "prompt": "hello", "max_tokens": 4, "stream": False, "echo": False,
    "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
    "return_hidden_states": False,
}  # fmt: skip


def chat(**fields: object) -> ChatCompletionRequest:
    return decode_request(
        json.dumps({"messages": MESSAGES, **fields}).encode(), ChatCompletionRequest
    )


def completion(**fields: object) -> CompletionRequest:
    return decode_request(json.dumps({"prompt": "hi", **fields}).encode(), CompletionRequest)


def rejects(param: str, fn, **fields: object) -> APIError:
    with pytest.raises(APIError) as e:
        fn(**fields)
    assert e.value.status == 400 and e.value.param == param, e.value
    return e.value


def test_router_bodies_are_accepted_with_no_effect() -> None:
    req = decode_request(json.dumps(VLLM_ROUTER_CHAT).encode(), ChatCompletionRequest)
    assert req.include_stop_str_in_output is False and req.seed is None
    assert req.structured_outputs is None
    req = decode_request(json.dumps(ROUTER_COMPLETION).encode(), CompletionRequest)
    assert req.include_stop_str_in_output is False


def test_no_stop_trim_is_include_stop_str_in_output() -> None:
    assert chat(no_stop_trim=True).include_stop_str_in_output is True
    assert completion(no_stop_trim=True).include_stop_str_in_output is True
    # SGLang's default asks for nothing: tern's own field stands.
    assert chat(no_stop_trim=False, include_stop_str_in_output=True).include_stop_str_in_output


def test_honoured_aliases() -> None:
    assert completion(sampling_seed=7).seed == 7
    assert completion(sampling_seed=7, seed=7).seed == 7
    rejects("sampling_seed", completion, sampling_seed=7, seed=8)
    assert completion(rid="abc").request_id == "abc"
    rejects("rid", completion, rid="a", request_id="b")
    assert completion(regex="[a-z]+").structured_outputs == {"regex": "[a-z]+"}
    assert chat(ebnf='root ::= "a"').structured_outputs == {"grammar": 'root ::= "a"'}
    schema = {"type": "object"}
    assert completion(json_schema=json.dumps(schema)).structured_outputs == {"json": schema}
    rejects("json_schema", completion, json_schema="{not json")


def test_two_constraints_are_a_400() -> None:
    rejects("regex", completion, regex="a", ebnf="b")
    rejects("regex", completion, regex="a", structured_outputs={"regex": "b"})
    rejects("regex", chat, regex="a", response_format={"type": "json_object"})


@pytest.mark.parametrize(
    "field,value",
    [
        ("separate_reasoning", False),
        ("stream_reasoning", False),
        ("return_hidden_states", True),
        ("return_hidden_states", 0),  # not False: type-checked
        ("session_params", {"id": "s"}),
    ],
)
def test_effects_tern_cannot_deliver_are_a_400(field: str, value: object) -> None:
    err = rejects(field, chat, **{field: value})
    assert "not supported" in str(err)


def test_unknown_fields_stay_a_400() -> None:
    rejects("no_such_field", completion, no_such_field=1)

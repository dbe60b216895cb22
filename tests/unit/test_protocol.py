"""Request validation of the OpenAI endpoints: what is accepted, and the 400s (with `param`) for the
rest. Also the request -> SamplingParams mapping (context-length checks, defaults)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from frontend.common.decoding import decode_request, normalize_messages
from frontend.common.errors import APIError
from frontend.openai.protocol import ChatCompletionRequest, CompletionRequest
from frontend.serving.base import OpenAIServing
from frontend.serving.sampling import for_sample, truncate_prompt

USER = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> ChatCompletionRequest:
    return decode_request(json.dumps({"messages": USER, **fields}).encode(), ChatCompletionRequest)


def completion(**fields: Any) -> CompletionRequest:
    return decode_request(json.dumps({"prompt": "hi", **fields}).encode(), CompletionRequest)


def rejects(fn: Any, param: str | None, **fields: Any) -> APIError:
    with pytest.raises(APIError) as info:
        fn(**fields)
    assert info.value.status == 400
    assert info.value.param == param, info.value.message
    return info.value


def test_minimal_and_full_chat_requests_are_accepted() -> None:
    req = chat()
    assert req.model is None and not req.stream and req.to_sampling().max_tokens is None
    req = chat(
        model="m",
        max_tokens=5,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=7,
        stop=["a", "b"],
        stop_token_ids=[3],
        ignore_eos=True,
        stream=True,
        stream_options={"include_usage": True},
        n=1,
        user="u",
        add_generation_prompt=False,
        chat_template_kwargs={"enable_thinking": False},
    )
    assert req.to_sampling().stop == ["a", "b"] and req.stream and req.to_sampling().max_tokens == 5
    assert req.stream_options is not None and req.stream_options.include_usage


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert chat(max_tokens=5, max_completion_tokens=9).to_sampling().max_tokens == 9
    rejects(chat, "max_completion_tokens", max_completion_tokens=0)


def test_stop_may_be_a_string() -> None:
    assert completion(stop="\n").to_sampling().stop == ["\n"]
    assert completion().to_sampling().stop == []


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{", None),
        (b"not json", None),
        (b"[]", None),
        (b'{"messages": "hi"}', "messages"),
        (b'{"model": "m"}', "messages"),
        (b'{"messages": [], "temperature": "hot"}', "temperature"),
        (b'{"messages": [], "max_tokens": 1.5}', "max_tokens"),
        (b'{"messages": [], "stream": "yes"}', "stream"),
        (b'{"messages": [], "stop": 3}', "stop"),
        (b'{"messages": [], "no_such_field": 1}', "no_such_field"),
        (b'{"messages": [], "stream": true, "stream_options": {"x": 1}}', "stream_options"),
    ],
)
def test_malformed_or_mistyped_bodies_are_400(body: bytes, param: str | None) -> None:
    with pytest.raises(APIError) as info:
        decode_request(body, ChatCompletionRequest)
    assert info.value.status == 400
    assert info.value.param == param, info.value.message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", -1),
        ("max_tokens", 0),
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.5),
        ("seed", 2**63),
        ("stop", ["ok", ""]),
        ("n", 0),
        ("n", 129),
        ("frequency_penalty", 2.5),
        ("presence_penalty", -3),
        ("repetition_penalty", 0),
        ("logit_bias", {"x": 1}),
        ("logit_bias", {"5": "a"}),
        ("allowed_token_ids", []),
        ("min_tokens", -1),
        ("truncate_prompt_tokens", 0),
        ("prompt_logprobs", 21),
        ("prompt_logprobs", -1),
    ],
)
def test_out_of_range_values_are_400(field: str, value: Any) -> None:
    rejects(chat, field, **{field: value})
    rejects(completion, field, **{field: value})


def test_stream_options_need_stream() -> None:
    rejects(chat, "stream_options", stream_options={"include_usage": True})
    assert chat(stream=True, stream_options={}).stream_options.include_usage  # vLLM's default


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("use_beam_search", True),
        ("chat_template", "{{ messages }}"),
        ("functions", [{"name": "f"}]),
        ("guided_whitespace_pattern", " *"),
        ("best_of", 2),
        ("bad_words", ["x"]),
        ("logits_processors", ["a.b"]),
    ],
)
def test_known_unsupported_fields_are_400_when_used(field: str, value: Any) -> None:
    err = rejects(chat, field, **{field: value})
    assert field in err.message and "not supported" in err.message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logprobs", False),
        ("logprobs", None),
        ("top_logprobs", 0),
        ("frequency_penalty", 0),
        ("presence_penalty", 0.0),
        ("repetition_penalty", 1.0),
        ("logit_bias", {}),
        ("tools", []),
        ("tool_choice", "none"),
        ("response_format", {"type": "text"}),
        ("echo", False),
        ("best_of", 1),
    ],
)
def test_known_unsupported_fields_pass_at_their_default(field: str, value: Any) -> None:
    chat(**{field: value})


def test_default_checks_do_not_confuse_bools_and_ints() -> None:
    rejects(chat, "use_beam_search", use_beam_search=0)
    rejects(chat, "best_of", best_of=True)


def test_completion_only_fields() -> None:
    assert completion(logprobs=0).num_logprobs == 0  # the sampled token's logprob only
    rejects(completion, "logprobs", logprobs=21)
    rejects(completion, "suffix", suffix="end")
    completion(suffix="", logprobs=None)
    # echo with max_tokens 0 scores the prompt: one token is generated and dropped.
    assert completion(echo=True, max_tokens=0).to_sampling().max_tokens == 1
    assert completion(echo=True, max_tokens=0).is_echo_only
    rejects(completion, "max_tokens", max_tokens=0)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [({}, None), ({"logprobs": False, "top_logprobs": 0}, None), ({"logprobs": True}, 0),
     ({"logprobs": True, "top_logprobs": 20}, 20)],
)  # fmt: skip
def test_chat_logprobs(fields: dict[str, Any], expected: int | None) -> None:
    assert chat(**fields).num_logprobs == expected


def test_chat_logprobs_checks_and_prompt_token_ids() -> None:
    rejects(chat, "top_logprobs", top_logprobs=2)  # needs logprobs: true
    rejects(chat, "top_logprobs", logprobs=True, top_logprobs=21)
    req = decode_request(json.dumps({"prompt_token_ids": [1, 2]}).encode(), ChatCompletionRequest)
    assert req.prompt_token_ids == [1, 2] and req.messages == []
    rejects(chat, "prompt_token_ids", prompt_token_ids=[])
    rejects(chat, "messages", messages=[])
    rejects(chat, "min_tokens", max_tokens=3, min_tokens=4)


def test_spaces_between_special_tokens_only_where_honoured() -> None:
    completion(spaces_between_special_tokens=True)  # special tokens skipped: nothing to space
    completion(spaces_between_special_tokens=False, skip_special_tokens=False)
    completion(skip_special_tokens=False)  # left out: the backend's joined text, as vLLM's
    rejects(
        completion,
        "spaces_between_special_tokens",
        spaces_between_special_tokens=True,
        skip_special_tokens=False,
    )


def test_chat_messages_are_normalized() -> None:
    req = chat(
        messages=[
            {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": None, "tool_calls": []},
            {"role": "tool", "content": "42", "tool_call_id": "x"},
        ]
    )
    msgs = req.normalized_messages()
    assert msgs[0]["content"] == "be brief" and msgs[1]["content"] == "a\nb"
    assert msgs[2]["tool_calls"] == [] and msgs[3]["tool_call_id"] == "x"


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ([{"content": "hi"}], "messages[0].role"),
        ([{"role": "wizard", "content": "hi"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages[0].content[0]",
        ),
        ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0]"),
    ],
)
def test_bad_messages_are_400(messages: list[Any], param: str) -> None:
    with pytest.raises(APIError) as info:
        chat(messages=messages).normalized_messages()
    assert info.value.status == 400 and info.value.param == param


def test_continue_final_message_excludes_generation_prompt() -> None:
    rejects(chat, "continue_final_message", continue_final_message=True)
    chat(continue_final_message=True, add_generation_prompt=False)


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("text", ["text"]),
        ([1, 2, 3], [[1, 2, 3]]),
        (["text"], ["text"]),
        ([[4, 5]], [[4, 5]]),
        (["a", "b", "c"], ["a", "b", "c"]),
        ([[1], [2, 3]], [[1], [2, 3]]),
    ],
)
def test_prompt_forms(prompt: Any, expected: Any) -> None:
    assert completion(prompt=prompt).normalized_prompts() == expected


@pytest.mark.parametrize(
    "prompt", [[], [1, "a"], [True, 2], [[]], ["a", [1]], [[1], []], [[1, "x"]], [[True]]]
)
def test_unsupported_prompt_forms_are_400(prompt: Any) -> None:
    with pytest.raises(APIError) as info:
        completion(prompt=prompt).normalized_prompts()
    assert info.value.status == 400 and info.value.param == "prompt"


def test_request_id_and_user_are_accepted() -> None:
    assert chat(request_id="abc", user="u").request_id == "abc"
    assert completion(request_id="abc").request_id == "abc"


def test_error_body_has_the_openai_shape() -> None:
    err = APIError("nope", 404, "model", "model_not_found")
    body = json.loads(msgspec.json.encode(err.to_response()))
    assert body == {
        "error": {
            "message": "nope",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


# --------------------------------------------------------------------------- request -> params


class _StubTokenizer:
    def __init__(self) -> None:
        self.eos_token_ids = [2, 7]
        self.generation_defaults = {"temperature": 0.6, "top_k": 20}


def serving(max_model_len: int = 100) -> OpenAIServing:
    return OpenAIServing(None, _StubTokenizer(), ["tiny", "alias"], max_model_len, vocab_size=50)  # type: ignore[arg-type]


def test_sampling_params_defaults() -> None:
    params = serving().sampling_params(completion().to_sampling(), [1] * 30, "prompt")
    assert params.max_tokens == 70  # max_model_len - prompt_len
    assert params.temperature == 0.6 and params.top_k == 20  # generation_config.json defaults
    assert params.top_p == 1.0 and params.min_p == 0.0 and params.seed is None
    assert params.eos_token_ids == [2, 7] and params.stop_token_ids == []


def test_eos_ids_outside_the_vocabulary_are_dropped(caplog: pytest.LogCaptureFixture) -> None:
    """A generation config's end-of-sequence ids past the model's vocabulary (a config class's
    defaults saved beside a smaller vocabulary) can never be sampled: ignored, with a warning,
    rather than sent with every request for the engine core to refuse."""
    tokenizer = _StubTokenizer()
    tokenizer.eos_token_ids = [151645, 2, 50]
    with caplog.at_level("WARNING", logger="tern.frontend"):
        server = OpenAIServing(None, tokenizer, ["tiny"], 100, vocab_size=50)  # type: ignore[arg-type]
    assert "[50, 151645]" in caplog.text
    params = server.sampling_params(completion().to_sampling(), [1] * 30, "prompt")
    assert params.eos_token_ids == [2]


def test_sampling_params_from_request() -> None:
    req = completion(
        temperature=0,
        top_p=0.5,
        top_k=-1,
        min_p=0.1,
        seed=3,
        max_tokens=4,
        stop_token_ids=[9],
        ignore_eos=True,
    )
    params = serving().sampling_params(req.to_sampling(), [1, 2], "prompt")
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.0, 0.5, 0, 0.1)
    assert params.seed == 3 and params.max_tokens == 4 and params.stop_token_ids == [9]
    assert params.ignore_eos and params.is_greedy


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "param"),
    [(0, None, "prompt"), (100, None, "prompt"), (120, 1, "prompt"), (90, 11, "max_tokens")],
)
def test_context_length_is_enforced(prompt_len: int, max_tokens: int | None, param: str) -> None:
    with pytest.raises(APIError) as info:
        serving().sampling_params(
            completion(max_tokens=max_tokens).to_sampling(), [1] * prompt_len, "prompt"
        )
    assert info.value.status == 400 and info.value.param == param


def test_prompt_plus_max_tokens_may_fill_the_context() -> None:
    assert (
        serving()
        .sampling_params(completion(max_tokens=10).to_sampling(), [1] * 90, "prompt")
        .max_tokens
        == 10
    )


def test_stop_token_ids_outside_the_vocabulary_are_400() -> None:
    with pytest.raises(APIError) as info:
        serving().sampling_params(completion(stop_token_ids=[50]).to_sampling(), [1], "prompt")
    assert info.value.param == "stop_token_ids"


def test_unknown_model_is_404() -> None:
    with pytest.raises(APIError) as info:
        serving().check_model("gpt-4")
    assert info.value.status == 404 and info.value.code == "model_not_found"
    serving().check_model("tiny")
    serving().check_model("alias")  # every served name is accepted
    serving().check_model(None)
    assert serving().model_name == "tiny"  # responses carry the first


def test_logits_processing_from_request() -> None:
    req = completion(
        presence_penalty=0.5,
        frequency_penalty=-1,
        repetition_penalty=1.3,
        logit_bias={"3": 250, "4": -1e9, "5": 7.5},
        allowed_token_ids=[3, 4, 5],
        min_tokens=2,
        max_tokens=8,
    )
    params = serving().sampling_params(req.to_sampling(), [1, 2], "prompt")
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -1.0)
    assert params.repetition_penalty == 1.3 and params.min_tokens == 2
    assert params.logit_bias == {3: 100.0, 4: -100.0, 5: 7.5}  # clamped to [-100, 100], as vLLM
    assert params.allowed_token_ids == [3, 4, 5]
    plain = serving().sampling_params(completion().to_sampling(), [1, 2], "prompt")
    assert not plain.has_penalties and plain.logit_bias == {} and not plain.needs_history


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": {"50": 1}}, "logit_bias"),  # the stub's vocabulary has 50 tokens
        ({"allowed_token_ids": [0, 50]}, "allowed_token_ids"),
        ({"min_tokens": 99}, "min_tokens"),  # beyond the default max_tokens (100 - 2)
    ],
)
def test_logits_processing_checks(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as info:
        serving().sampling_params(completion(**fields).to_sampling(), [1, 2], "prompt")
    assert info.value.status == 400 and info.value.param == param


def test_truncate_and_per_sample_params() -> None:
    assert truncate_prompt([1, 2, 3, 4], 2, 100) == [3, 4]
    assert truncate_prompt([1, 2, 3, 4], 9, 100) == [1, 2, 3, 4]
    assert truncate_prompt(list(range(10)), -1, 6) == [4, 5, 6, 7, 8, 9]
    with pytest.raises(APIError):
        truncate_prompt([1], 101, 100)
    base = serving().sampling_params(completion(seed=2**63 - 2).to_sampling(), [1], "prompt")
    seeds = [for_sample(base, i, 3, 1).seed for i in range(3)]
    assert seeds == [2**63 - 2, 2**63 - 1, -(2**63)]  # seed + i, kept a signed 64-bit integer
    assert for_sample(base, 1, 3, 1).logprobs == 3 and base.logprobs is None
    unseeded = serving().sampling_params(completion().to_sampling(), [1], "prompt")
    assert for_sample(unseeded, 2, None, None).seed is None  # the engine core draws one each


def test_messages_reach_the_template_with_content_in_every_form_the_api_allows() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    turns = [
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "assistant", "tool_calls": [call]},  # no content key (exclude_none)
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "18 C"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        {"role": "assistant", "content": None, "refusal": "I can't"},
        {
            "role": "assistant",
            "content": [{"type": "refusal", "refusal": "no"}],
            "tool_calls": None,
        },
    ]
    out = normalize_messages(turns)
    assert [m["content"] for m in out] == ["hi", "", "18 C", "", "ok", "I can't", "no"]
    assert out[0]["name"] == "ann"
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert "refusal" not in out[5] and "tool_calls" not in out[6]


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "user"}, "messages[0].content"),
        ({"role": "tool", "tool_call_id": "c1", "content": None}, "messages[0].content"),
        (
            {"role": "user", "content": [{"type": "refusal", "refusal": "x"}]},
            "messages[0].content[0]",
        ),
        ({"role": "user", "content": "x", "tool_calls": []}, "messages[0].tool_calls"),
        ({"role": "tool", "tool_call_id": 5, "content": "x"}, "messages[0].tool_call_id"),
        ({"role": "assistant", "content": 3}, "messages[0].content"),
    ],
)
def test_messages_the_api_forbids_are_400_naming_index_and_field(message: dict, param: str) -> None:
    with pytest.raises(APIError) as e:
        normalize_messages([message])
    assert e.value.status == 400 and e.value.param == param

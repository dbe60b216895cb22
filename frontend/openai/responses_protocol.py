"""OpenAI's Responses API (POST /v1/responses) for text: the request, the response, the events.

Text in, text out: `input` is a string or a list of messages (roles user, system, developer,
assistant; content a string or input_text/output_text parts), `instructions` becomes a system
message. Nothing is stored: `store`, `previous_response_id`, `background` and `conversation` are
400s, as are tools, reasoning, logprobs, structured output and every other field this server does
not implement. Field names mirror OpenAI's and vLLM's (its extensions top_k, seed, stop, ignore_eos,
skip_special_tokens, include_stop_str_in_output, request_id included).
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET

from enginecore.messages import StructuredOutputSpec
from frontend.openai.protocol import check_unsupported, normalize_messages
from frontend.server.errors import bad_request
from frontend.serving.sampling import RequestSampling, stop_list
from frontend.text.structured_outputs import from_response_format, structured_output_spec

_TEXT_FORMAT = {"format": {"type": "text"}}

# Known fields we do not implement -> the values that mean "not used" (anything else is a 400).
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "max_tool_calls": (None,),
    "previous_response_id": (None,),
    "conversation": (None,),
    "store": (None, False),
    "background": (None, False),
    "include": (None, []),
    "prompt": (None,),
    "reasoning": (None,),
    "top_logprobs": (None, 0),
    "truncation": (None, "disabled"),
    "service_tier": (None, "auto", "default"),
    "stream_options": (None, {}, {"include_obfuscation": False}),
    "logit_bias": (None, {}),
    "repetition_penalty": (None, 1),
    "priority": (None, 0),
    "cache_salt": (None,),
    "kv_transfer_params": (None,),
    "vllm_xargs": (None,),
    "mm_processor_kwargs": (None,),
    "media_io_kwargs": (None,),
    "enable_response_messages": (None, False),
    "previous_input_messages": (None,),
}
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text")


class ResponsesRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    user: str | None = None
    metadata: dict[str, str] | None = None  # echoed in the response, as OpenAI does
    parallel_tool_calls: bool | None = None  # no tools: nothing to parallelize
    prompt_cache_key: str | None = None  # routing hints with no effect on the output
    safety_identifier: str | None = None
    # vLLM's extensions
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    request_id: str | None = None

    tools: Any = UNSET
    tool_choice: Any = UNSET
    max_tool_calls: Any = UNSET
    previous_response_id: Any = UNSET
    conversation: Any = UNSET
    store: Any = UNSET
    background: Any = UNSET
    include: Any = UNSET
    prompt: Any = UNSET
    reasoning: Any = UNSET
    text: dict[str, Any] | None = None  # text.format: the output constraint, if any
    top_logprobs: Any = UNSET
    truncation: Any = UNSET
    service_tier: Any = UNSET
    stream_options: Any = UNSET
    logit_bias: Any = UNSET
    repetition_penalty: Any = UNSET
    priority: Any = UNSET
    cache_salt: Any = UNSET
    kv_transfer_params: Any = UNSET
    vllm_xargs: Any = UNSET
    mm_processor_kwargs: Any = UNSET
    media_io_kwargs: Any = UNSET
    structured_outputs: dict[str, Any] | None = None  # vLLM's
    enable_response_messages: Any = UNSET
    previous_input_messages: Any = UNSET

    def to_sampling(self) -> RequestSampling:
        return RequestSampling(
            max_tokens=self.max_output_tokens,
            max_tokens_name="max_output_tokens",
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=stop_list(self.stop),
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )

    def validate(self) -> None:
        check_unsupported(self, _UNSUPPORTED)
        self.to_sampling().verify()

    def output_constraint(self) -> StructuredOutputSpec | None:
        """text.format (OpenAI's json_schema / json_object), or vLLM's structured_outputs."""
        text_format = (self.text or {}).get("format")
        if text_format is not None and self.structured_outputs is not None:
            raise bad_request(
                "set at most one output constraint; got text.format and structured_outputs",
                "structured_outputs",
            )
        if self.structured_outputs is not None:
            return structured_output_spec(structured_outputs=self.structured_outputs)
        if text_format is None:
            return None
        if isinstance(text_format, dict) and text_format.get("type") == "json_schema":
            # The Responses API's format is flat: {"type", "name", "schema", "strict"}.
            schema = {k: v for k, v in text_format.items() if k != "type"}
            text_format = {"type": "json_schema", "json_schema": schema}
        return from_response_format(text_format, "text.format")

    def messages(self) -> list[dict[str, Any]]:
        """The chat messages the prompt is rendered from: instructions first, then the input."""
        messages = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            if not self.input:
                raise bad_request("input must not be empty", "input")
            messages += [_input_message(i, item) for i, item in enumerate(self.input)]
        return normalize_messages(messages)


def _input_message(i: int, item: dict[str, Any]) -> dict[str, Any]:
    kind = item.get("type", "message")
    if kind != "message":
        raise bad_request(
            f"input items of type {kind!r} are not supported (messages only)", "input"
        )
    role = item.get("role")
    if role not in _ROLES:
        raise bad_request(
            f"input[{i}]: role must be one of {', '.join(_ROLES)}, not {role!r}", "input"
        )
    content = item.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(
                    f"input[{i}].content[{j}]: content of type {kind!r} is not supported "
                    "(input_text and output_text only)",
                    "input",
                )
            if not isinstance(part.get("text"), str):
                raise bad_request(f"input[{i}].content[{j}] needs a string 'text'", "input")
            texts.append(part["text"])
        content = "\n".join(texts)
    elif not isinstance(content, str):
        raise bad_request(f"input[{i}].content must be a string or a list of parts", "input")
    return {"role": _ROLES[role], "content": content}


# --------------------------------------------------------------------------- the response


class OutputText(msgspec.Struct, kw_only=True):
    text: str
    type: str = "output_text"
    annotations: list[Any] = []
    logprobs: list[Any] = []


class OutputMessage(msgspec.Struct, kw_only=True):
    id: str
    status: str  # in_progress | completed | incomplete
    content: list[OutputText]
    type: str = "message"
    role: str = "assistant"


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseObject(msgspec.Struct, kw_only=True):
    id: str
    created_at: int
    model: str
    status: str  # in_progress | completed | incomplete | cancelled | failed
    output: list[OutputMessage]
    object: str = "response"
    usage: ResponseUsage | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    reasoning: None = None
    store: bool = False
    temperature: float
    text: dict[str, Any] = msgspec.field(default_factory=lambda: dict(_TEXT_FORMAT))
    tool_choice: str = "none"
    tools: list[Any] = []
    top_p: float
    truncation: str = "disabled"
    user: str | None = None

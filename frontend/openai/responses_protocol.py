"""OpenAI's Responses API (POST /v1/responses): the request, its conversion to chat messages and
tools, and the response's items.

`input` is a string or a list of items: messages (roles user, system, developer, assistant; content
a string or input_text/output_text parts), `function_call` items (the model's earlier calls: an
assistant turn with tool_calls) and `function_call_output` items (a `tool` message answering one
by call_id); `reasoning` items a client echoes back are dropped (earlier reasoning is not prompt
text). `instructions` becomes a system message; `previous_response_id` puts a stored response's
conversation first. Tools are function tools ({"type": "function", name, description,
parameters}); tool_choice auto / required / none / {"type": "function", "name"}. A
function_call_output whose call_id no function_call has, other tool types, `background`,
`conversation`, logprobs and every other field this server does not implement are 400s naming
them. Field names mirror OpenAI's and vLLM's (its extensions top_k, seed, stop, ignore_eos,
skip_special_tokens, include_stop_str_in_output, request_id included).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import UNSET

from enginecore.messages import StructuredOutputSpec
from frontend.common.decoding import Unsupported, check_unsupported
from frontend.common.errors import bad_request
from frontend.serving.sampling import RequestSampling, stop_list
from frontend.text.structured_outputs import from_response_format, structured_output_spec

_TEXT_FORMAT = {"format": {"type": "text"}}

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
    parallel_tool_calls: bool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool = True  # OpenAI's default: kept (in memory, --max-stored-responses) for GET
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

    max_tool_calls: Annotated[Any, Unsupported(None)] = UNSET
    conversation: Annotated[Any, Unsupported(None)] = UNSET
    background: Annotated[Any, Unsupported(None, False)] = UNSET
    include: Annotated[Any, Unsupported(None, [])] = UNSET
    prompt: Annotated[Any, Unsupported(None)] = UNSET
    reasoning: Annotated[Any, Unsupported(None)] = UNSET
    text: dict[str, Any] | None = None  # text.format: the output constraint, if any
    top_logprobs: Annotated[Any, Unsupported(None, 0)] = UNSET
    truncation: Annotated[Any, Unsupported(None, "disabled")] = UNSET
    service_tier: Annotated[Any, Unsupported(None, "auto", "default")] = UNSET
    stream_options: Annotated[Any, Unsupported(None, {}, {"include_obfuscation": False})] = UNSET
    logit_bias: Annotated[Any, Unsupported(None, {})] = UNSET
    repetition_penalty: Annotated[Any, Unsupported(None, 1)] = UNSET
    priority: Annotated[Any, Unsupported(None, 0)] = UNSET
    cache_salt: Annotated[Any, Unsupported(None)] = UNSET
    kv_transfer_params: Annotated[Any, Unsupported(None)] = UNSET
    vllm_xargs: Annotated[Any, Unsupported(None)] = UNSET
    mm_processor_kwargs: Annotated[Any, Unsupported(None)] = UNSET
    media_io_kwargs: Annotated[Any, Unsupported(None)] = UNSET
    structured_outputs: dict[str, Any] | None = None  # vLLM's
    enable_response_messages: Annotated[Any, Unsupported(None, False)] = UNSET
    previous_input_messages: Annotated[Any, Unsupported(None)] = UNSET

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
        check_unsupported(self)
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

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The function tools in chat completions' shape."""
        if not self.tools:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function" or not isinstance(tool.get("name"), str):
                raise bad_request(
                    f"only function tools are supported; got type {kind!r}", f"tools[{i}].type"
                )
            function = {"name": tool["name"], "parameters": tool.get("parameters") or {}}
            if tool.get("description"):
                function["description"] = tool["description"]
            out.append({"type": "function", "function": function})
        return out

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if choice is None or isinstance(choice, str):
            return choice
        if choice.get("type") == "function" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        raise bad_request(
            'tool_choice must be "auto", "required", "none" or {"type": "function", "name"}',
            "tool_choice",
        )

    def messages(self, history: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """The chat messages the prompt is rendered from, in chat completions' shape (images as
        image_url parts): instructions, the previous response's conversation (`history`), then
        the input."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        messages += [dict(m) for m in history or []]
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            if not self.input:
                raise bad_request("input must not be empty", "input")
            known = {c["id"] for m in messages for c in m.get("tool_calls") or []}
            for i, item in enumerate(self.input):
                _add_item(messages, i, item, known)
        return messages


def _add_item(messages: list[dict[str, Any]], i: int, item: Any, known_calls: set[str]) -> None:
    """Appends input item i (consecutive function_call items share one assistant turn)."""
    kind = item.get("type", "message") if isinstance(item, dict) else None
    if kind == "message":
        messages.append(_input_message(i, item))
    elif kind == "function_call":
        call = _function_call(i, item)
        known_calls.add(call["id"])
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
            last["tool_calls"] = [*last["tool_calls"], call]
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        call_id = item.get("call_id")
        if call_id not in known_calls:
            raise bad_request(
                f"function_call_output refers to call_id {call_id!r}, which no function_call "
                "in the input or the previous response has",
                f"input[{i}].call_id",
            )
        output = item.get("output")
        if isinstance(output, list):
            output = _parts_text(i, output, "output")
        if not isinstance(output, str):
            raise bad_request("output must be a string or text parts", f"input[{i}].output")
        messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
    elif kind != "reasoning":
        raise bad_request(
            f"input items of type {kind!r} are not supported (message, function_call, "
            "function_call_output, reasoning)",
            f"input[{i}].type",
        )


def _function_call(i: int, item: dict[str, Any]) -> dict[str, Any]:
    call_id, name = item.get("call_id"), item.get("name")
    if not isinstance(call_id, str) or not isinstance(name, str):
        raise bad_request("a function_call needs a string call_id and name", f"input[{i}]")
    arguments = item.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise bad_request("arguments must be a JSON string", f"input[{i}].arguments")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _parts_text(i: int, parts: list[Any], field: str = "content") -> str:
    texts = []
    for j, part in enumerate(parts):
        param = f"input[{i}].{field}[{j}]"
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(
                f"content of type {kind!r} is not supported (input_text and output_text only)",
                param,
            )
        if not isinstance(part.get("text"), str):
            raise bad_request("a text part needs a string 'text'", param)
        texts.append(part["text"])
    return "\n".join(texts)


def _chat_parts(i: int, parts: list[Any]) -> list[dict[str, Any]]:
    """A message's parts with an `input_image` as chat completions' text and image_url parts
    (`detail` is accepted and ignored, as vLLM does; file_id images are not served)."""
    out = []
    for j, part in enumerate(parts):
        param = f"input[{i}].content[{j}]"
        if part.get("type") == "input_image":
            if not isinstance(part.get("image_url"), str):
                raise bad_request("an input_image needs image_url (file_id is not served)", param)
            out.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            out.append({"type": "text", "text": _parts_text(i, [part])})
    return out


def _input_message(i: int, item: dict[str, Any]) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise bad_request(
            f"role must be one of {', '.join(_ROLES)}, not {role!r}", f"input[{i}].role"
        )
    content = item.get("content")
    if isinstance(content, list) and any(
        isinstance(part, dict) and part.get("type") == "input_image" for part in content
    ):
        content = _chat_parts(i, content)
    elif isinstance(content, list):
        content = _parts_text(i, content)
    elif not isinstance(content, str):
        raise bad_request("content must be a string or a list of parts", f"input[{i}].content")
    return {"role": _ROLES[role], "content": content}


# --------------------------------------------------------------------------- the response


class OutputText(msgspec.Struct, kw_only=True):
    text: str
    type: str = "output_text"
    annotations: list[Any] = []
    logprobs: list[Any] = []


class OutputMessage(msgspec.Struct, kw_only=True, tag="message", tag_field="type"):
    id: str
    status: str  # in_progress | completed | incomplete
    content: list[OutputText]
    role: str = "assistant"


class FunctionCallItem(msgspec.Struct, kw_only=True, tag="function_call", tag_field="type"):
    id: str
    call_id: str
    name: str
    arguments: str  # a JSON object, as text
    status: str = "completed"


class ReasoningText(msgspec.Struct, kw_only=True):
    text: str
    type: str = "reasoning_text"


class ReasoningItem(msgspec.Struct, kw_only=True, tag="reasoning", tag_field="type"):
    id: str
    content: list[ReasoningText]
    summary: list[Any] = []
    status: str = "completed"


OutputItem = OutputMessage | FunctionCallItem | ReasoningItem


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
    output: list[OutputItem]
    object: str = "response"
    usage: ResponseUsage | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: None = None
    store: bool = False
    temperature: float
    text: dict[str, Any] = msgspec.field(default_factory=lambda: dict(_TEXT_FORMAT))
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[Any] = []
    top_p: float
    truncation: str = "disabled"
    user: str | None = None

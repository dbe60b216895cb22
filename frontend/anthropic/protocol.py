"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens): the request, its
conversion to chat messages and tools in OpenAI's shape (what the chat template and tool planning
take), and the response.

Conversions: `system` (a string or text blocks) becomes a system message; a user turn's
`tool_result` blocks become `tool` messages (before the turn's text, as Anthropic orders them); an
assistant turn's `tool_use` blocks become its tool_calls, its `thinking` blocks are dropped (they
are the model's earlier reasoning, not prompt text); a user turn's `image` blocks (base64 or url
sources) become OpenAI `image_url` parts, which models served without images refuse. Tools are
`{name, description, input_schema}`; tool_choice auto / any (a call is required) / tool (that one)
/ none, with `disable_parallel_tool_use`. A `tool_result` for a tool_use_id no earlier `tool_use`
has, document blocks, server tools and every field this server does not implement are 400s naming
them.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import msgspec
from msgspec import UNSET

from enginecore.messages import StructuredOutputSpec
from frontend.common.decoding import Unsupported, check_unsupported
from frontend.common.errors import bad_request
from frontend.serving.sampling import RequestSampling
from frontend.text.structured_outputs import json_schema_spec


class MessagesBase(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    # format {"type": "json_schema", "schema"}: the text answer follows the schema.
    output_config: dict[str, Any] | None = None
    # A prompt-caching breakpoint: tern caches every prompt's full blocks (prefix caching) anyway.
    cache_control: dict[str, Any] | None = None
    container: Annotated[Any, Unsupported(None)] = UNSET
    mcp_servers: Annotated[Any, Unsupported(None, [])] = UNSET
    context_management: Annotated[Any, Unsupported(None)] = UNSET
    service_tier: Annotated[Any, Unsupported(None, "auto", "standard_only")] = UNSET
    diagnostics: Annotated[Any, Unsupported(None)] = UNSET
    inference_geo: Annotated[Any, Unsupported(None)] = UNSET
    speed: Annotated[Any, Unsupported(None)] = UNSET
    user_profile_id: Annotated[Any, Unsupported(None)] = UNSET
    workspace_id: Annotated[Any, Unsupported(None)] = UNSET

    def validate(self) -> None:
        check_unsupported(self)
        self.output_constraint()  # checks the field
        if not self.messages:
            raise bad_request("messages must not be empty", "messages")
        self.enable_thinking()  # checks the field

    def chat_messages(self) -> list[dict[str, Any]]:
        """system + messages as OpenAI chat messages (not yet normalize_messages'd)."""
        out = []
        if self.system:
            out.append({"role": "system", "content": _text_of(self.system, "system")})
        known_ids: set[str] = set()
        for i, message in enumerate(self.messages):
            out += _chat_turn(i, message, known_ids)
        return out

    def chat_tools(self) -> list[dict[str, Any]] | None:
        if not self.tools:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            param = f"tools[{i}]"
            kind = tool.get("type", "custom") if isinstance(tool, dict) else None
            if kind != "custom" or not isinstance(tool.get("name"), str):
                raise bad_request(
                    "only custom tools ({name, description, input_schema}) are supported; "
                    f"got type {kind!r}",
                    f"{param}.type",
                )
            schema = tool.get("input_schema")
            if not isinstance(schema, dict):
                raise bad_request("input_schema must be a JSON schema", f"{param}.input_schema")
            function = {"name": tool["name"], "parameters": schema}
            if tool.get("description"):
                function["description"] = tool["description"]
            out.append({"type": "function", "function": function})
        return out

    def chat_tool_choice(self) -> tuple[str | dict[str, Any] | None, bool | None]:
        """(tool_choice in OpenAI's shape, parallel_tool_calls)."""
        choice = self.tool_choice
        if choice is None:
            return None, None
        kind = choice.get("type")
        parallel = False if choice.get("disable_parallel_tool_use") else None
        if kind in ("auto", "none"):
            return kind, parallel
        if kind == "any":
            return "required", parallel
        if kind == "tool" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}, parallel
        raise bad_request(
            'tool_choice must be {"type": "auto" | "any" | "none"} or {"type": "tool", "name"}',
            "tool_choice",
        )

    def output_constraint(self) -> StructuredOutputSpec | None:
        """output_config.format's JSON schema, if any."""
        config = self.output_config or {}
        for key, value in config.items():
            if key not in ("format", "effort") or (key == "effort" and value is not None):
                raise bad_request(f"output_config.{key} is not supported", f"output_config.{key}")
        output_format = config.get("format")
        if output_format is None:
            return None
        param = "output_config.format"
        if not isinstance(output_format, dict) or output_format.get("type") != "json_schema":
            raise bad_request('the format must be {"type": "json_schema", "schema"}', param)
        extra = set(output_format) - {"type", "schema"}
        if extra:
            raise bad_request(f"{param}.{min(extra)} is not supported", f"{param}.{min(extra)}")
        schema = output_format.get("schema")
        if not isinstance(schema, dict):
            raise bad_request("the schema must be a JSON schema object", f"{param}.schema")
        return json_schema_spec(schema, f"{param}.schema")

    def enable_thinking(self) -> bool | None:
        """The chat template's enable_thinking (None: the template's default)."""
        thinking = self.thinking
        if thinking is None:
            return None
        kind = thinking.get("type")
        if kind == "disabled":
            return False
        if kind == "enabled":
            budget = thinking.get("budget_tokens")
            if not isinstance(budget, int) or budget < 1:
                raise bad_request("thinking.budget_tokens must be a positive integer", "thinking")
            return True
        raise bad_request('thinking.type must be "enabled" or "disabled"', "thinking.type")


class MessagesRequest(MessagesBase, forbid_unknown_fields=True, kw_only=True):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    # tern's extension (as vLLM's on its other APIs): reproducible sampling at temperature > 0.
    seed: int | None = None
    metadata: dict[str, Any] | None = None  # user_id: a tracking hint, no effect on the output

    def validate(self) -> None:
        super().validate()
        if self.temperature is not None and not 0.0 <= self.temperature <= 1.0:
            raise bad_request(
                f"temperature must be in [0, 1], got {self.temperature}", "temperature"
            )
        self.to_sampling().verify()
        budget = (self.thinking or {}).get("budget_tokens")
        if isinstance(budget, int) and budget >= self.max_tokens:
            raise bad_request("thinking.budget_tokens must be less than max_tokens", "thinking")

    def to_sampling(self) -> RequestSampling:
        return RequestSampling(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=list(self.stop_sequences or []),
        )


class CountTokensRequest(MessagesBase, forbid_unknown_fields=True, kw_only=True):
    pass


def _text_of(content: Any, param: str) -> str:
    """A string, or text blocks joined (as normalize_messages joins text parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("must be a string or a list of text blocks", param)
    texts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise bad_request(
                f"block type {kind!r} is not supported here (text only)", f"{param}[{j}]"
            )
        if not isinstance(block.get("text"), str):
            raise bad_request("a text block needs a string 'text'", f"{param}[{j}].text")
        texts.append(block["text"])
    return "\n".join(texts)


def _chat_turn(i: int, message: Any, known_ids: set[str]) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: tool results first, then the turn itself."""
    param = f"messages[{i}]"
    role = message.get("role") if isinstance(message, dict) else None
    if role not in ("user", "assistant"):
        raise bad_request(f'role must be "user" or "assistant", not {role!r}', f"{param}.role")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request("content must be a string or a list of blocks", f"{param}.content")
    texts: list[str] = []
    images: list[dict[str, Any]] = []  # text and image_url parts, when the turn has an image
    results: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        where = f"{param}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_text_of([block], where.rsplit("[", 1)[0]))
            images.append({"type": "text", "text": texts[-1]})
        elif kind == "image" and role == "user":
            images.append({"type": "image_url", "image_url": {"url": _image_url(block, where)}})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_call(block, where))
            known_ids.add(block["id"])
        elif kind == "tool_result" and role == "user":
            results.append(_tool_message(block, where, known_ids))
        else:
            raise bad_request(f"a {role} block of type {kind!r} is not supported", f"{where}.type")
    out = list(results)
    if len(images) > len(texts):  # OpenAI's parts, for the server's image path
        out.append({"role": role, "content": images})
    elif texts or calls or not results:
        turn: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
        if calls:
            turn["tool_calls"] = calls
        out.append(turn)
    return out


def _image_url(block: dict[str, Any], where: str) -> str:
    """An image block's source as a URL: base64 data as a data: URL, a url source as it is."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("data"), str):
        media_type = source.get("media_type")
        if not isinstance(media_type, str):
            raise bad_request("a base64 image source needs a media_type", f"{where}.source")
        return f"data:{media_type};base64,{source['data']}"
    if kind == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise bad_request("an image block needs a base64 or url source", f"{where}.source")


def _tool_call(block: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise bad_request("a tool_use block needs a string id and name", where)
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise bad_request("tool_use.input must be an object", f"{where}.input")
    function = {"name": block["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}
    return {"id": block["id"], "type": "function", "function": function}


def _tool_message(block: dict[str, Any], where: str, known_ids: set[str]) -> dict[str, Any]:
    tool_use_id = block.get("tool_use_id")
    if tool_use_id not in known_ids:
        raise bad_request(
            f"tool_result refers to tool_use_id {tool_use_id!r}, which no earlier tool_use has",
            f"{where}.tool_use_id",
        )
    content = block.get("content", "")
    text = _text_of(content, f"{where}.content")
    if block.get("is_error"):
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": tool_use_id, "content": text}


# --------------------------------------------------------------------------- the response


class TextBlock(msgspec.Struct, tag="text", tag_field="type"):
    text: str


class ThinkingBlock(msgspec.Struct, tag="thinking", tag_field="type"):
    thinking: str
    signature: str = ""


class ToolUseBlock(msgspec.Struct, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = TextBlock | ThinkingBlock | ToolUseBlock


class Usage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class MessageResponse(msgspec.Struct, kw_only=True):
    id: str
    model: str
    content: list[ContentBlock]
    stop_reason: str | None
    stop_sequence: str | None = None
    usage: Usage
    type: str = "message"
    role: str = "assistant"


class CountTokensResponse(msgspec.Struct):
    input_tokens: int

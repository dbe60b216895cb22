"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat path.

The prompt is rendered as a chat completion's is (the chat template, tools, reasoning), the output
parsed by the same ChoiceParser into thinking, text and tool calls, answered as content blocks:
`thinking` (with --reasoning-parser), `text`, `tool_use`. stop_reason: end_turn, max_tokens,
stop_sequence (with stop_sequence), tool_use. A stream is Anthropic's event sequence:
message_start, then per block content_block_start / content_block_delta (text_delta,
thinking_delta, input_json_delta) / content_block_stop, then message_delta (stop_reason, usage)
and message_stop; an engine failure mid-stream is an `error` event. Errors on these routes are in
Anthropic's shape (frontend/common/errors.py `error_body`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from enginecore.messages import MultiModalItem
from frontend.anthropic.protocol import (
    ContentBlock,
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesBase,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
    Usage,
)
from frontend.common.decoding import decode_request, normalize_messages
from frontend.common.errors import ANTHROPIC_PATH_PREFIX, APIError, error_body
from frontend.common.http import json_response, sse_json
from frontend.engine.client import EngineDeadError
from frontend.serving.base import streaming_response
from frontend.serving.chat import ChatPath
from frontend.serving.generation import Generation, RequestFailedError, RequestGroup
from frontend.text.chat_output import ChoiceParser, parse_message
from frontend.text.tool_calling import ToolPlan, plan_tools


class MessagesServing:
    def __init__(self, chat: ChatPath) -> None:
        self.chat = chat
        self.serving = chat.serving

    async def _plan_and_render(
        self, req: MessagesBase
    ) -> tuple[ToolPlan, str, list[int], list[MultiModalItem]]:
        s = self.serving
        s.check_model(req.model)
        tool_choice, parallel = req.chat_tool_choice()
        plan = plan_tools(
            req.chat_tools(), tool_choice, parallel, req.output_constraint(), self.chat.options
        )
        thinking = req.enable_thinking()
        kwargs = None if thinking is None else {"enable_thinking": thinking}
        images = [] if s.images is not None else None
        prompt_text = s.tokenizer.render_chat(
            normalize_messages(req.chat_messages(), images),
            chat_template_kwargs=kwargs,
            tools=plan.tools,
        )
        if images:
            ids, items = await self.chat.image_prompt(prompt_text, images, None, "messages")
            return plan, prompt_text, ids, items
        return plan, prompt_text, s.tokenizer.encode(prompt_text, add_special_tokens=False), []

    async def count_tokens(self, http_request: Request) -> Response:
        req = decode_request(await http_request.body(), CountTokensRequest)
        _, _, ids, _ = await self._plan_and_render(req)
        return json_response(CountTokensResponse(len(ids)))

    async def create(self, http_request: Request) -> Response:
        s = self.serving
        req = decode_request(await http_request.body(), MessagesRequest)
        plan, prompt_text, prompt_ids, mm_items = await self._plan_and_render(req)
        if req.thinking is not None and req.thinking.get("type") == "enabled":
            if self.chat.options.reasoning_parser is None:
                raise APIError(
                    "thinking needs a server started with --reasoning-parser", 400, "thinking"
                )
        constraint, opens = self.chat.after_reasoning(plan.constraint, prompt_text)
        message_id, keys, headers = s.request_ids(http_request, "msg_")
        group = s.start(
            message_id, keys, req.to_sampling(), [prompt_ids], "messages",
            structured_output=constraint, lora=s.check_model(req.model), mm_items=mm_items,
        )  # fmt: skip
        parser = self.chat.choice_parser(plan, opens)
        draft = _Draft(message_id, group.model_name)
        if req.stream:
            return streaming_response(self._events(group, parser, draft), group, headers)
        texts = await group.collect_unless_disconnected(http_request)
        if texts is None:
            return Response(status_code=499)
        parsed = parse_message(parser, texts[0])
        blocks: list[ContentBlock] = []
        if parsed.reasoning:
            blocks.append(ThinkingBlock(parsed.reasoning))
        if parsed.content:
            blocks.append(TextBlock(parsed.content))
        for call in parsed.tool_calls:
            blocks.append(
                ToolUseBlock(call.id, call.function.name, _input(call.function.arguments))
            )
        gen = group.gens[0]
        stop_reason, stop_sequence = _stop(gen, bool(parsed.tool_calls))
        return json_response(
            MessageResponse(
                id=message_id, model=group.model_name, content=blocks, stop_reason=stop_reason,
                stop_sequence=stop_sequence, usage=draft.usage(gen),
            ),
            headers=headers,
        )  # fmt: skip

    async def _events(
        self, group: RequestGroup, parser: ChoiceParser, draft: _Draft
    ) -> AsyncIterator[bytes]:
        gen = group.gens[0]
        blocks = _BlockStream()
        yield _event("message_start", message=draft.start(gen))
        called = False
        try:
            async for _, text in group.merged():
                delta = parser.feed(text) if text else None
                for part in [delta, parser.finish() if gen.is_finished else None]:
                    if part is None:
                        continue
                    called = called or bool(part.tool_calls)
                    for event in blocks.feed(part.reasoning, part.content, part.tool_calls):
                        yield event
        except (EngineDeadError, RequestFailedError) as e:
            status = 503 if isinstance(e, EngineDeadError) else 500
            body = error_body(APIError(str(e), status), ANTHROPIC_PATH_PREFIX)
            yield _event("error", **msgspec.to_builtins(body))
            return
        for event in blocks.close():
            yield event
        stop_reason, stop_sequence = _stop(gen, called)
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        yield _event("message_delta", delta=delta, usage={"output_tokens": gen.num_output_tokens})
        yield _event("message_stop")


class _BlockStream:
    """Turns parsed deltas into content-block events, one block open at a time."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # thinking | text | tool_use

    def feed(self, reasoning: str, content: str, calls: list[Any]) -> list[bytes]:
        out: list[bytes] = []
        if reasoning:
            out += self._switch("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
        if content:
            out += self._switch("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": content}))
        for call in calls:
            if call.id is not None:  # a new call: its own block
                out += self._close()
                block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
                out += self._switch("tool_use", block)
            if call.arguments:
                out.append(
                    self._delta({"type": "input_json_delta", "partial_json": call.arguments})
                )
        return out

    def close(self) -> list[bytes]:
        return self._close()

    def _switch(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        if self.open == kind and kind != "tool_use":
            return []
        out = self._close()
        self.index += 1
        self.open = kind
        out.append(_event("content_block_start", index=self.index, content_block=block))
        return out

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", index=self.index)]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", index=self.index, delta=delta)


class _Draft:
    def __init__(self, message_id: str, model: str) -> None:
        self.message_id = message_id
        self.model = model

    def usage(self, gen: Generation) -> Usage:
        return Usage(gen.num_prompt_tokens, gen.num_output_tokens, gen.num_cached_tokens)

    def start(self, gen: Generation) -> dict[str, Any]:
        return {
            "id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": gen.num_prompt_tokens, "output_tokens": 0},
        }  # fmt: skip


def _stop(gen: Generation, called_tools: bool) -> tuple[str, str | None]:
    """Anthropic's stop_reason (and stop_sequence) for a finished generation."""
    if gen.finish_reason == "length":
        return "max_tokens", None
    if called_tools:
        return "tool_use", None
    if isinstance(gen.stop_reason, str):
        return "stop_sequence", gen.stop_reason
    return "end_turn", None


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _event(kind: str, **fields: Any) -> bytes:
    body = {"type": kind, **fields}
    return b"event: " + kind.encode() + b"\ndata: " + sse_json(body) + b"\n\n"

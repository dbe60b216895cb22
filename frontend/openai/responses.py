"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API over the chat path.

The prompt is rendered as a chat completion's is (the chat template with tools, reasoning), and the
output parsed by the same ChoiceParser into output items: `reasoning` (with --reasoning-parser),
a `message` with one output_text part, and `function_call` items (call_id, name, arguments). A
stream is OpenAI's event sequence: response.created, response.in_progress, then per item
response.output_item.added, its deltas (response.reasoning_text.delta, response.content_part.added
+ response.output_text.delta, response.function_call_arguments.delta) and their .done events,
response.output_item.done; and response.completed (response.incomplete when max_output_tokens cut
it, response.failed when the engine failed), each with its sequence_number. Like OpenAI, and unlike
chat completions, the stream has no [DONE] line. Responses with `store` (the default) are kept in
memory, the oldest forgotten past --max-stored-responses, for GET, DELETE and previous_response_id.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from frontend.common.decoding import decode_request, normalize_messages
from frontend.common.errors import APIError, bad_request
from frontend.common.http import json_response, sse_json
from frontend.engine.client import EngineDeadError
from frontend.openai.chat import ChatServing
from frontend.openai.responses_protocol import (
    FunctionCallItem,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from frontend.serving.base import streaming_response
from frontend.serving.generation import RequestFailedError, RequestGroup
from frontend.text.chat_output import ChoiceParser, parse_message
from frontend.text.tool_calling import plan_tools


class ResponseStore:
    """Stored responses and the conversation each ends (for previous_response_id), LRU-bounded."""

    def __init__(self, max_responses: int) -> None:
        self.max_responses = max_responses
        self._items: OrderedDict[str, tuple[ResponseObject, list[dict[str, Any]]]] = OrderedDict()

    def put(self, response: ResponseObject, conversation: list[dict[str, Any]]) -> None:
        if self.max_responses < 1:
            return
        self._items[response.id] = (response, conversation)
        self._items.move_to_end(response.id)
        while len(self._items) > self.max_responses:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[ResponseObject, list[dict[str, Any]]] | None:
        item = self._items.get(response_id)
        if item is not None:
            self._items.move_to_end(response_id)
        return item

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None


class ResponsesServing:
    def __init__(self, chat: ChatServing, store: ResponseStore) -> None:
        self.chat = chat
        self.serving = chat.serving
        self.store = store

    async def create(self, http_request: Request) -> Response:
        s = self.serving
        req = decode_request(await http_request.body(), ResponsesRequest)
        lora = s.check_model(req.model)
        history = None
        if req.previous_response_id is not None:
            stored = self.store.get(req.previous_response_id)
            if stored is None:
                raise bad_request(
                    f"no stored response has id {req.previous_response_id!r}",
                    "previous_response_id",
                )
            history = stored[1]
        messages = req.messages(history)
        plan = plan_tools(
            req.chat_tools(), req.chat_tool_choice(), req.parallel_tool_calls,
            req.output_constraint(), self.chat.options,
        )  # fmt: skip
        images = [] if s.images is not None else None
        prompt_text = s.tokenizer.render_chat(
            normalize_messages(messages, images), tools=plan.tools
        )
        prompt_ids, mm_items = s.tokenizer.encode(prompt_text, add_special_tokens=False), []
        if images:
            prompt_ids, mm_items = await self.chat.image_prompt(prompt_text, images, None, "input")
        constraint, opens = self.chat.after_reasoning(plan.constraint, prompt_text)
        response_id, keys, headers = s.request_ids(http_request, "resp_", req.request_id)
        group = s.start(
            response_id, keys, req.to_sampling(), [prompt_ids], "input",
            structured_output=constraint, lora=lora, mm_items=mm_items,
        )  # fmt: skip
        params = group.gens[0].params
        draft = _Draft(req, response_id, group.model_name, params.temperature, params.top_p)
        parser = self.chat.choice_parser(plan, opens)
        if req.stream:
            events = self._events(group, parser, draft, messages)
            return streaming_response(events, group, headers)
        texts = await group.collect_unless_disconnected(http_request)
        if texts is None:
            return Response(status_code=499)
        parsed = parse_message(parser, texts[0])
        calls = [(c.id, c.function.name, c.function.arguments) for c in parsed.tool_calls]
        items = draft.items(parsed.reasoning or "", parsed.content or "", calls)
        final = draft.final(group, items)
        self._keep(req, final, messages)
        return json_response(final, headers=headers)

    def _keep(
        self, req: ResponsesRequest, response: ResponseObject, messages: list[dict[str, Any]]
    ) -> None:
        if not req.store:
            return
        turn: dict[str, Any] = {"role": "assistant", "content": ""}
        for item in response.output:
            if isinstance(item, OutputMessage):
                turn["content"] = "".join(part.text for part in item.content)
            elif isinstance(item, FunctionCallItem):
                call = {"name": item.name, "arguments": item.arguments}
                turn.setdefault("tool_calls", []).append(
                    {"id": item.call_id, "type": "function", "function": call}
                )
        self.store.put(response, [*messages[1 if req.instructions else 0 :], turn])

    async def retrieve(self, http_request: Request) -> Response:
        stored = self.store.get(http_request.path_params["response_id"])
        if stored is None:
            raise _not_found(http_request.path_params["response_id"])
        return json_response(stored[0])

    async def delete(self, http_request: Request) -> Response:
        response_id = http_request.path_params["response_id"]
        if not self.store.delete(response_id):
            raise _not_found(response_id)
        return json_response({"id": response_id, "object": "response", "deleted": True})

    async def _events(
        self,
        group: RequestGroup,
        parser: ChoiceParser,
        draft: _Draft,
        messages: list[dict[str, Any]],
    ) -> AsyncIterator[bytes]:
        gen = group.gens[0]
        items = _ItemStream(draft)
        yield items.event("response.created", response=draft.in_progress())
        yield items.event("response.in_progress", response=draft.in_progress())
        try:
            async for _, text in group.merged():
                parts = [parser.feed(text) if text else None]
                if gen.is_finished:
                    parts.append(parser.finish())
                for part in parts:
                    if part is not None:
                        for event in items.feed(part.reasoning, part.content, part.tool_calls):
                            yield event
        except (EngineDeadError, RequestFailedError) as e:
            failed = draft.final(group, items.items(), error=str(e))
            yield items.event("response.failed", response=failed)
            return
        for event in items.close():
            yield event
        final = draft.final(group, items.items())
        self._keep(draft.req, final, messages)
        kind = "response.completed" if final.status == "completed" else "response.incomplete"
        yield items.event(kind, response=final)


class _ItemStream:
    """Parsed deltas -> output items and their events, one item open at a time."""

    def __init__(self, draft: _Draft) -> None:
        self.draft = draft
        self.seq = 0
        self.done: list[tuple[str, Any]] = []  # (kind, item data) of closed items
        self.kind: str | None = None  # the open item: reasoning | message | function_call
        self.item_id = ""
        self.text = ""
        self.call: tuple[str, str] = ("", "")  # (call_id, name)

    def event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + sse_json(body) + b"\n\n"

    @property
    def index(self) -> int:
        return len(self.done)

    def feed(self, reasoning: str, content: str, calls: list[Any]) -> list[bytes]:
        out: list[bytes] = []
        if reasoning:
            out += self._open("reasoning")
            out.append(self._delta("response.reasoning_text.delta", reasoning, content_index=0))
        if content:
            out += self._open("message")
            out.append(self._delta("response.output_text.delta", content, content_index=0,
                                   logprobs=[]))  # fmt: skip
        for call in calls:
            if call.id is not None:
                out += self.close()
                self.call = (call.id, call.name or "")
                out += self._open("function_call")
            if call.arguments:
                out.append(self._delta("response.function_call_arguments.delta", call.arguments))
        return out

    def _delta(self, kind: str, text: str, **fields: Any) -> bytes:
        self.text += text
        where = {"item_id": self.item_id, "output_index": self.index}
        return self.event(kind, **where, **fields, delta=text)

    def _open(self, kind: str) -> list[bytes]:
        if self.kind == kind and kind != "function_call":
            return []
        out = self.close()
        self.kind, self.text = kind, ""
        self.item_id = self.draft.new_item_id(kind)
        item = self._item(status="in_progress")
        out.append(self.event("response.output_item.added", output_index=self.index, item=item))
        if kind == "message":
            out.append(self.event("response.content_part.added", item_id=self.item_id,
                                  output_index=self.index, content_index=0,
                                  part=OutputText(text="")))  # fmt: skip
        return out

    def _item(self, status: str) -> OutputItem:
        if self.kind == "reasoning":
            return ReasoningItem(id=self.item_id, content=[ReasoningText(text=self.text)],
                                 status=status)  # fmt: skip
        if self.kind == "message":
            return OutputMessage(id=self.item_id, status=status,
                                 content=[OutputText(text=self.text)])  # fmt: skip
        call_id, name = self.call
        return FunctionCallItem(id=self.item_id, call_id=call_id, name=name,
                                arguments=self.text, status=status)  # fmt: skip

    def close(self) -> list[bytes]:
        if self.kind is None:
            return []
        where = {"item_id": self.item_id, "output_index": self.index}
        out = []
        if self.kind == "reasoning":
            out.append(self.event("response.reasoning_text.done", **where, content_index=0,
                                  text=self.text))  # fmt: skip
        elif self.kind == "message":
            part = OutputText(text=self.text)
            out.append(self.event("response.output_text.done", **where, content_index=0,
                                  text=self.text, logprobs=[]))  # fmt: skip
            out.append(self.event("response.content_part.done", **where, content_index=0,
                                  part=part))  # fmt: skip
        else:
            out.append(self.event("response.function_call_arguments.done", **where,
                                  name=self.call[1], arguments=self.text))  # fmt: skip
        item = self._item(status="completed")
        out.append(self.event("response.output_item.done", output_index=self.index, item=item))
        self.done.append((self.kind, item))
        self.kind = None
        return out

    def items(self) -> list[OutputItem]:
        return [item for _, item in self.done]


class _Draft:
    """The parts of the response object fixed at the start; builds each stage of it."""

    def __init__(
        self, req: ResponsesRequest, response_id: str, model: str, temperature: float, top_p: float
    ) -> None:
        self.req = req
        self.response_id = response_id
        self.model = model
        self.temperature = temperature
        self.top_p = top_p
        self.created_at = int(time.time())

    @staticmethod
    def new_item_id(kind: str) -> str:
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        return f"{prefix}_{uuid.uuid4().hex}"

    def items(
        self, reasoning: str, content: str, calls: list[tuple[str, str, str]]
    ) -> list[OutputItem]:
        """The output items of a whole (unstreamed) answer, in the order a stream opens them."""
        out: list[OutputItem] = []
        if reasoning:
            out.append(ReasoningItem(id=self.new_item_id("reasoning"),
                                     content=[ReasoningText(text=reasoning)]))  # fmt: skip
        if content:
            out.append(OutputMessage(id=self.new_item_id("message"), status="completed",
                                     content=[OutputText(text=content)]))  # fmt: skip
        for call_id, name, arguments in calls:
            out.append(FunctionCallItem(id=self.new_item_id("function_call"), call_id=call_id,
                                        name=name, arguments=arguments))  # fmt: skip
        return out

    def _response(self, status: str, output: list[OutputItem], **fields: Any) -> ResponseObject:
        req = self.req
        return ResponseObject(
            id=self.response_id,
            created_at=self.created_at,
            model=self.model,
            status=status,
            output=output,
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            metadata=req.metadata,
            parallel_tool_calls=req.parallel_tool_calls is not False,
            previous_response_id=req.previous_response_id,
            store=req.store,
            temperature=self.temperature,
            tool_choice=req.tool_choice or ("auto" if req.tools else "none"),
            tools=list(req.tools or []),
            top_p=self.top_p,
            user=req.user,
            text=req.text or {"format": {"type": "text"}},
            **fields,
        )

    def in_progress(self) -> ResponseObject:
        return self._response("in_progress", [])

    def final(
        self, group: RequestGroup, items: list[OutputItem], error: str | None = None
    ) -> ResponseObject:
        gen = group.gens[0]
        if error is not None:
            error_info = {"code": "server_error", "message": error}
            return self._response("failed", items, usage=_usage(group), error=error_info)
        status, details = "completed", None
        if gen.finish_reason == "length":
            status, details = "incomplete", {"reason": "max_output_tokens"}
        elif gen.finish_reason == "abort":
            status = "cancelled"
        if status != "completed":
            for item in items:
                if isinstance(item, OutputMessage):
                    item.status = "incomplete"
        return self._response(status, items, usage=_usage(group), incomplete_details=details)


def _usage(group: RequestGroup) -> ResponseUsage:
    u = group.usage()
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
    return ResponseUsage(
        input_tokens=u.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached),
        output_tokens=u.completion_tokens,
        output_tokens_details=OutputTokensDetails(),
        total_tokens=u.total_tokens,
    )


def _not_found(response_id: str) -> APIError:
    return APIError(
        f"no stored response has id {response_id!r}", 404, "response_id", "response_not_found"
    )

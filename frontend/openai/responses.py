"""POST /v1/responses: OpenAI's Responses API for text, streaming and not.

The prompt is the chat template applied to `instructions` + `input`; the output is one assistant
message with one output_text part. A stream is the event sequence OpenAI sends for text:
response.created, response.in_progress, response.output_item.added, response.content_part.added,
response.output_text.delta (one per text chunk), response.output_text.done,
response.content_part.done, response.output_item.done, and response.completed (response.incomplete
when max_output_tokens cut the text; response.failed when the engine failed), each with its
sequence_number. Like OpenAI, and unlike chat completions, the stream has no [DONE] line.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from frontend.engine.client import EngineDeadError
from frontend.openai.protocol import decode_request
from frontend.openai.responses_protocol import (
    InputTokensDetails,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from frontend.serving.base import OpenAIServing, json_response, streaming_response
from frontend.serving.generation import RequestFailedError, RequestGroup

_json = msgspec.json.Encoder()


class ResponsesServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, http_request: Request) -> Response:
        s = self.serving
        req = decode_request(await http_request.body(), ResponsesRequest)
        s.check_model(req.model)
        prompt_ids = s.tokenizer.apply_chat_template(req.messages(), add_generation_prompt=True)
        response_id, keys, headers = s.request_ids(http_request, "resp_", req.request_id)
        group = s.start(
            response_id,
            keys,
            req.to_sampling(),
            [prompt_ids],
            "input",
            structured_output=req.output_constraint(),
        )
        params = group.gens[0].params
        draft = _Draft(req, response_id, s.model_name, params.temperature, params.top_p)
        if req.stream:
            return streaming_response(self._events(group, draft), group, headers)
        texts = await group.collect_unless_disconnected(http_request)
        if texts is None:
            return Response(status_code=499)
        return json_response(draft.final(group, texts[0]), headers=headers)

    async def _events(self, group: RequestGroup, draft: _Draft) -> AsyncIterator[bytes]:
        seq = iter(range(1 << 62))

        def event(kind: str, **fields: Any) -> bytes:
            body = {"type": kind, "sequence_number": next(seq), **fields}
            return b"event: " + kind.encode() + b"\ndata: " + _json.encode(body) + b"\n\n"

        where = {"item_id": draft.message_id, "output_index": 0}
        yield event("response.created", response=draft.in_progress())
        yield event("response.in_progress", response=draft.in_progress())
        item = OutputMessage(id=draft.message_id, status="in_progress", content=[])
        yield event("response.output_item.added", output_index=0, item=item)
        yield event(
            "response.content_part.added", **where, content_index=0, part=OutputText(text="")
        )
        parts: list[str] = []
        try:
            async for _, text in group.merged():
                if text:
                    parts.append(text)
                    yield event(
                        "response.output_text.delta", **where, content_index=0, delta=text,
                        logprobs=[],
                    )  # fmt: skip
        except (EngineDeadError, RequestFailedError) as e:
            failed = draft.failed(group, "".join(parts), str(e))
            yield event("response.failed", response=failed)
            return
        final = draft.final(group, "".join(parts))
        message = final.output[0]
        part = message.content[0]
        yield event(
            "response.output_text.done", **where, content_index=0, text=part.text, logprobs=[]
        )
        yield event("response.content_part.done", **where, content_index=0, part=part)
        yield event("response.output_item.done", output_index=0, item=message)
        kind = "response.completed" if final.status == "completed" else "response.incomplete"
        yield event(kind, response=final)


class _Draft:
    """The parts of the response object fixed at the start; builds each stage of it."""

    def __init__(
        self, req: ResponsesRequest, response_id: str, model: str, temperature: float, top_p: float
    ) -> None:
        self.req = req
        self.response_id = response_id
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.temperature = temperature
        self.top_p = top_p
        self.created_at = int(time.time())

    def _response(self, status: str, output: list[OutputMessage], **fields: Any) -> ResponseObject:
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
            temperature=self.temperature,
            tool_choice=req.tool_choice if isinstance(req.tool_choice, str) else "auto",
            top_p=self.top_p,
            user=req.user,
            text=req.text or {"format": {"type": "text"}},
            **fields,
        )

    def in_progress(self) -> ResponseObject:
        return self._response("in_progress", [])

    def final(self, group: RequestGroup, text: str) -> ResponseObject:
        gen = group.gens[0]
        status, details = "completed", None
        if gen.finish_reason == "length":
            status, details = "incomplete", {"reason": "max_output_tokens"}
        elif gen.finish_reason == "abort":
            status = "cancelled"
        message = OutputMessage(
            id=self.message_id,
            status="completed" if status == "completed" else "incomplete",
            content=[OutputText(text=text)],
        )
        return self._response(status, [message], usage=_usage(group), incomplete_details=details)

    def failed(self, group: RequestGroup, text: str, error: str) -> ResponseObject:
        message = OutputMessage(
            id=self.message_id, status="incomplete", content=[OutputText(text=text)]
        )
        return self._response(
            "failed", [message], usage=_usage(group),
            error={"code": "server_error", "message": error},
        )  # fmt: skip


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

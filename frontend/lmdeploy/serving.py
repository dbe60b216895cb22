"""LMDeploy's native routes: POST /generate and POST /abort_request.

/generate takes text (tokenized as is, no chat template) or token ids, with `image_data` for models
served with images (text holds one image marker per image; token ids come expanded by the
client's own HF processor: ImagePrompts.make_for_generate), and answers
{"text", "output_ids", "meta_info"}; streamed, each SSE event carries the new text and token ids, and
the stream ends with [DONE], as LMDeploy's does. A /generate request runs under a session id (the
client's, or a new one) by which /abort_request can stop it; any request can also be aborted by its
response id or X-Request-Id, or all at once. An aborted request ends normally with finish reason
"abort" and the text it had so far.

SGLang's /generate shares the path: server/generate.py tells the bodies apart and sends LMDeploy's
here.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from enginecore.messages import Logprobs, MultiModalItem
from frontend.common.decoding import decode_request
from frontend.common.errors import APIError, bad_request
from frontend.common.http import json_response, sse
from frontend.lmdeploy.protocol import (
    AbortRequest,
    GenerateMetaInfo,
    GenerateRequest,
    GenerateResponse,
)
from frontend.serving.base import OpenAIServing
from frontend.serving.generation import Generation, RequestGroup
from frontend.text.logprobs import lmdeploy_logprobs
from frontend.text.structured_outputs import structured_output_spec


class LMDeployServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self._session_ids = itertools.count(1)

    # ------------------------------------------------------------------ /generate

    async def generate(self, http_request: Request, body: bytes) -> Response:
        s = self.serving
        req = decode_request(body, GenerateRequest)
        session_id = self._session_id(req.session_id)
        if req.prompt is not None:
            prompt_ids = s.encode_prompt(req.prompt, True, "prompt")
            param = "prompt"
        else:
            assert req.input_ids is not None
            prompt_ids = s.encode_prompt(req.input_ids, False, "input_ids")
            param = "input_ids"
        refs = req.image_refs()
        mm_items: list[MultiModalItem] = []
        if refs:
            if s.images is None:
                raise bad_request("this model is served without image inputs", "image_data")
            prompt = req.prompt if req.prompt is not None else prompt_ids
            prompt_ids, mm_items = await s.images.make_for_generate(prompt, refs, "image_data")
        request_id, keys, headers = s.request_ids(http_request, "generate-")
        logprobs = 0 if req.return_logprob else None  # the sampled token's only
        group = s.start(
            request_id, keys, req.to_sampling(), [prompt_ids], param, session_id=session_id, logprobs=logprobs,
            structured_output=structured_output_spec(req.response_format),
            lora=s.check_adapter(req.adapter_name, "adapter_name"), mm_items=mm_items,
        )  # fmt: skip
        if req.stream:
            return s.sse_response(self._generate_stream(group), group, headers)
        texts = await group.collect_unless_disconnected(http_request)
        if texts is None:
            return Response(status_code=499)
        gen = group.gens[0]
        meta = _meta_info(gen, gen.all_output_logprobs)
        return json_response(
            GenerateResponse(texts[0], gen.output_token_ids, meta), headers=headers
        )

    def _session_id(self, requested: int | None) -> int:
        inflight = self.serving.inflight
        if requested is None or requested == -1:
            while (sid := next(self._session_ids)) and inflight.find_session(sid) is not None:
                pass
            return sid
        if inflight.find_session(requested) is not None:
            raise bad_request(f"The session_id {requested} is occupied.", "session_id")
        return requested

    async def _generate_stream(self, group: RequestGroup) -> AsyncIterator[bytes]:
        gen = group.gens[0]
        num_sent = 0
        async for _, text in group.merged():
            new_ids = gen.output_token_ids[num_sent:]
            num_sent = len(gen.output_token_ids)
            if text or new_ids or gen.is_finished:
                new_logprobs = gen.new_logprobs
                if new_logprobs is None and gen.params.logprobs is not None:
                    new_logprobs = Logprobs()
                yield sse(GenerateResponse(text, new_ids, _meta_info(gen, new_logprobs)))

    # ------------------------------------------------------------------ /abort_request

    async def abort_request(self, http_request: Request) -> Response:
        req = decode_request(await http_request.body(), AbortRequest)
        inflight = self.serving.inflight
        groups: list[RequestGroup] = []
        if req.abort_all:
            groups = inflight.all()
        else:
            if req.session_id is not None and req.session_id != -1:
                group = inflight.find_session(req.session_id)
                if group is None:
                    raise _not_found(f"Session {req.session_id} not found.", "session_id")
                groups.append(group)
            rid = req.target_request_id
            if rid is not None:
                found = inflight.find(rid)
                if not found:
                    param = "request_id" if req.request_id is not None else "rid"
                    raise _not_found(f"Request {rid!r} not found.", param)
                groups += [g for g in found if g not in groups]
        info = req.finish_info()
        running = [g for g in groups if not all(gen.is_finished for gen in g.gens)]
        for group in running:
            group.cancel(info)
        return json_response({"aborted": [g.keys[0] for g in running]})


def _meta_info(gen: Generation, logprobs: Logprobs | None) -> GenerateMetaInfo:
    """`logprobs`: of the tokens the response carries (None: the request did not ask)."""
    finish: dict[str, Any] | None = None
    if gen.is_finished:
        finish = {"type": gen.finish_reason}
        if gen.finish_reason == "abort" and gen.abort_info is not None:
            finish = dict(gen.abort_info)
    token_logprobs = lmdeploy_logprobs(logprobs) if logprobs is not None else None
    return GenerateMetaInfo(gen.num_prompt_tokens, gen.num_output_tokens, finish, token_logprobs)


def _not_found(message: str, param: str) -> APIError:
    return APIError(message, 404, param, "request_not_found")

"""OpenAI chat and completions: requests to engine requests, responses and SSE streams back.

OpenAIServing also holds what every generating route shares (responses.py and native.py use it):
model-name checks, request ids (X-Request-Id), prompt encoding, request -> SamplingParams, and
starting a RequestGroup registered for POST /abort_request. Every request ends in an answer: a
response, a final chunk, or an OpenAI error (4xx for the client's mistakes, 503 when the engine is
gone). A client that goes away aborts its requests in the engine core, which frees their KV blocks.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from enginecore.messages import SamplingParams
from frontend.detokenizer import IncrementalDetokenizer
from frontend.engine_client import EngineClient, EngineDeadError
from frontend.errors import APIError, bad_request, engine_dead_error
from frontend.generation import (
    Generation,
    InflightRequests,
    RequestFailedError,
    RequestGroup,
    stream_and_close,
    unique_ids,
)
from frontend.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    DeltaMessage,
    decode_request,
)

if TYPE_CHECKING:
    from frontend.metrics import Metrics
    from frontend.tokenizer import Tokenizer

_json = msgspec.json.Encoder()
_DONE = b"data: [DONE]\n\n"
REQUEST_ID_HEADER = "X-Request-Id"


class SamplingRequest(Protocol):
    """What every generating route's request offers for SamplingParams and the detokenizer."""

    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    seed: int | None
    stop_token_ids: list[int] | None
    ignore_eos: bool | None
    skip_special_tokens: bool | None
    include_stop_str_in_output: bool | None

    @property
    def requested_max_tokens(self) -> int | None: ...

    @property
    def max_tokens_param(self) -> str: ...

    @property
    def stop_strings(self) -> list[str]: ...


def sse(obj: Any) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_json.encode(obj), status, headers=headers, media_type="application/json")


def error_response(err: APIError) -> Response:
    return json_response(err.to_response(), err.status)


class OpenAIServing:
    """The handlers behind /v1/chat/completions and /v1/completions, and their shared parts."""

    def __init__(
        self,
        engine: EngineClient,
        tokenizer: Tokenizer,
        model_names: Sequence[str],
        max_model_len: int,
        vocab_size: int,
        metrics: Metrics | None = None,
    ) -> None:
        assert model_names, "at least one served model name"
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_names = list(model_names)
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.metrics = metrics
        self.inflight = InflightRequests()

    @property
    def model_name(self) -> str:
        """The name responses carry: the first served name (as vLLM)."""
        return self.model_names[0]

    # ------------------------------------------------------------------ chat

    async def chat(self, http_request: Request) -> Response:
        req = decode_request(await http_request.body(), ChatCompletionRequest)
        self.check_model(req.model)
        prompt_ids = self.tokenizer.apply_chat_template(
            req.normalized_messages(),
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            add_special_tokens=req.add_special_tokens,
            chat_template_kwargs=req.chat_template_kwargs,
        )
        request_id, keys, headers = self.request_ids(http_request, "chatcmpl-", req.request_id)
        group = self.start(request_id, keys, req, [prompt_ids], "messages")
        created = int(time.time())
        if req.is_stream:
            return self.sse_response(self._chat_stream(group, req, created), group, headers)
        texts = await group.collect_unless_disconnected(http_request)
        if texts is None:
            return Response(status_code=499)
        gen = group.gens[0]
        message = ChatMessage("assistant", texts[0])
        choice = ChatCompletionResponseChoice(0, message, None, gen.finish_reason, gen.stop_reason)
        response = ChatCompletionResponse(
            request_id, "chat.completion", created, self.model_name, [choice], group.usage()
        )
        return json_response(response, headers=headers)

    async def _chat_stream(
        self, group: RequestGroup, req: ChatCompletionRequest, created: int
    ) -> AsyncIterator[bytes]:
        request_id = group.keys[0]

        def chunk(gen: Generation, delta: DeltaMessage, finish: str | None = None) -> bytes:
            choice = ChatCompletionResponseStreamChoice(0, delta, None, finish, gen.stop_reason)
            usage = gen.usage() if continuous_usage else None
            return sse(
                ChatCompletionStreamResponse(
                    request_id, "chat.completion.chunk", created, self.model_name, [choice], usage
                )
            )

        include_usage, continuous_usage = _usage_options(req)
        is_first = True
        async for i, text in group.merged():
            gen = group.gens[i]
            if is_first:
                # NOTE: sent with the first output, not before: clients (and vLLM's benchmark)
                # take the first chunk's arrival as the time to first token.
                yield chunk(gen, DeltaMessage(role="assistant", content=""))
                is_first = False
            if gen.is_finished:
                yield chunk(gen, DeltaMessage(content=text or None), gen.finish_reason)
            elif text:
                yield chunk(gen, DeltaMessage(content=text))
        if include_usage:
            yield sse(
                ChatCompletionStreamResponse(
                    request_id, "chat.completion.chunk", created, self.model_name, [],
                    group.usage(),
                )
            )  # fmt: skip

    # ------------------------------------------------------------------ completions

    async def completion(self, http_request: Request) -> Response:
        req = decode_request(await http_request.body(), CompletionRequest)
        self.check_model(req.model)
        prompts = [
            self.encode_prompt(p, req.add_special_tokens, "prompt")
            for p in req.normalized_prompts()
        ]
        request_id, keys, headers = self.request_ids(http_request, "cmpl-", req.request_id)
        group = self.start(request_id, keys, req, prompts, "prompt")
        created = int(time.time())
        if req.is_stream:
            return self.sse_response(self._completion_stream(group, req, created), group, headers)
        texts = await group.collect_unless_disconnected(http_request)
        if texts is None:
            return Response(status_code=499)
        choices = [
            CompletionResponseChoice(i, text, None, gen.finish_reason, gen.stop_reason)
            for i, (text, gen) in enumerate(zip(texts, group.gens))
        ]
        response = CompletionResponse(
            request_id, "text_completion", created, self.model_name, choices, group.usage()
        )
        return json_response(response, headers=headers)

    async def _completion_stream(
        self, group: RequestGroup, req: CompletionRequest, created: int
    ) -> AsyncIterator[bytes]:
        request_id = group.keys[0]
        include_usage, continuous_usage = _usage_options(req)
        async for i, text in group.merged():
            gen = group.gens[i]
            if not text and not gen.is_finished:
                continue
            choice = CompletionResponseChoice(i, text, None, gen.finish_reason, gen.stop_reason)
            yield sse(
                CompletionStreamResponse(
                    request_id, "text_completion", created, self.model_name, [choice],
                    gen.usage() if continuous_usage else None,
                )
            )  # fmt: skip
        if include_usage:
            yield sse(
                CompletionStreamResponse(
                    request_id, "text_completion", created, self.model_name, [], group.usage()
                )
            )

    # ------------------------------------------------------------------ shared

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            served = ", ".join(f"`{m}`" for m in self.model_names)
            raise APIError(
                f"The model `{model}` does not exist. This server serves {served}.",
                404,
                "model",
                "model_not_found",
            )

    def request_ids(
        self, http_request: Request, prefix: str, body_request_id: str | None = None
    ) -> tuple[str, list[str], dict[str, str]]:
        """(response id, ids the request can be aborted by, response headers).

        As vLLM: the X-Request-Id header, else the body's request_id, else a random id, is the
        base of the response id; the header is echoed (or carries the response id).
        """
        client_id = http_request.headers.get(REQUEST_ID_HEADER) or body_request_id
        request_id = prefix + (client_id or uuid.uuid4().hex)
        keys = [request_id] if client_id in (None, request_id) else [request_id, client_id]
        return request_id, keys, {REQUEST_ID_HEADER: client_id or request_id}

    def encode_prompt(
        self, prompt: str | list[int], add_special_tokens: bool, param: str
    ) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(
                f"prompt token ids must be in [0, {self.vocab_size}); got {bad[0]}", param
            )
        return list(prompt)

    def start(
        self,
        request_id: str,
        keys: list[str],
        req: SamplingRequest,
        prompts: list[list[int]],
        prompt_param: str,
        session_id: int | None = None,
    ) -> RequestGroup:
        """Checks every prompt, then starts one engine request per prompt (all or none)."""
        params = [self.sampling_params(req, ids, prompt_param) for ids in prompts]
        if self.engine.is_dead:
            raise engine_dead_error(self.engine.dead_reason)
        engine_ids = unique_ids(request_id, len(prompts), self.engine.is_in_flight)
        gens: list[Generation] = []
        try:
            for engine_id, prompt_ids, p in zip(engine_ids, prompts, params):
                detokenizer = IncrementalDetokenizer(
                    self.tokenizer.backend,
                    prompt_ids,
                    skip_special_tokens=req.skip_special_tokens is not False,
                    stop=req.stop_strings,
                    include_stop_str_in_output=bool(req.include_stop_str_in_output),
                )
                gens.append(
                    Generation(self.engine, engine_id, prompt_ids, p, detokenizer, self.metrics)
                )
        except EngineDeadError as e:
            raise engine_dead_error(str(e)) from e
        return RequestGroup(keys, gens, self.inflight, session_id)

    def sampling_params(
        self, req: SamplingRequest, prompt_ids: list[int], prompt_param: str
    ) -> SamplingParams:
        n_prompt, limit = len(prompt_ids), self.max_model_len
        if n_prompt == 0:
            raise bad_request("the prompt is empty (0 tokens)", prompt_param)
        if n_prompt >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your prompt "
                f"has {n_prompt} tokens, which leaves no room for output. Please shorten it.",
                prompt_param,
            )
        max_tokens = req.requested_max_tokens
        if max_tokens is None:
            max_tokens = limit - n_prompt
        elif n_prompt + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n_prompt + max_tokens} tokens ({n_prompt} in the {prompt_param}, {max_tokens} "
                "in the completion). Please reduce the length of the prompt or completion.",
                req.max_tokens_param,
            )
        stop_token_ids = list(req.stop_token_ids or [])
        bad = [t for t in stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(
                f"stop_token_ids must be in [0, {self.vocab_size}); got {bad[0]}", "stop_token_ids"
            )
        defaults = self.tokenizer.generation_defaults
        top_k = req.top_k if req.top_k is not None else int(defaults.get("top_k", 0))
        return SamplingParams(
            temperature=_pick(req.temperature, defaults, "temperature", 1.0),
            top_p=_pick(req.top_p, defaults, "top_p", 1.0),
            top_k=max(top_k, 0),  # -1 and 0 both mean "all tokens"
            min_p=_pick(req.min_p, defaults, "min_p", 0.0),
            seed=req.seed,
            max_tokens=max_tokens,
            stop_token_ids=stop_token_ids,
            eos_token_ids=list(self.tokenizer.eos_token_ids),
            ignore_eos=bool(req.ignore_eos),
        )

    def sse_response(
        self, body: AsyncIterator[bytes], group: RequestGroup, headers: dict[str, str]
    ) -> StreamingResponse:
        """An OpenAI-style SSE stream: engine failures become an error event, then [DONE]."""
        return streaming_response(_openai_framed(body), group, headers)


def streaming_response(
    body: AsyncIterator[bytes], group: RequestGroup, headers: dict[str, str]
) -> StreamingResponse:
    """An SSE response that closes `group` however it ends."""
    return _GroupStreamingResponse(body, group, headers)


class _GroupStreamingResponse(StreamingResponse):
    def __init__(
        self, body: AsyncIterator[bytes], group: RequestGroup, headers: dict[str, str]
    ) -> None:
        super().__init__(
            stream_and_close(body, group), media_type="text/event-stream", headers=headers
        )
        self.group = group

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # NOTE: the stream's own `finally` never runs if the client left before it started
            # (a generator never started is not run when closed): this one always does.
            self.group.close()


def _pick(value: float | None, defaults: dict[str, Any], key: str, fallback: float) -> float:
    return float(value if value is not None else defaults.get(key, fallback))


def _usage_options(req: ChatCompletionRequest | CompletionRequest) -> tuple[bool, bool]:
    opts = req.stream_options
    if opts is None:
        return False, False
    return bool(opts.include_usage), bool(opts.include_usage and opts.continuous_usage_stats)


async def _openai_framed(body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Ends every stream with [DONE]; engine failures become an error event first."""
    try:
        async for chunk in body:
            yield chunk
    except EngineDeadError as e:
        yield sse(engine_dead_error(str(e)).to_response())
    except RequestFailedError as e:
        yield sse(APIError(str(e), 500, None, "engine_error").to_response())
    yield _DONE

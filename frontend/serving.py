"""OpenAI requests to engine requests and back: prompts, sampling parameters, SSE framing.

One `Generation` per request turns the engine's token ids into released text (detokenizer, stop
strings) and knows when and why the request finished. Every request ends in an answer: a response,
a final chunk, or an OpenAI error (4xx for the client's mistakes, 503 when the engine is gone).
A client that goes away aborts its request in the engine core, which frees its KV-cache blocks.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from enginecore.messages import EngineCoreRequest, FinishReason, SamplingParams
from frontend.detokenizer import IncrementalDetokenizer
from frontend.engine_client import EngineClient, EngineDeadError
from frontend.errors import APIError, bad_request, engine_dead_error
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
    PromptTokensDetails,
    UsageInfo,
    decode_request,
)

if TYPE_CHECKING:
    from frontend.tokenizer import Tokenizer

_json = msgspec.json.Encoder()
_DONE = b"data: [DONE]\n\n"


class RequestFailedError(RuntimeError):
    """The engine ended one request with an error while staying up."""


def sse(obj: Any) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(_json.encode(obj), status, media_type="application/json")


def error_response(err: APIError) -> Response:
    return json_response(err.to_response(), err.status)


class Generation:
    """One request in flight: engine outputs in, released text out, and why it finished."""

    def __init__(
        self,
        engine: EngineClient,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        detokenizer: IncrementalDetokenizer,
    ) -> None:
        self.engine = engine
        self.request_id = request_id
        self.num_prompt_tokens = len(prompt_token_ids)
        self.user_stop_token_ids = set(params.stop_token_ids)
        self.detokenizer = detokenizer
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.stream = engine.add_request(
            EngineCoreRequest(request_id, prompt_token_ids, params, arrival_time=time.time())
        )

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_output_tokens(self) -> int:
        return self.detokenizer.num_tokens

    def usage(self) -> UsageInfo:
        n_in, n_out = self.num_prompt_tokens, self.num_output_tokens
        return UsageInfo(n_in, n_in + n_out, n_out, PromptTokensDetails(self.num_cached_tokens))

    async def next_text(self) -> str:
        """Waits for the engine's next tokens; returns the text they release (may be empty).

        Raises EngineDeadError or RequestFailedError. Sets finish_reason on the last call.
        """
        out = await self.stream.next()
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if out.finish_reason == FinishReason.ERROR:
            self.finish_reason = "error"
            raise RequestFailedError(out.error or "the engine failed to serve this request")
        by_stop_token = out.finish_reason == FinishReason.STOP and bool(out.new_token_ids)
        self.detokenizer.update(out.new_token_ids, ends_with_stop_token=by_stop_token)
        if self.detokenizer.is_stopped:
            self.finish_reason = FinishReason.STOP.value
            self.stop_reason = self.detokenizer.stop_reason
            self.abort()  # the engine would go on generating: a stop string is ours to find
        elif out.finish_reason is not None:
            self.finish_reason = out.finish_reason.value
            if by_stop_token and out.new_token_ids[-1] in self.user_stop_token_ids:
                self.stop_reason = out.new_token_ids[-1]  # vLLM: the stop token id; None for EOS
        return self.detokenizer.take_new_text(final=self.is_finished)

    async def collect(self) -> str:
        parts = []
        while not self.is_finished:
            parts.append(await self.next_text())
        return "".join(parts)

    def abort(self) -> None:
        """Stops the request in the engine if it is still running there (no-op otherwise)."""
        self.engine.abort([self.request_id])


class OpenAIServing:
    """The handlers behind /v1/chat/completions and /v1/completions."""

    def __init__(
        self,
        engine: EngineClient,
        tokenizer: Tokenizer,
        model_name: str,
        max_model_len: int,
        vocab_size: int,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    # ------------------------------------------------------------------ chat

    async def chat(self, http_request: Request) -> Response:
        req: ChatCompletionRequest = decode_request(
            await http_request.body(), ChatCompletionRequest
        )
        self._check_model(req.model)
        prompt_ids = self.tokenizer.apply_chat_template(
            req.normalized_messages(),
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            add_special_tokens=req.add_special_tokens,
            chat_template_kwargs=req.chat_template_kwargs,
        )
        gen = self._start(f"chatcmpl-{uuid.uuid4().hex}", req, prompt_ids, "messages")
        created = int(time.time())
        if req.is_stream:
            return _streaming_response(self._chat_stream(gen, req, created), gen)
        text = await _collect_unless_disconnected(gen, http_request)
        if text is None:
            return Response(status_code=499)
        choice = ChatCompletionResponseChoice(
            0, ChatMessage("assistant", text), None, gen.finish_reason, gen.stop_reason
        )
        return json_response(
            ChatCompletionResponse(
                gen.request_id, "chat.completion", created, self.model_name, [choice], gen.usage()
            )
        )

    async def _chat_stream(
        self, gen: Generation, req: ChatCompletionRequest, created: int
    ) -> AsyncIterator[bytes]:
        def chunk(delta: DeltaMessage, finish: str | None = None) -> bytes:
            choice = ChatCompletionResponseStreamChoice(0, delta, None, finish, gen.stop_reason)
            return sse(
                ChatCompletionStreamResponse(
                    gen.request_id,
                    "chat.completion.chunk",
                    created,
                    self.model_name,
                    [choice],
                    gen.usage() if continuous_usage else None,
                )
            )

        include_usage, continuous_usage = _usage_options(req)
        is_first = True
        async for text in _texts(gen):
            if is_first:
                # NOTE: sent with the first output, not before: clients (and vLLM's benchmark)
                # take the first chunk's arrival as the time to first token.
                yield chunk(DeltaMessage(role="assistant", content=""))
                is_first = False
            if gen.is_finished:
                yield chunk(DeltaMessage(content=text or None), gen.finish_reason)
            elif text:
                yield chunk(DeltaMessage(content=text))
        if include_usage:
            yield sse(
                ChatCompletionStreamResponse(
                    gen.request_id,
                    "chat.completion.chunk",
                    created,
                    self.model_name,
                    [],
                    gen.usage(),
                )
            )

    # ------------------------------------------------------------------ completions

    async def completion(self, http_request: Request) -> Response:
        req: CompletionRequest = decode_request(await http_request.body(), CompletionRequest)
        self._check_model(req.model)
        prompt = req.normalized_prompt()
        if isinstance(prompt, str):
            prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens)
        else:
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise bad_request(
                    f"prompt token ids must be in [0, {self.vocab_size}); got {bad[0]}", "prompt"
                )
            prompt_ids = prompt
        gen = self._start(f"cmpl-{uuid.uuid4().hex}", req, prompt_ids, "prompt")
        created = int(time.time())
        if req.is_stream:
            return _streaming_response(self._completion_stream(gen, req, created), gen)
        text = await _collect_unless_disconnected(gen, http_request)
        if text is None:
            return Response(status_code=499)
        choice = CompletionResponseChoice(0, text, None, gen.finish_reason, gen.stop_reason)
        return json_response(
            CompletionResponse(
                gen.request_id, "text_completion", created, self.model_name, [choice], gen.usage()
            )
        )

    async def _completion_stream(
        self, gen: Generation, req: CompletionRequest, created: int
    ) -> AsyncIterator[bytes]:
        include_usage, continuous_usage = _usage_options(req)
        async for text in _texts(gen):
            if not text and not gen.is_finished:
                continue
            choice = CompletionResponseChoice(0, text, None, gen.finish_reason, gen.stop_reason)
            yield sse(
                CompletionStreamResponse(
                    gen.request_id,
                    "text_completion",
                    created,
                    self.model_name,
                    [choice],
                    gen.usage() if continuous_usage else None,
                )
            )
        if include_usage:
            yield sse(
                CompletionStreamResponse(
                    gen.request_id, "text_completion", created, self.model_name, [], gen.usage()
                )
            )

    # ------------------------------------------------------------------ shared

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                f"The model `{model}` does not exist. This server serves `{self.model_name}`.",
                404,
                "model",
                "model_not_found",
            )

    def _start(
        self,
        request_id: str,
        req: ChatCompletionRequest | CompletionRequest,
        prompt_ids: list[int],
        prompt_param: str,
    ) -> Generation:
        params = self._sampling_params(req, prompt_ids, prompt_param)
        if self.engine.is_dead:
            raise engine_dead_error(self.engine.dead_reason)
        detokenizer = IncrementalDetokenizer(
            self.tokenizer.backend,
            prompt_ids,
            skip_special_tokens=req.skip_special_tokens,
            stop=req.stop_strings,
            include_stop_str_in_output=req.include_stop_str_in_output,
        )
        try:
            return Generation(self.engine, request_id, prompt_ids, params, detokenizer)
        except EngineDeadError as e:
            raise engine_dead_error(str(e)) from e

    def _sampling_params(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        prompt_ids: list[int],
        prompt_param: str,
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
            param = (
                "max_completion_tokens"
                if max_tokens == getattr(req, "max_completion_tokens", None)
                else "max_tokens"
            )
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n_prompt + max_tokens} tokens ({n_prompt} in the {prompt_param}, {max_tokens} "
                "in the completion). Please reduce the length of the prompt or completion.",
                param,
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
            ignore_eos=req.ignore_eos,
        )


def _pick(value: float | None, defaults: dict[str, Any], key: str, fallback: float) -> float:
    return float(value if value is not None else defaults.get(key, fallback))


def _usage_options(req: ChatCompletionRequest | CompletionRequest) -> tuple[bool, bool]:
    opts = req.stream_options
    if opts is None:
        return False, False
    return bool(opts.include_usage), bool(opts.include_usage and opts.continuous_usage_stats)


async def _texts(gen: Generation) -> AsyncIterator[str]:
    while not gen.is_finished:
        yield await gen.next_text()


def _streaming_response(body: AsyncIterator[bytes], gen: Generation) -> StreamingResponse:
    return StreamingResponse(_framed(body, gen), media_type="text/event-stream")


async def _framed(body: AsyncIterator[bytes], gen: Generation) -> AsyncIterator[bytes]:
    """Ends every stream with [DONE]; engine failures become an error event first."""
    try:
        try:
            async for chunk in body:
                yield chunk
        except EngineDeadError as e:
            yield sse(engine_dead_error(str(e)).to_response())
        except RequestFailedError as e:
            yield sse(APIError(str(e), 500, None, "engine_error").to_response())
        yield _DONE
    finally:
        # NOTE: runs when the client disconnects too (starlette cancels the stream task).
        gen.abort()


async def _collect_unless_disconnected(gen: Generation, http_request: Request) -> str | None:
    """The whole output, or None if the client went away first (the request is then aborted)."""
    collect = asyncio.ensure_future(gen.collect())
    disconnect = asyncio.ensure_future(_wait_for_disconnect(http_request.receive))
    try:
        await asyncio.wait({collect, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        if collect.done():
            try:
                return collect.result()
            except EngineDeadError as e:
                raise engine_dead_error(str(e)) from e
            except RequestFailedError as e:
                raise APIError(str(e), 500, None, "engine_error") from e
        return None
    finally:
        collect.cancel()
        disconnect.cancel()
        gen.abort()


async def _wait_for_disconnect(receive: Callable[[], Any]) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return

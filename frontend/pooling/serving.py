"""The pooling routes: POST /v1/embeddings, /pooling, /classify, /score, and LMDeploy's /v1/encode.

A pooling model (EngineReady.task "embed", "classify" or "reward") runs each input once, prefill
only, and its engine request ends with one output carrying `pooled`: the pooled hidden state, or
the score head's logits. Inputs become engine requests here (text, token ids, or a conversation
through the chat template; /score pair-encodes its texts), all of one HTTP request at once; this
module then turns the vectors into each API's answer (pooling/protocol.py has the arithmetic). A
route the served task cannot answer, here or a generating route (`require_task`), is a 400 that
names the task. A client that goes away aborts its requests in the engine core; POST
/abort_request does not know pooling requests (each is one prefill, over in a step or a few).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from msgspec import UNSET
from starlette.requests import Request
from starlette.responses import Response

from enginecore.messages import EngineCoreRequest, EngineReady, FinishReason, SamplingParams
from frontend.common.decoding import normalize_messages
from frontend.common.errors import APIError, bad_request, engine_dead_error
from frontend.common.http import json_response
from frontend.common.protocol import UsageInfo
from frontend.engine.client import EngineDeadError, RequestStream
from frontend.pooling.protocol import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    EncodeRequest,
    EncodeResponse,
    PoolingData,
    PoolingInput,
    PoolingRequest,
    PoolingResponse,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    class_probabilities,
    cosine_similarity,
    decode_pooling_request,
    embedding_vector,
    encode_vector,
    sigmoid,
)
from frontend.serving.base import OpenAIServing
from frontend.serving.generation import RequestFailedError, unique_ids
from frontend.serving.sampling import truncate_prompt

Endpoint = Callable[[Request], Awaitable[Response]]

# What each task answers, for the error a wrong route gets.
TASK_ROUTES = {
    "generate": "/v1/chat/completions, /v1/completions, /v1/responses, /generate",
    "embed": "/v1/embeddings, /pooling, /score",
    "classify": "/classify, /pooling, /score (single-label heads)",
    "reward": "/pooling",
}
# How _fit's errors name what was too long, by the request field it came from.
_WHAT = {"input": "an input", "messages": "the conversation", "text": "a text", "text_2": "a pair"}
# Pooling requests sample nothing; the engine core still checks max_tokens >= 1.
_NO_SAMPLING = SamplingParams(max_tokens=1)


def task_error(path: str, task: str, needed: str) -> APIError:
    """The 400 of a route the served model's task cannot answer."""
    routes = TASK_ROUTES.get(task, "none")
    return APIError(
        f"{path} needs {needed}, but this model serves task {task!r}; for task {task!r} use "
        f"{routes}",
        400,
        None,
        "wrong_task",
    )


class PoolingServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    @property
    def ready(self) -> EngineReady:
        ready = self.serving.engine.ready
        assert ready is not None, "the engine is started before requests arrive"
        return ready

    # ------------------------------------------------------------------ routes

    async def embeddings(self, http_request: Request) -> Response:
        route = "/v1/embeddings"
        req = decode_pooling_request(await http_request.body(), EmbeddingRequest, route)
        self.serving.check_model(req.model)
        self._check_dimensions(req.dimensions)
        prompts = self._prompts(req)
        result = await self._pool(http_request, "embd-", req.request_id, prompts)
        if result is None:
            return Response(status_code=499)
        request_id, headers, vectors = result
        data = [
            EmbeddingData(i, encode_vector(self._embedding(v, req), req.encoding_format))
            for i, v in enumerate(vectors)
        ]
        n = sum(map(len, prompts))
        response = EmbeddingResponse(
            request_id, int(time.time()), self.serving.model_name, data, EmbeddingUsage(n, n)
        )
        return json_response(response, headers=headers)

    async def pooling(self, http_request: Request) -> Response:
        route = "/pooling"
        req = decode_pooling_request(await http_request.body(), PoolingRequest, route)
        task = self.ready.task  # the route table lets only pooling tasks in
        self.serving.check_model(req.model)
        if req.task is not None and req.task != task:
            raise bad_request(f"this model serves task {task!r}, not {req.task!r}", "task")
        if task == "embed":
            self._check_dimensions(req.dimensions)
        else:
            self._check_score_head_options(req, task)
        prompts = self._prompts(req)
        result = await self._pool(http_request, "pool-", req.request_id, prompts)
        if result is None:
            return Response(status_code=499)
        request_id, headers, vectors = result
        data = [
            PoolingData(i, encode_vector(self._pooling_values(task, v, req), req.encoding_format))
            for i, v in enumerate(vectors)
        ]
        response = PoolingResponse(
            request_id, int(time.time()), self.serving.model_name, data, _usage(prompts)
        )
        return json_response(response, headers=headers)

    async def classify(self, http_request: Request) -> Response:
        route = "/classify"
        req = decode_pooling_request(await http_request.body(), ClassificationRequest, route)
        self.serving.check_model(req.model)
        prompts = self._prompts(req)
        result = await self._pool(http_request, "classify-", req.request_id, prompts)
        if result is None:
            return Response(status_code=499)
        request_id, headers, vectors = result
        data = []
        for i, logits in enumerate(vectors):
            probs = class_probabilities(logits) if req.use_activation is not False else logits
            best = max(range(len(logits)), key=logits.__getitem__)
            data.append(ClassificationData(i, self._label(best), probs, len(logits)))
        response = ClassificationResponse(
            request_id, int(time.time()), self.serving.model_name, data, _usage(prompts)
        )
        return json_response(response, headers=headers)

    async def score(self, http_request: Request) -> Response:
        route = "/score"
        req = decode_pooling_request(await http_request.body(), ScoreRequest, route)
        task = self.ready.task  # embed or classify (the route table's task gate)
        self.serving.check_model(req.model)
        pairs = req.pairs()
        if task == "classify":
            if self.ready.pooled_size != 1:
                raise task_error(
                    route,
                    task,
                    "a cross-encoder (a classifier with one label: num_labels 1) or an embedding "
                    f"model; this classifier has {self.ready.pooled_size} labels",
                )
            prompts = [self._pair_ids(a, b, req.truncate_prompt_tokens) for a, b in pairs]
        else:
            if req.use_activation is not None:
                raise bad_request(
                    "use_activation applies to cross-encoders; an embedding model's score is the "
                    "cosine similarity of the two embeddings",
                    "use_activation",
                )
            texts = list(dict.fromkeys(t for pair in pairs for t in pair))
            prompts = [
                self._fit(self._encode(t), req.truncate_prompt_tokens, "text") for t in texts
            ]
        result = await self._pool(http_request, "score-", req.request_id, prompts)
        if result is None:
            return Response(status_code=499)
        request_id, headers, vectors = result
        if task == "classify":
            logits = [v[0] for v in vectors]
            scores = [sigmoid(x) if req.use_activation is not False else x for x in logits]
        else:
            by_text = dict(zip(texts, vectors))
            scores = [cosine_similarity(by_text[a], by_text[b]) for a, b in pairs]
        data = [ScoreData(i, score) for i, score in enumerate(scores)]
        response = ScoreResponse(
            request_id, int(time.time()), self.serving.model_name, data, _usage(prompts)
        )
        return json_response(response, headers=headers)

    async def encode(self, http_request: Request) -> Response:
        """LMDeploy's /v1/encode (any task: it only tokenizes)."""
        req = decode_pooling_request(await http_request.body(), EncodeRequest, "/v1/encode")
        texts = [req.input] if isinstance(req.input, str) else req.input
        ids = [
            self._encode_lmdeploy(t, bool(req.do_preprocess), req.add_bos is not False)
            for t in texts
        ]
        if isinstance(req.input, str):
            return json_response(EncodeResponse(ids[0], len(ids[0])))
        return json_response(EncodeResponse(ids, [len(x) for x in ids]))

    # ------------------------------------------------------------------ inputs

    def _prompts(self, req: PoolingInput) -> list[list[int]]:
        """The token ids of each input, truncated and checked against the context length."""
        s = self.serving
        if req.messages is not UNSET:
            assert isinstance(req.messages, list)
            ids = s.tokenizer.apply_chat_template(
                normalize_messages(req.messages),
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                add_special_tokens=bool(req.add_special_tokens),
                chat_template_kwargs=req.chat_template_kwargs,
            )
            return [self._fit(ids, req.truncate_prompt_tokens, "messages")]
        add_special_tokens = req.add_special_tokens is not False
        return [
            self._fit(
                s.encode_prompt(item, add_special_tokens, "input"),
                req.truncate_prompt_tokens,
                "input",
            )
            for item in req.inputs
        ]

    def _encode(self, text: str) -> list[int]:
        return self.serving.tokenizer.encode(text, add_special_tokens=True)

    def _pair_ids(self, text_1: str, text_2: str, truncate: int | None) -> list[int]:
        """A cross-encoder's input: the tokenizer's own pair encoding (its separators, if any)."""
        encoded = self.serving.tokenizer.hf(text_1, text_pair=text_2, add_special_tokens=True)
        return self._fit(list(encoded["input_ids"]), truncate, "text_2")

    def _fit(self, ids: list[int], truncate: int | None, param: str) -> list[int]:
        limit = self.serving.max_model_len
        kept = truncate_prompt(ids, truncate, limit)
        what = _WHAT.get(param, param)
        if not kept:
            raise bad_request(f"{what} is empty (0 tokens)", param)
        if len(kept) > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens; {what} has {len(kept)} "
                "tokens. Please shorten it, or set truncate_prompt_tokens.",
                param,
            )
        return kept

    def _encode_lmdeploy(self, text: str, do_preprocess: bool, add_bos: bool) -> list[int]:
        """LMDeploy's encode: the tokenizer's special tokens, minus a leading BOS unless add_bos.
        do_preprocess renders the text as a user turn (with the assistant's prompt); the rendered
        template holds its own special tokens, so none are added to it."""
        tokenizer = self.serving.tokenizer
        if do_preprocess:
            rendered = tokenizer.render_chat([{"role": "user", "content": text}])
            ids = tokenizer.encode(rendered, add_special_tokens=False)
        else:
            ids = tokenizer.encode(text, add_special_tokens=True)
        bos = tokenizer.hf.bos_token_id
        if not add_bos and ids and bos is not None and ids[0] == bos:
            ids = ids[1:]
        return ids

    def _check_dimensions(self, dimensions: int | None) -> None:
        size = self.ready.pooled_size
        if dimensions is not None and size and dimensions > size:
            raise bad_request(
                f"dimensions must be at most the embedding size ({size}), got {dimensions}",
                "dimensions",
            )

    def _check_score_head_options(self, req: PoolingRequest, task: str) -> None:
        """/pooling on a score head: the embedding options do not apply."""
        for name in ("dimensions", "normalize"):
            if getattr(req, name) is not None:
                raise bad_request(
                    f"{name} applies to embedding models; this model serves task {task!r}", name
                )
        if task == "reward" and req.use_activation:
            raise bad_request(
                "a reward model's scores are its raw outputs (no activation)", "use_activation"
            )

    def _embedding(self, pooled: list[float], req: EmbeddingRequest) -> list[float]:
        return embedding_vector(pooled, req.dimensions, req.wants_normalized).tolist()

    def _pooling_values(self, task: str, pooled: list[float], req: PoolingRequest) -> list[float]:
        """/pooling's answer: the embedding, the class probabilities, or the raw scores."""
        if task == "embed":
            return self._embedding(pooled, req)
        if task == "classify" and req.use_activation is not False:
            return class_probabilities(pooled)
        return pooled

    def _label(self, index: int) -> str:
        return self.ready.id2label.get(index, f"LABEL_{index}")

    # ------------------------------------------------------------------ engine

    async def _pool(
        self,
        http_request: Request,
        prefix: str,
        body_request_id: str | None,
        prompts: list[list[int]],
    ) -> tuple[str, dict[str, str], list[list[float]]] | None:
        """(response id, response headers, each prompt's pooled vector), or None if the client
        went away first. Engine failures are APIErrors: 503 engine dead, 500 request failed."""
        s = self.serving
        engine = s.engine
        if engine.is_dead:
            raise engine_dead_error(engine.dead_reason)
        request_id, _, headers = s.request_ids(http_request, prefix, body_request_id)
        ids = unique_ids(request_id, len(prompts), engine.is_in_flight)
        arrival = time.monotonic()
        tasks: list[asyncio.Future[list[float]]] = []
        disconnect = asyncio.ensure_future(_wait_for_disconnect(http_request))
        try:
            for rid, prompt in zip(ids, prompts):
                request = EngineCoreRequest(
                    rid, prompt, _NO_SAMPLING, arrival_time=time.time(), pooling=True
                )
                tasks.append(asyncio.ensure_future(_pooled(engine.add_request(request))))
            collect = asyncio.gather(*tasks)
            await asyncio.wait({collect, disconnect}, return_when=asyncio.FIRST_COMPLETED)
            if not collect.done():
                return None
            vectors = collect.result()
        except EngineDeadError as e:
            raise engine_dead_error(str(e)) from e
        except RequestFailedError as e:
            raise APIError(str(e), 500, None, "engine_error") from e
        finally:
            disconnect.cancel()
            for task in tasks:
                task.cancel()
            engine.abort(ids)  # NOTE: a no-op for the requests that finished
        if s.metrics is not None:
            elapsed = time.monotonic() - arrival
            for prompt in prompts:
                s.metrics.on_first_token(elapsed, len(prompt))
                s.metrics.on_finish(FinishReason.STOP.value, elapsed, None)
        return request_id, headers, vectors


async def _pooled(stream: RequestStream) -> list[float]:
    """A pooling request's vector: its one (finishing) output's `pooled`."""
    out = await stream.next()
    while out.finish_reason is None:
        out = await stream.next()
    if out.finish_reason == FinishReason.ERROR:
        raise RequestFailedError(out.error or "the engine failed to serve this request")
    if out.finish_reason == FinishReason.ABORT:  # e.g. POST /pause_generation with mode abort
        raise APIError(
            "the request was aborted before its vector was computed", 503, None, "aborted"
        )
    if out.pooled is None:
        raise RequestFailedError(
            f"the engine ended a pooling request ({out.finish_reason.value}) without its vector"
        )
    return out.pooled


async def _wait_for_disconnect(http_request: Request) -> None:
    while (await http_request.receive())["type"] != "http.disconnect":
        pass


def _usage(prompts: list[list[int]]) -> UsageInfo:
    n = sum(map(len, prompts))
    return UsageInfo(prompt_tokens=n, total_tokens=n, completion_tokens=0)

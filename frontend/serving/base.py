"""What every generating route shares: OpenAI-style requests to engine requests, SSE streams back.

OpenAIServing holds it (every API family's generating routes use it): model-name checks, request ids (X-Request-Id), prompt encoding,
request -> SamplingParams, and starting a RequestGroup registered for POST /abort_request. Every
request ends in an answer: a response, a final chunk, or an OpenAI error (4xx for the client's
mistakes, 503 when the engine is gone). A client that goes away aborts its requests in the engine core, which frees their KV blocks.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from msgspec import UNSET
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from enginecore.config import KVTransferConfig
from enginecore.messages import MultiModalItem, SamplingParams, StructuredOutputSpec
from frontend.common.errors import APIError, bad_request, engine_dead_error
from frontend.common.http import REQUEST_ID_HEADER, sse
from frontend.disagg.requests import KVRequest, KVSide, check_single
from frontend.engine.client import EngineClient, EngineDeadError
from frontend.serving.generation import (
    Generation,
    InflightRequests,
    RequestFailedError,
    RequestGroup,
    stream_and_close,
    unique_ids,
)
from frontend.serving.routed_experts import vllm_routed_experts
from frontend.serving.sampling import RequestSampling, for_sample, set_logits_processing
from frontend.text.detokenizer import IncrementalDetokenizer

logger = logging.getLogger("tern.frontend")

_DONE = b"data: [DONE]\n\n"

if TYPE_CHECKING:
    from frontend.audio.prompts import AudioPrompts
    from frontend.audio.speech import SpeechModel
    from frontend.common.metrics import Metrics
    from frontend.disagg.bootstrap import LeaseRegistry
    from frontend.media.prompts import ImagePrompts
    from frontend.text.tokenizer import Tokenizer


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
        records_routing: bool = False,
    ) -> None:
        """records_routing: the engine records routed experts (--enable-return-routed-experts):
        completions and chat choices carry vLLM's `routed_experts`, SGLang's /generate answers
        `return_routed_experts`."""
        assert model_names, "at least one served model name"
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_names = list(model_names)
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        # A checkpoint's generation config may name end-of-sequence ids its model cannot emit
        # (a config class's defaults, saved beside a smaller vocabulary): never generated, so
        # never matched; dropped rather than sent to fail every request (as vLLM serves them).
        self.eos_token_ids = [t for t in tokenizer.eos_token_ids if 0 <= t < vocab_size]
        if len(self.eos_token_ids) < len(tokenizer.eos_token_ids):
            dropped = sorted(set(tokenizer.eos_token_ids) - set(self.eos_token_ids))
            logger.warning(
                "end-of-sequence ids %s are outside the model's vocabulary of %d: ignored",
                dropped, vocab_size,
            )  # fmt: skip
        self.metrics = metrics
        self.records_routing = records_routing
        self.inflight = InflightRequests()
        # The image path (frontend/media/), where the model's images are served.
        self.images: ImagePrompts | None = None
        # A speech-to-text model's audio side (frontend/audio/speech.py).
        self.speech: SpeechModel | None = None
        # An audio-language model's audio path (frontend/audio/prompts.py).
        self.audio: AudioPrompts | None = None
        # The LoRA adapters served ({name: {"version", "loaded", "path"}}), as the engine core's
        # control state last said (frontend/control/serving.py refreshes it); None: LoRA is off.
        self.adapters: dict[str, dict[str, Any]] | None = None
        # Prefill/decode disaggregation (frontend/disagg/): this server's part, and on a producer
        # the registry of the leases its requests lent (its bootstrap answers from it).
        self.kv = KVSide(KVTransferConfig(), "")
        self.leases: LeaseRegistry | None = None

    @property
    def modalities(self) -> tuple[str, ...]:
        """The media a prompt may carry besides text (chat parts)."""
        images = self.images is not None
        video = images and self.images.takes_video  # type: ignore[union-attr]
        return ("image",) * images + ("video",) * video + ("audio",) * (self.audio is not None)

    def routed_experts_of(self, gen: Generation) -> str | None:
        """vLLM's choices[i].routed_experts of a finished generation (routed_experts.py)."""
        rows = gen.routed_experts() if self.records_routing else None
        return None if rows is None else vllm_routed_experts(rows, gen.routing.num_experts)

    @property
    def model_name(self) -> str:
        """The name responses carry: the first served name (as vLLM)."""
        return self.model_names[0]

    # ------------------------------------------------------------------ shared

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter `model` names (an adapter's name, or SGLang's `base:adapter`), None
        for the base model; 404 for a name not served."""
        if model is None or model in self.model_names:
            return None
        base, _, adapter = model.partition(":")
        name = adapter if adapter and base in self.model_names else model
        if self.adapters is not None and name in self.adapters:
            return name
        served = ", ".join(f"`{m}`" for m in [*self.model_names, *(self.adapters or {})])
        raise APIError(
            f"The model `{model}` does not exist. This server serves {served}.",
            404,
            "model",
            "model_not_found",
        )

    def lora_of(self, req: Any) -> str | None:
        """The adapter an OpenAI body asks for: by `model`, or by SGLang's `lora_path` (an
        adapter's name, as routers forward it); both set must agree."""
        by_model = self.check_model(req.model)
        path = req.lora_path
        if path is UNSET or path is None:
            return by_model
        if not isinstance(path, str):
            raise bad_request("lora_path must be the name of a loaded LoRA adapter", "lora_path")
        named = self.check_adapter(path, "lora_path")
        if by_model is not None and by_model != named:
            raise bad_request(f"model names adapter {by_model!r}, lora_path {named!r}", "lora_path")
        return named

    def check_adapter(self, name: str | None, param: str) -> str | None:
        """An adapter named by a request field (SGLang's lora_path, LMDeploy's adapter_name)."""
        if name is None:
            return None
        if self.adapters is None:
            raise bad_request("this server serves no LoRA adapter (start it with --enable-lora)",
                              param)  # fmt: skip
        if name not in self.adapters:
            raise APIError(f"no LoRA adapter named {name!r} is loaded", 404, param,
                           "model_not_found")  # fmt: skip
        return name

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
        sampling: RequestSampling,
        prompts: list[list[int]],
        prompt_param: str,
        session_id: int | None = None,
        *,
        n: int = 1,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        discard_output: bool = False,
        structured_output: StructuredOutputSpec | None = None,
        lora: str | None | Sequence[str | None] = None,
        mm_items: Sequence[MultiModalItem] = (),
        kv: KVRequest | None = None,
        mm_items_per_prompt: Sequence[Sequence[MultiModalItem]] | None = None,
    ) -> RequestGroup:
        """Checks every prompt, then starts n engine requests per prompt (all or none): samples
        0..n-1 of prompt 0, then of prompt 1... (frontend/serving/sampling.py says how they differ).

        `logprobs` / `prompt_logprobs`: how many most likely tokens the logprobs of each output /
        prompt token show (None: no logprobs). `discard_output`: see Generation.
        `structured_output`: the grammar every sample's output follows.
        `lora`: the LoRA adapter every prompt runs on, or one per prompt (None: the base model).
        `mm_items`: the images of the (one) prompt (frontend/media/); `mm_items_per_prompt`:
        each prompt's own (a speech-to-text request's windows: frontend/audio/).
        `kv`: the (one) prompt's KV transfer (frontend/disagg/requests.py).
        """
        if self.speech is not None and mm_items_per_prompt is None and not mm_items:
            raise bad_request(
                "this is a speech-to-text model: every request carries audio "
                "(POST /v1/audio/transcriptions or /v1/audio/translations)"
            )
        loras = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        if len(loras) != len(prompts):
            raise bad_request(f"{len(loras)} adapters for {len(prompts)} prompts", "lora_path")
        check_single(kv, len(prompts) * n, prompt_param)
        # Again: an unload may have begun since the request was checked (media decoding awaits).
        for name in set(loras) - {None}:
            self.check_adapter(name, "model")
        params = [self.sampling_params(sampling, ids, prompt_param) for ids in prompts]
        if self.engine.is_dead:
            raise engine_dead_error(self.engine.dead_reason)
        engine_ids = iter(unique_ids(request_id, len(prompts) * n, self.engine.is_in_flight))
        gens: list[Generation] = []
        try:
            items = mm_items_per_prompt or [mm_items] * len(prompts)
            for prompt_ids, base, lora_name, prompt_items in zip(prompts, params, loras, items):
                for index in range(n):
                    p = for_sample(base, index, logprobs, prompt_logprobs)
                    detokenizer = IncrementalDetokenizer(
                        self.tokenizer.backend,
                        prompt_ids,
                        skip_special_tokens=sampling.skip_special_tokens,
                        stop=sampling.stop,
                        include_stop_str_in_output=sampling.include_stop_str_in_output,
                    )
                    gen = Generation(
                        self.engine, next(engine_ids), prompt_ids, p, detokenizer, self.metrics,
                        discard_output, structured_output, lora_name, list(prompt_items),
                        kv.transfer if kv is not None else None, self.leases,
                    )  # fmt: skip
                    gens.append(gen)
        except EngineDeadError as e:
            raise engine_dead_error(str(e)) from e
        group = RequestGroup(keys, gens, self.inflight, session_id, n)
        group.model_name = lora if isinstance(lora, str) else self.model_name
        return group

    def sampling_params(
        self, sampling: RequestSampling, prompt_ids: list[int], prompt_param: str
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
        max_tokens = sampling.max_tokens
        if max_tokens is None:
            max_tokens = limit - n_prompt
        elif n_prompt + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n_prompt + max_tokens} tokens ({n_prompt} in the {prompt_param}, {max_tokens} "
                "in the completion). Please reduce the length of the prompt or completion.",
                sampling.param("max_tokens"),
            )
        stop_token_ids = list(sampling.stop_token_ids)
        bad = [t for t in stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(
                f"stop_token_ids must be in [0, {self.vocab_size}); got {bad[0]}",
                sampling.param("stop_token_ids"),
            )
        defaults = self.tokenizer.generation_defaults
        top_k = sampling.top_k if sampling.top_k is not None else int(defaults.get("top_k", 0))
        params = SamplingParams(
            temperature=_pick(sampling.temperature, defaults, "temperature", 1.0),
            top_p=_pick(sampling.top_p, defaults, "top_p", 1.0),
            top_k=max(top_k, 0),  # -1 and 0 both mean "all tokens"
            min_p=_pick(sampling.min_p, defaults, "min_p", 0.0),
            seed=sampling.seed,
            max_tokens=max_tokens,
            stop_token_ids=stop_token_ids,
            eos_token_ids=list(self.eos_token_ids),
            ignore_eos=sampling.ignore_eos,
        )
        set_logits_processing(params, sampling, self.vocab_size, defaults)
        params.suppress_token_ids = list(sampling.suppress_token_ids)
        params.begin_suppress_token_ids = list(sampling.begin_suppress_token_ids)
        params.timestamps = sampling.timestamps
        params.cross_attention = sampling.cross_attention
        return params

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

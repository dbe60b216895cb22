"""POST /v1/completions: one or a batch of prompts (text or token ids) in, n choices per prompt out
(choice index = prompt index x n + sample index, as vLLM), whole or as SSE.

With logprobs k, a choice's `logprobs` has each token's text, logprob, text offset and a dict of
it and the k most likely tokens. With echo the prompt comes first in the text (and in the logprobs:
its first token has none, the others the prompt logprobs); echo with max_tokens 0 returns only the
prompt, which is how evaluation harnesses score a text. `prompt_logprobs` (vLLM's shape),
`prompt_token_ids` and `token_ids` (return_token_ids) are per choice. Streamed, a choice's first
chunk carries the echoed prompt and the prompt fields.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from msgspec import UNSET
from starlette.requests import Request
from starlette.responses import Response

from enginecore.messages import Logprobs
from frontend.common.decoding import decode_request
from frontend.common.http import json_response, sse
from frontend.common.protocol import CompletionLogProbs
from frontend.disagg.requests import KVRequest, kv_request
from frontend.openai.protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    usage_options,
)
from frontend.serving.base import OpenAIServing
from frontend.serving.generation import Generation, RequestGroup
from frontend.serving.kv_answers import kv_answer, kv_sampling, refusal_fails_room
from frontend.serving.sampling import truncate_prompt
from frontend.text.logprobs import TokenStrings, completion_logprobs, prompt_logprobs


class CompletionServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, http_request: Request) -> Response:
        s = self.serving
        req = decode_request(await http_request.body(), CompletionRequest)
        with refusal_fails_room(s, req.bootstrap_room):
            return await self._create(http_request, req)

    async def _create(self, http_request: Request, req: CompletionRequest) -> Response:
        s = self.serving
        lora = s.lora_of(req)
        prompts, prompt_texts = [], []
        for prompt in req.normalized_prompts():
            ids = s.encode_prompt(prompt, req.add_special_tokens, "prompt")
            kept = truncate_prompt(ids, req.truncate_prompt_tokens, s.max_model_len)
            prompts.append(kept)
            if req.echo:  # a text prompt echoes as sent, unless it was truncated
                is_whole = isinstance(prompt, str) and len(kept) == len(ids)
                skip = req.skip_special_tokens is not False
                prompt_texts.append(prompt if is_whole else s.tokenizer.decode(kept, skip))
        request_id, keys, headers = s.request_ids(http_request, "cmpl-", req.request_id)
        # Echo with logprobs shows the prompt's logprobs too: the engine computes them.
        wanted = [req.prompt_logprobs, req.logprobs if req.echo else None]
        num_prompt_top = max((k for k in wanted if k is not None), default=None)
        kv = kv_request(s.kv, **req.kv_fields())
        group = s.start(
            request_id, keys, kv_sampling(req.to_sampling(), kv, req.stream), prompts, "prompt",
            n=req.n or 1, logprobs=req.logprobs, prompt_logprobs=num_prompt_top,
            discard_output=req.is_echo_only, structured_output=req.output_constraint(), lora=lora,
            kv=kv,
        )  # fmt: skip
        view = _CompletionView(req, s, prompt_texts, group.n)
        created = int(time.time())
        if req.stream:
            return s.sse_response(self._stream(group, req, view, created, kv), group, headers)
        texts = await group.collect_unless_disconnected(http_request)
        if texts is None:
            return Response(status_code=499)
        choices = [
            view.choice(i, gen, view.echo_text(i) + text, gen.output_logprobs, 0, first=True)
            for i, (gen, text) in enumerate(zip(group.gens, texts))
        ]
        answers = [kv_answer(s.kv, kv, gen, req.max_tokens) for gen in group.gens]
        for choice, gen, answer in zip(choices, group.gens, answers):
            choice.token_ids = gen.output_token_ids if req.return_token_ids else None
            choice.routed_experts = s.routed_experts_of(gen)
            choice.finish_reason = answer.finish_reason
            choice.disaggregated_params = answer.disaggregated_params
        response = CompletionResponse(
            request_id, "text_completion", created, group.model_name, choices, group.usage(),
            group.weight_version, group.lora_version, answers[0].kv_transfer_params,
            answers[0].prompt_token_ids,
        )  # fmt: skip
        return json_response(response, headers=headers)

    async def _stream(
        self,
        group: RequestGroup,
        req: CompletionRequest,
        view: _CompletionView,
        created: int,
        kv: KVRequest | None = None,
    ) -> AsyncIterator[bytes]:
        s = self.serving
        request_id = group.keys[0]
        include_usage, continuous_usage = usage_options(req)
        wants_tokens = req.logprobs is not None or bool(req.return_token_ids)
        num_chars = [0] * len(group.gens)  # text sent so far, per choice: the next text offset
        started = [False] * len(group.gens)
        async for i, text in group.merged():
            gen = group.gens[i]
            first = not started[i]
            started[i] = True
            if first:
                text = view.echo_text(i) + text
            if not (first or text or gen.is_finished or (wants_tokens and gen.new_token_ids)):
                continue
            new_logprobs = [gen.new_logprobs] if gen.new_logprobs is not None else []
            choice = view.choice(i, gen, text, new_logprobs, num_chars[i], first)
            choice.token_ids = gen.new_token_ids if req.return_token_ids else None
            choice.routed_experts = s.routed_experts_of(gen)
            num_chars[i] += len(text)
            yield sse(
                CompletionStreamResponse(
                    request_id, "text_completion", created, group.model_name, [choice],
                    gen.usage() if continuous_usage else None,
                    gen.weight_version if gen.is_finished else None,
                    gen.lora_version if gen.is_finished and gen.lora_version else UNSET,
                    kv_answer(s.kv, kv, gen, None).kv_transfer_params
                    if gen.is_finished else UNSET,
                )
            )  # fmt: skip
        if include_usage:
            yield sse(
                CompletionStreamResponse(
                    request_id, "text_completion", created, group.model_name, [], group.usage()
                )
            )


class _CompletionView:
    """How one request's generations are shown: echoed prompts, logprobs, prompt fields."""

    def __init__(
        self, req: CompletionRequest, s: OpenAIServing, prompt_texts: list[str], n: int
    ) -> None:
        self.req = req
        self.n = n
        self.prompt_texts = prompt_texts  # with echo: each prompt's text
        self.strings = TokenStrings(s.tokenizer.backend, bool(req.return_tokens_as_token_ids))

    def echo_text(self, i: int) -> str:
        return self.prompt_texts[i // self.n] if self.req.echo else ""

    def choice(
        self,
        i: int,
        gen: Generation,
        text: str,
        output_logprobs: list[Logprobs],
        text_offset: int,
        first: bool,
    ) -> CompletionResponseChoice:
        """Choice i with `text` and the logprobs of `output_logprobs`' tokens; `first`: the
        choice's first appearance, which carries the echoed prompt and the prompt fields."""
        req = self.req
        logprobs = None
        if req.logprobs is not None:
            logprobs = self._logprobs(gen, output_logprobs, text_offset, first)
        choice = CompletionResponseChoice(i, text, logprobs, gen.finish_reason, gen.stop_reason)
        if first:
            if req.prompt_logprobs is not None and gen.prompt_logprobs is not None:
                choice.prompt_logprobs = prompt_logprobs(
                    gen.prompt_token_ids, gen.prompt_logprobs, req.prompt_logprobs, self.strings
                )
            if req.return_token_ids:
                choice.prompt_token_ids = gen.prompt_token_ids
        return choice

    def _logprobs(
        self, gen: Generation, output: list[Logprobs], text_offset: int, first: bool
    ) -> CompletionLogProbs:
        k = self.req.logprobs
        assert k is not None
        if not (self.req.echo and first):
            return completion_logprobs(output, k, self.strings, text_offset)
        prompt_lp = gen.prompt_logprobs or Logprobs()
        return completion_logprobs(
            [prompt_lp, *output], k, self.strings, text_offset, gen.prompt_token_ids[0]
        )

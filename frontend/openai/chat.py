"""POST /v1/chat/completions: messages (or prompt_token_ids) in, n choices out, whole or as SSE.

What a choice carries besides its message follows vLLM: `logprobs.content` when logprobs is true
(with top_logprobs alternatives), `token_ids` and the response's `prompt_token_ids` with
return_token_ids, the response's `prompt_logprobs` when asked, and with echo the last message's
content in front of the reply when it has the reply's role. Streamed, each choice's first chunk
(role, prompt_token_ids) goes out with its first tokens, and every chunk carries the logprobs and
token ids of the tokens it covers.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from msgspec import UNSET
from starlette.requests import Request
from starlette.responses import Response

from enginecore.messages import Logprobs, MultiModalItem
from frontend.common.decoding import MediaRef, decode_request
from frontend.common.errors import bad_request
from frontend.common.http import json_response, sse
from frontend.common.protocol import DeltaMessage, PromptLogprobsList
from frontend.disagg.requests import KVRequest, KVSide, kv_request
from frontend.openai.protocol import (
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    usage_options,
)
from frontend.serving.chat import ChatPath
from frontend.serving.generation import Generation, RequestGroup
from frontend.serving.kv_answers import kv_answer, kv_sampling, refusal_fails_room
from frontend.serving.sampling import truncate_prompt
from frontend.text.chat_output import ChoiceDelta, ChoiceParser, delta_message, parse_message
from frontend.text.logprobs import TokenStrings, chat_logprobs, prompt_logprobs
from frontend.text.tool_calling import ToolPlan, plan_tools

_ROLE = "assistant"


class ChatServing(ChatPath):
    async def create(self, http_request: Request) -> Response:
        s = self.serving
        req = decode_request(await http_request.body(), ChatCompletionRequest)
        with refusal_fails_room(s, req.bootstrap_room):
            return await self._create(http_request, req)

    async def _create(self, http_request: Request, req: ChatCompletionRequest) -> Response:
        s = self.serving
        lora = s.lora_of(req)
        plan = self.plan(req)
        media = [] if s.images is not None or s.audio is not None else None
        if s.images is None and req.mm_processor_kwargs is not None:
            raise bad_request("this model is served without image inputs", "mm_processor_kwargs")
        prompt_text, prompt_ids = self.render(req, plan, media)
        mm_items = []
        if media:
            prompt_ids, mm_items = await self.chat_media_prompt(req, prompt_text, media)
        constraint, opens_reasoning = self.after_reasoning(plan.constraint, prompt_text)
        request_id, keys, headers = s.request_ids(http_request, "chatcmpl-", req.request_id)
        kv = kv_request(s.kv, **req.kv_fields())
        group = s.start(
            request_id, keys, kv_sampling(req.to_sampling(), kv, req.stream), [prompt_ids],
            "messages", n=req.n or 1, logprobs=req.num_logprobs,
            prompt_logprobs=req.prompt_logprobs, structured_output=constraint, lora=lora,
            mm_items=mm_items, kv=kv,
        )  # fmt: skip
        _, client_max_tokens = req.max_tokens_field
        view = _ChatView(
            req, TokenStrings(s.tokenizer.backend, bool(req.return_tokens_as_token_ids))
        )
        parsers = [
            self.choice_parser(plan, opens_reasoning, req.include_reasoning) for _ in group.gens
        ]
        created = int(time.time())
        if req.stream:
            body = self._stream(group, req, view, parsers, created, kv)
            return s.sse_response(body, group, headers)
        texts = await group.collect_unless_disconnected(http_request)
        if texts is None:
            return Response(status_code=499)
        choices = []
        for i, (gen, text, parser) in enumerate(zip(group.gens, texts, parsers)):
            message = _message(parser, text, view.echo)
            answer = kv_answer(s.kv, kv, gen, client_max_tokens)
            choices.append(
                ChatCompletionResponseChoice(
                    i,
                    message,
                    view.logprobs(gen.all_output_logprobs),
                    _finish_reason(answer.finish_reason, bool(message.tool_calls)),
                    gen.stop_reason,
                    gen.output_token_ids if req.return_token_ids else None,
                    s.routed_experts_of(gen),
                    answer.disaggregated_params,
                )
            )
        first = group.gens[0]
        answer = kv_answer(s.kv, kv, first, client_max_tokens)
        prompt_ids_shown = view.prompt_token_ids(first) or answer.prompt_token_ids or None
        response = ChatCompletionResponse(
            request_id, "chat.completion", created, group.model_name, choices, group.usage(),
            group.weight_version, view.prompt_logprobs(first), prompt_ids_shown,
            group.lora_version, answer.kv_transfer_params,
        )  # fmt: skip
        return json_response(response, headers=headers)

    def plan(self, req: ChatCompletionRequest) -> ToolPlan:
        """The request's tools, tool_choice and output constraint, checked together."""
        return plan_tools(
            req.tools, req.tool_choice, req.parallel_tool_calls, req.output_constraint(),
            self.options,
        )  # fmt: skip

    def render(
        self, req: ChatCompletionRequest, plan: ToolPlan, media: list[MediaRef] | None = None
    ) -> tuple[str, list[int]]:
        """The prompt (text, token ids) a chat request runs: its messages through the chat
        template (or its prompt_token_ids), truncated as it asks. `media`: where the model takes
        images or audio, the list their parts' URLs are appended to (the ids are then the text's
        before its markers are expanded: chat_media_prompt)."""
        s = self.serving
        if req.prompt_token_ids is not None:
            prompt_ids = s.encode_prompt(req.prompt_token_ids, False, "prompt_token_ids")
            prompt_text = s.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        else:
            prompt_text = s.tokenizer.render_chat(
                req.normalized_messages(media, s.modalities),
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                chat_template_kwargs=req.chat_template_kwargs,
                tools=plan.tools,
            )
            prompt_ids = s.tokenizer.encode(prompt_text, add_special_tokens=req.add_special_tokens)
        return prompt_text, truncate_prompt(prompt_ids, req.truncate_prompt_tokens, s.max_model_len)

    async def chat_media_prompt(
        self, req: ChatCompletionRequest, prompt_text: str, media: list[MediaRef]
    ) -> tuple[list[int], list[MultiModalItem]]:
        """The prompt's token ids with its images' or audios' placeholders, and their items."""
        s = self.serving
        if req.truncate_prompt_tokens is not None:
            kind = "audio" if s.audio is not None else "images"
            raise bad_request(
                f"truncate_prompt_tokens cannot cut a prompt with {kind}", "truncate_prompt_tokens"
            )
        if s.audio is not None:
            return await s.audio.make(prompt_text, media, "messages")
        return await self.image_prompt(
            prompt_text, media, req.mm_processor_kwargs, "messages", req.add_special_tokens
        )

    async def _stream(
        self,
        group: RequestGroup,
        req: ChatCompletionRequest,
        view: _ChatView,
        parsers: list[ChoiceParser],
        created: int,
        kv: KVRequest | None = None,
    ) -> AsyncIterator[bytes]:
        include_usage, continuous_usage = usage_options(req)
        wants_tokens = req.num_logprobs is not None or bool(req.return_token_ids)
        chunks = _Chunks(self.serving.kv, group, req, view, created, kv, continuous_usage)
        started = [False] * len(group.gens)
        called = [False] * len(group.gens)  # the choice has tool calls
        async for i, text in group.merged():
            gen = group.gens[i]
            if not started[i]:
                # NOTE: sent with the first output, not before: clients (and vLLM's benchmark)
                # take the first chunk's arrival as the time to first token.
                started[i] = True
                role = DeltaMessage(role=_ROLE, content="")
                yield chunks(
                    i, role, with_tokens=False, prompt_token_ids=view.prompt_token_ids(gen)
                )
                if view.echo:
                    yield chunks(i, DeltaMessage(content=view.echo), with_tokens=False)
            parsed = _parse(parsers[i], text, gen.is_finished)
            called[i] = called[i] or bool(parsed.tool_calls)
            if gen.is_finished:
                finish = _finish_reason(gen.finish_reason, called[i])
                yield chunks(i, delta_message(parsed), finish)
            elif parsed or (wants_tokens and gen.new_token_ids):
                yield chunks(i, delta_message(parsed))
        if include_usage:
            yield sse(
                ChatCompletionStreamResponse(
                    group.keys[0],
                    "chat.completion.chunk",
                    created,
                    group.model_name,
                    [],
                    group.usage(),
                )
            )


@dataclass
class _Chunks:
    """One streamed choice's chunks: its delta, with the logprobs and token ids of its new tokens
    unless `with_tokens` is off; the last (a finish reason) carries what the request ends with."""

    kv_side: KVSide
    group: RequestGroup
    req: ChatCompletionRequest
    view: _ChatView
    created: int
    kv: KVRequest | None
    continuous_usage: bool

    def __call__(
        self,
        i: int,
        delta: DeltaMessage,
        finish: str | None = None,
        with_tokens: bool = True,
        prompt_token_ids: list[int] | None = None,
    ) -> bytes:
        gen = self.group.gens[i]
        choice = ChatCompletionResponseStreamChoice(
            i,
            delta,
            self.view.logprobs(gen.new_logprobs) if with_tokens else None,
            finish,
            gen.stop_reason,
            gen.new_token_ids if with_tokens and self.req.return_token_ids else None,
        )
        return sse(
            ChatCompletionStreamResponse(
                self.group.keys[0], "chat.completion.chunk", self.created, self.group.model_name,
                [choice], gen.usage() if self.continuous_usage else None,
                gen.weight_version if finish else None, prompt_token_ids,
                gen.lora_version if finish and gen.lora_version else UNSET,
                kv_answer(self.kv_side, self.kv, gen, None).kv_transfer_params
                if finish else UNSET,
            )
        )  # fmt: skip


def _parse(parser: ChoiceParser, text: str, finished: bool) -> ChoiceDelta:
    """What a choice's new text adds, and at its end whatever the parser still held."""
    parsed = parser.feed(text) if text else ChoiceDelta()
    if not finished:
        return parsed
    last = parser.finish()
    return ChoiceDelta(
        parsed.reasoning + last.reasoning,
        parsed.content + last.content,
        parsed.tool_calls + last.tool_calls,
    )


def _message(parser: ChoiceParser, text: str, echo: str) -> ChatMessage:
    parsed = parse_message(parser, text)
    content = parsed.content
    if echo:
        content = echo + (content or "")
    reasoning = parsed.reasoning
    return ChatMessage(_ROLE, content, reasoning, reasoning, parsed.tool_calls)


def _finish_reason(reason: str | None, has_tool_calls: bool) -> str | None:
    """OpenAI's "tool_calls" when a choice that ended normally called tools."""
    return "tool_calls" if has_tool_calls and reason == "stop" else reason


class _ChatView:
    """How one request's generations are shown: echo text, logprobs, prompt fields."""

    def __init__(self, req: ChatCompletionRequest, strings: TokenStrings) -> None:
        self.req = req
        self.strings = strings
        self.echo = _echo_text(req)

    def logprobs(self, lp: Logprobs | None) -> ChatCompletionLogProbs | None:
        """Of some of a choice's tokens; None when the request did not ask for logprobs."""
        k = self.req.num_logprobs
        if k is None:
            return None
        return ChatCompletionLogProbs(chat_logprobs(lp, k, self.strings) if lp else [])

    def prompt_logprobs(self, gen: Generation) -> PromptLogprobsList | None:
        k = self.req.prompt_logprobs
        if k is None or gen.prompt_logprobs is None:
            return None
        return prompt_logprobs(gen.prompt_token_ids, gen.prompt_logprobs, k, self.strings)

    def prompt_token_ids(self, gen: Generation) -> list[int] | None:
        return gen.prompt_token_ids if self.req.return_token_ids else None


def _echo_text(req: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the last message's content, when it has the role of the reply."""
    if not req.echo or not req.messages:
        return ""
    last = req.normalized_messages()[-1]
    role = _ROLE if req.add_generation_prompt else last["role"]
    return (last.get("content") or "") if last["role"] == role else ""

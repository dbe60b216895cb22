"""vLLM's POST /tokenize and POST /detokenize: a prompt or chat messages to token ids (through the
chat template, as the chat route renders them) and token ids back to text."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import UNSET
from starlette.requests import Request
from starlette.responses import Response

from frontend.common.decoding import (
    Unsupported,
    check_unsupported,
    decode_request,
    normalize_messages,
)
from frontend.common.errors import bad_request
from frontend.common.http import json_response
from frontend.serving.base import OpenAIServing


class TokenizeCompletionRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    prompt: str
    model: str | None = None
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    messages: list[dict[str, Any]]
    model: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False
    tools: Annotated[Any, Unsupported(None, [])] = UNSET
    chat_template: Annotated[Any, Unsupported(None)] = UNSET
    mm_processor_kwargs: Annotated[Any, Unsupported(None)] = UNSET

    def validate(self) -> None:
        check_unsupported(self)
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true",
                "continue_final_message",
            )


class TokenizeResponse(msgspec.Struct, omit_defaults=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    tokens: list[int]
    model: str | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class TokenizeServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def tokenize(self, http_request: Request) -> Response:
        s = self.serving
        body = await http_request.body()
        try:
            is_chat = "messages" in _as_dict(msgspec.json.decode(body))
        except (msgspec.DecodeError, UnicodeDecodeError) as e:  # msgspec: invalid UTF-8
            raise bad_request(f"malformed JSON body: {e}") from None
        if is_chat:
            chat = decode_request(body, TokenizeChatRequest)
            s.check_model(chat.model)
            tokens = s.tokenizer.apply_chat_template(
                normalize_messages(chat.messages),
                add_generation_prompt=chat.add_generation_prompt,
                continue_final_message=chat.continue_final_message,
                add_special_tokens=chat.add_special_tokens,
                chat_template_kwargs=chat.chat_template_kwargs,
            )
            return_strs = chat.return_token_strs
        else:
            req = decode_request(body, TokenizeCompletionRequest)
            s.check_model(req.model)
            tokens = s.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
            return_strs = req.return_token_strs
        token_strs = s.tokenizer.token_strs(tokens) if return_strs else None
        return json_response(TokenizeResponse(len(tokens), s.max_model_len, tokens, token_strs))

    async def detokenize(self, http_request: Request) -> Response:
        s = self.serving
        req = decode_request(await http_request.body(), DetokenizeRequest)
        s.check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < s.vocab_size]
        if bad:
            raise bad_request(f"token ids must be in [0, {s.vocab_size}); got {bad[0]}", "tokens")
        return json_response(DetokenizeResponse(s.tokenizer.decode(req.tokens, False)))


def _as_dict(obj: Any) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise bad_request("the request body must be a JSON object")
    return obj

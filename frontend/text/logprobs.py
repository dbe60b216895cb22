"""Logprobs as the APIs show them: the engine's compact `Logprobs` arrays to OpenAI's chat and
completions shapes, vLLM's prompt_logprobs, and LMDeploy's output_token_logprobs.

A token is shown as its own text (tokenizer.decode([id]), special tokens included, as vLLM does),
or as "token_id:<id>" with return_tokens_as_token_ids. `bytes` are the token's real bytes: with a
byte-level BPE vocabulary a token may hold part of a UTF-8 character, whose text is then U+FFFD
but whose bytes, joined with the next tokens', give the character (what OpenAI's field is for).
Logprobs are clamped at -9999.0 (JSON has no -inf), as vLLM and OpenAI do.
"""

from __future__ import annotations

import functools

import tokenizers
from tokenizers.decoders import ByteLevel

from enginecore.messages import Logprobs
from frontend.common.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbsContent,
    CompletionLogProbs,
    PromptLogprob,
)

_MIN_LOGPROB = -9999.0


@functools.cache
def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = {chr(b): b for b in printable}
    n = 0
    for b in range(256):
        if b not in printable:
            chars[chr(256 + n)] = b
            n += 1
    return chars


class TokenStrings:
    """Token ids -> the strings and bytes logprobs show (cached: top-k lists repeat tokens)."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, as_token_ids: bool = False) -> None:
        self._tokenizer = tokenizer
        self._as_token_ids = as_token_ids
        self._is_byte_level = isinstance(tokenizer.decoder, ByteLevel)
        self._added = set(tokenizer.get_added_tokens_decoder())
        self._text: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        if self._as_token_ids:
            return f"token_id:{token_id}"
        text = self._text.get(token_id)
        if text is None:
            text = self._text[token_id] = self._tokenizer.decode([token_id], False)
        return text

    def bytes(self, token_id: int) -> list[int]:
        if self._is_byte_level and not self._as_token_ids and token_id not in self._added:
            piece = self._tokenizer.id_to_token(token_id) or ""
            chars = _byte_level_chars()
            if piece and all(c in chars for c in piece):
                return [chars[c] for c in piece]
        return list(self.text(token_id).encode("utf-8"))


def _clamp(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


def chat_logprobs(
    lp: Logprobs, num_top: int, s: TokenStrings
) -> list[ChatCompletionLogProbsContent]:
    """OpenAI chat's choices[].logprobs.content: each token with its `num_top` most likely."""
    content = []
    for i, token_id in enumerate(lp.token_ids):
        top = [
            ChatCompletionLogProb(s.text(t), _clamp(v), s.bytes(t)) for t, v in lp.top(i)[:num_top]
        ]
        content.append(
            ChatCompletionLogProbsContent(
                s.text(token_id), _clamp(lp.logprobs[i]), s.bytes(token_id), top
            )
        )
    return content


def completion_logprobs(
    parts: list[Logprobs],
    num_top: int,
    s: TokenStrings,
    text_offset: int,
    unscored_first: int | None = None,
) -> CompletionLogProbs:
    """OpenAI completions' choices[].logprobs over consecutive positions: per token its text,
    logprob, offset in the choice's text (from `text_offset`, adding up token texts as vLLM does),
    and a dict of the chosen token and the `num_top` most likely (vLLM's num_top + 1 entries).

    `unscored_first`: a token shown first with no logprob (null): an echoed prompt's first token.
    """
    out = CompletionLogProbs([], [], [], [])

    def add(token_id: int, logprob: float | None, top: dict[str, float] | None) -> None:
        token = s.text(token_id)
        out.text_offset.append(
            out.text_offset[-1] + len(out.tokens[-1]) if out.tokens else text_offset
        )
        out.tokens.append(token)
        out.token_logprobs.append(logprob)
        out.top_logprobs.append(top)

    if unscored_first is not None:
        add(unscored_first, None, None)
    for lp in parts:
        for i, token_id in enumerate(lp.token_ids):
            logprob = _clamp(lp.logprobs[i])
            top = {s.text(token_id): logprob}
            for t, v in lp.top(i)[:num_top]:
                top.setdefault(s.text(t), _clamp(v))
            add(token_id, logprob, top)
    return out


def prompt_logprobs(
    prompt_token_ids: list[int], lp: Logprobs, num_top: int, s: TokenStrings
) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's prompt_logprobs: None for the first token, then for each prompt token a dict token id
    -> {logprob, rank, decoded_token} of the token itself and the `num_top` most likely."""
    assert lp.num_positions == len(prompt_token_ids) - 1
    out: list[dict[str, PromptLogprob] | None] = [None]
    for i, token_id in enumerate(lp.token_ids):
        entry = {
            str(token_id): PromptLogprob(_clamp(lp.logprobs[i]), lp.ranks[i], s.text(token_id))
        }
        for rank, (t, v) in enumerate(lp.top(i)[:num_top], start=1):
            entry.setdefault(str(t), PromptLogprob(_clamp(v), rank, s.text(t)))
        out.append(entry)
    return out


def lmdeploy_logprobs(lp: Logprobs) -> list[list[float | int]]:
    """LMDeploy's (and SGLang's) meta_info.output_token_logprobs: [logprob, token id] per token."""
    return [[_clamp(v), t] for v, t in zip(lp.logprobs, lp.token_ids)]

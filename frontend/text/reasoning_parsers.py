"""Reasoning parsers: split one choice's generated text into reasoning (the `<think>` block) and
content, as vLLM's `--reasoning-parser qwen3 | deepseek_r1` do. Text in, text out.

Whether the output starts inside a think block depends on the prompt: chat templates that open
`<think>` themselves (DeepSeek-R1, Qwen3 thinking-2507) leave the model to continue it, so the
caller passes `prompt_opens_reasoning(prompt_text)`.

NOTE: parse_reasoning is the fold of feed(text) + finish(); the parser releases text only once
no later text can change where it belongs, so any split of the same text folds to the same result.
"""

from __future__ import annotations

from dataclasses import dataclass

START_TAG, END_TAG = "<think>", "</think>"

_START, _REASONING, _AFTER_END, _CONTENT = "start", "reasoning", "after_end", "content"


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class StreamingReasoningParser:
    """One per choice. `reasoning_without_tag`: an output that does not open with `<think>` is
    reasoning anyway (DeepSeek-R1); otherwise it is all content (Qwen3 with thinking disabled)."""

    def __init__(self, *, starts_in_reasoning: bool, reasoning_without_tag: bool) -> None:
        self._reasoning_without_tag = reasoning_without_tag
        self._state = _REASONING if starts_in_reasoning else _START
        self._buf = ""

    def feed(self, text: str) -> ReasoningDelta:
        out = ReasoningDelta()
        self._buf += text
        if self._state == _START:
            s = self._buf.lstrip()
            if len(s) < len(START_TAG) and START_TAG.startswith(s):
                return out  # whitespace or a partial "<think": undecided
            if s.startswith(START_TAG):
                self._buf, self._state = s[len(START_TAG) :], _REASONING
            else:
                self._state = _REASONING if self._reasoning_without_tag else _CONTENT
        if self._state == _REASONING:
            i = self._buf.find(END_TAG)
            if i < 0:
                n = len(self._buf) - _partial_tag_len(self._buf, END_TAG)
                out.reasoning, self._buf = self._buf[:n], self._buf[n:]
                return out
            out.reasoning, self._buf = self._buf[:i], self._buf[i + len(END_TAG) :]
            self._state = _AFTER_END
        if self._state == _AFTER_END:
            # The newlines templates put between "</think>" and the answer are not content.
            self._buf = self._buf.lstrip("\n")
            if not self._buf:
                return out
            self._state = _CONTENT
        out.content, self._buf = self._buf, ""
        return out

    def finish(self) -> ReasoningDelta:
        out = ReasoningDelta()
        is_reasoning = self._state == _REASONING or (
            self._state == _START and self._reasoning_without_tag
        )
        if is_reasoning:
            out.reasoning = self._buf
        else:
            out.content = self._buf
        self._buf = ""
        return out


# name -> is the output reasoning even when it does not open with <think>?
_PARSERS = {"qwen3": False, "deepseek_r1": True}
REASONING_PARSERS: tuple[str, ...] = tuple(_PARSERS)


def make_reasoning_parser(name: str, prompt_opens_reasoning: bool) -> StreamingReasoningParser:
    if name not in _PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {REASONING_PARSERS}")
    return StreamingReasoningParser(
        starts_in_reasoning=prompt_opens_reasoning, reasoning_without_tag=_PARSERS[name]
    )


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """The rendered prompt ends inside a think block the template opened for the model."""
    return prompt_text.rfind(START_TAG) > prompt_text.rfind(END_TAG)


def parse_reasoning(parser: StreamingReasoningParser, text: str) -> tuple[str | None, str | None]:
    """The whole output at once: (reasoning, content), each None when empty."""
    reasoning, content = "", ""
    for delta in (parser.feed(text), parser.finish()):
        reasoning += delta.reasoning
        content += delta.content
    return reasoning or None, content or None

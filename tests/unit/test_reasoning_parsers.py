"""Reasoning parsers: the think block goes to `reasoning`, the rest to `content`, whether the tag
is in the output or in the prompt, and streaming in any split gives the non-streaming result."""

from __future__ import annotations

import random

import pytest

from frontend.text.reasoning_parsers import (
    REASONING_PARSERS,
    ReasoningDelta,
    StreamingReasoningParser,
    make_reasoning_parser,
    parse_reasoning,
    prompt_opens_reasoning,
)


def parse(name: str, text: str, opened: bool = False) -> tuple[str | None, str | None]:
    return parse_reasoning(make_reasoning_parser(name, opened), text)


def fold(parser: StreamingReasoningParser, chunks: list[str]) -> tuple[str | None, str | None]:
    deltas = [parser.feed(c) for c in chunks] + [parser.finish()]
    reasoning = "".join(d.reasoning for d in deltas)
    content = "".join(d.content for d in deltas)
    return reasoning or None, content or None


def test_qwen3_think_block_then_answer() -> None:
    assert parse("qwen3", "<think>\nLet me see.\n</think>\n\nParis.") == (
        "\nLet me see.\n",
        "Paris.",
    )
    assert parse("qwen3", "\n<think>a < b</think>x") == ("a < b", "x")


def test_qwen3_thinking_disabled_is_all_content() -> None:
    assert parse("qwen3", "Paris.") == (None, "Paris.")
    assert parse("qwen3", "  <thinking> is a tag") == (None, "  <thinking> is a tag")
    assert parse("qwen3", "\n") == (None, "\n")


def test_qwen3_decides_only_once_the_start_is_clear() -> None:
    parser = make_reasoning_parser("qwen3", False)
    assert parser.feed("\n<thi") == ReasoningDelta()
    assert parser.feed("nk>hm") == ReasoningDelta(reasoning="hm")
    parser = make_reasoning_parser("qwen3", False)
    assert parser.feed(" <thi") == ReasoningDelta()
    assert parser.feed("s") == ReasoningDelta(content=" <this")


def test_without_end_tag_all_is_reasoning() -> None:
    assert parse("qwen3", "<think>still going") == ("still going", None)
    assert parse("deepseek_r1", "still going </thi") == ("still going </thi", None)


def test_prompt_opened_reasoning() -> None:
    assert parse("qwen3", "hmm</think>\n\nAnswer", opened=True) == ("hmm", "Answer")
    assert parse("qwen3", "</think>Answer", opened=True) == (None, "Answer")


def test_deepseek_r1_is_reasoning_from_the_start() -> None:
    assert parse("deepseek_r1", "Let me think.</think>\n\nAnswer.") == ("Let me think.", "Answer.")
    assert parse("deepseek_r1", "<think>hmm</think>ok") == ("hmm", "ok")
    assert parse("deepseek_r1", "</think>ok") == (None, "ok")


def test_partial_end_tag_held_back() -> None:
    parser = make_reasoning_parser("deepseek_r1", True)
    assert parser.feed("abc</th") == ReasoningDelta(reasoning="abc")
    assert parser.feed("ere") == ReasoningDelta(reasoning="</there")
    assert parser.feed("</think>") == ReasoningDelta()
    assert parser.feed("\n") == ReasoningDelta()  # newlines right after </think> are dropped
    assert parser.feed("\nA\n") == ReasoningDelta(content="A\n")
    assert parser.finish() == ReasoningDelta()


def test_prompt_opens_reasoning() -> None:
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")
    assert prompt_opens_reasoning("<think>old</think> user turn <think>")


def test_make_reasoning_parser() -> None:
    assert REASONING_PARSERS == ("qwen3", "deepseek_r1")
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        make_reasoning_parser("granite", False)


CASES = [
    ("qwen3", False, "<think>\nStep 1 </thin and 2.\n</think>\n\nThe answer: 日本 🦀."),
    ("qwen3", False, "  No thinking <think> here."),
    ("qwen3", True, "opened by the template</think>\n\n\nok"),
    ("qwen3", False, "<think>never closed </think"),
    ("deepseek_r1", False, "R1 reasons</think>Answer</think>"),
    ("deepseek_r1", False, "\n<think>\nx\n</think>\n"),
    ("deepseek_r1", True, "no end tag at all"),
]


@pytest.mark.parametrize("name,opened,text", CASES)
def test_streaming_matches_non_streaming(name: str, opened: bool, text: str) -> None:
    expected = parse(name, text, opened)
    assert fold(make_reasoning_parser(name, opened), list(text)) == expected
    rng = random.Random(f"{name}:{text}")
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(0, 10)))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert fold(make_reasoning_parser(name, opened), chunks) == expected

"""Tool-call parsers: each format's calls, text around them, malformed output kept as content, and
the invariant the serving layer relies on: any split of the same text streams to exactly what the
non-streaming parse returns."""

from __future__ import annotations

import json
import random

import pytest

from frontend.text.tool_parsers import (
    TOOL_PARSERS,
    JsonArrayToolCallParser,
    NamedToolCallParser,
    ParsedDelta,
    StreamingToolParser,
    make_tool_parser,
    parse_tool_calls,
)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def parse(name: str, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = parse_tool_calls(make_tool_parser(name), text)
    for call in calls:
        assert call.id.startswith("chatcmpl-tool-") and len(call.id) == len("chatcmpl-tool-") + 32
    return content, [(c.name, c.arguments) for c in calls]


def stream(parser: StreamingToolParser, chunks: list[str]) -> list[ParsedDelta]:
    return [parser.feed(c) for c in chunks] + [parser.finish()]


def fold(deltas: list[ParsedDelta]) -> tuple[str | None, list[tuple[str, str]]]:
    """Reassemble a stream as a client would, checking the delta protocol on the way."""
    content, calls, ids = "", [], set()
    for delta in deltas:
        content += delta.content
        for d in delta.tool_calls:
            if d.index == len(calls):  # a new call: its first delta carries id and name
                assert d.id is not None and d.id not in ids and d.name is not None
                assert d.arguments == ""
                ids.add(d.id)
                calls.append([d.name, ""])
            else:
                assert d.index == len(calls) - 1 and d.id is None and d.name is None
                calls[-1][1] += d.arguments
    return content or None, [tuple(c) for c in calls]


def random_chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


# --- hermes -------------------------------------------------------------------------------------


def test_hermes_plain_text() -> None:
    assert parse("hermes", "Hello, world!") == ("Hello, world!", [])
    assert parse("hermes", "  \n") == ("  \n", [])  # no call at all: returned as generated


def test_hermes_one_call() -> None:
    text = f"<tool_call>\n{WEATHER}\n</tool_call>"
    assert parse("hermes", text) == (None, [("get_weather", '{"city": "Paris"}')])


def test_hermes_two_calls_and_whitespace_between_dropped() -> None:
    text = (
        f"\n<tool_call>\n{WEATHER}\n</tool_call>\n"
        '<tool_call>\n{"name": "get_time", "parameters": {"tz": "CET"}}\n</tool_call>\n'
    )
    assert parse("hermes", text) == (
        None,
        [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET"}')],
    )


def test_hermes_text_before_and_after() -> None:
    text = f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\nDone."
    assert parse("hermes", text) == (
        "Let me check.\n\nDone.",
        [("get_weather", '{"city": "Paris"}')],
    )


def test_hermes_invalid_json_is_content() -> None:
    bad = '<tool_call>\n{"name": get_weather}\n</tool_call>'
    assert parse("hermes", bad) == (bad, [])
    not_a_call = '<tool_call>[1, 2]</tool_call><tool_call>{"name": 1, "arguments": {}}</tool_call>'
    assert parse("hermes", not_a_call) == (not_a_call, [])
    text = f"{bad}\n<tool_call>{WEATHER}</tool_call>"
    assert parse("hermes", text) == (bad, [("get_weather", '{"city": "Paris"}')])


def test_hermes_unclosed_block_at_finish() -> None:
    assert parse("hermes", f"<tool_call>\n{WEATHER}\n") == (
        None,
        [("get_weather", '{"city": "Paris"}')],
    )
    assert parse("hermes", f"<tool_call>\n{WEATHER}\n</tool_") == (
        None,
        [("get_weather", '{"city": "Paris"}')],
    )
    cut = '<tool_call>\n{"name": "get_weather", "argu'
    assert parse("hermes", cut) == (cut, [])


def test_hermes_partial_tag_held_back_then_released() -> None:
    parser = make_tool_parser("hermes")
    assert parser.feed("a <tool").content == "a "
    assert parser.feed("box>").content == "<toolbox>"
    assert parser.finish() == ParsedDelta()
    assert parse("hermes", "a <toolbox>") == ("a <toolbox>", [])
    assert parse("hermes", "ends with <tool_c") == ("ends with <tool_c", [])


def test_hermes_arguments_unicode_nested_and_string_encoded() -> None:
    args = {"city": "Zürich", "note": "日本語 🦀", "opts": {"days": [1, 2], "deep": {"x": None}}}
    text = f"<tool_call>{json.dumps({'name': 'f', 'arguments': args})}</tool_call>"
    content, calls = parse("hermes", text)
    assert content is None and calls == [("f", json.dumps(args, ensure_ascii=False))]
    assert "Zürich" in calls[0][1] and "🦀" in calls[0][1]
    as_string = json.dumps({"name": "f", "arguments": json.dumps(args)})
    assert parse("hermes", f"<tool_call>{as_string}</tool_call>") == (content, calls)
    assert parse("hermes", '<tool_call>{"name": "now"}</tool_call>') == (None, [("now", "{}")])


def test_hermes_streams_content_before_call_at_once() -> None:
    parser = make_tool_parser("hermes")
    assert parser.feed("Sure").content == "Sure"
    assert parser.feed(", checking.\n<tool_call>{").content == ", checking.\n"
    delta = parser.feed(WEATHER[1:] + "</tool_call>")
    assert delta.content == "" and [d.name for d in delta.tool_calls] == ["get_weather", None]


# --- llama3_json --------------------------------------------------------------------------------


def test_llama3_json_plain_text_streams_after_leading_whitespace() -> None:
    parser = make_tool_parser("llama3_json")
    assert parser.feed("\n ").content == ""
    assert parser.feed("Hi").content == "\n Hi"
    assert parser.feed(" there").content == " there"
    assert parse("llama3_json", "The answer is {x}.") == ("The answer is {x}.", [])


def test_llama3_json_calls() -> None:
    one = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert parse("llama3_json", one) == (None, [("get_weather", '{"city": "Paris"}')])
    two = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}}'
    assert parse("llama3_json", two) == (None, [("a", '{"x": 1}'), ("b", "{}")])


def test_llama3_json_invalid_is_content() -> None:
    for text in (
        '{"name": "a", "parameters": {"x": 1}} and some text',
        '{"not": "a call"}',
        '{"name": "a", "parameters": ',
        "{}",
    ):
        assert parse("llama3_json", text) == (text, [])


# --- pythonic -----------------------------------------------------------------------------------


def test_pythonic_calls() -> None:
    text = '[get_weather(city="Paris", unit="c"), other()]'
    assert parse("pythonic", text) == (
        None,
        [("get_weather", '{"city": "Paris", "unit": "c"}'), ("other", "{}")],
    )
    tagged = (
        "<|python_start|>[f(a=True, b=None, c=-1.5, d=[1, 'é'], e={'k': (1, 2)})]<|python_end|>"
    )
    assert parse("pythonic", tagged) == (
        None,
        [("f", '{"a": true, "b": null, "c": -1.5, "d": [1, "é"], "e": {"k": [1, 2]}}')],
    )


def test_pythonic_invalid_is_content() -> None:
    for text in ('[f("positional")]', "[f(x=y)]", "[f(**kw)]", "[obj.method(a=1)]", "[f(a=1)"):
        assert parse("pythonic", text) == (text, [])


def test_pythonic_plain_text_released_once_it_cannot_be_calls() -> None:
    parser = make_tool_parser("pythonic")
    assert parser.feed("[see").content == ""
    assert parser.feed(" ref]").content == "[see ref]"
    assert parse("pythonic", "Hello.") == ("Hello.", [])


# --- constrained outputs ------------------------------------------------------------------------


def test_json_array_parser() -> None:
    text = (
        '[ {"name": "a", "parameters": {"s": "}]\\"{", "n": [1, {"m": 2}]}},\n'
        '  {"name": "b", "arguments": {"q": "日本"}} ]'
    )
    parser = JsonArrayToolCallParser()
    content, calls = fold(stream(parser, list(text)))
    assert content is None
    assert calls == [("a", '{"s": "}]\\"{", "n": [1, {"m": 2}]}'), ("b", '{"q": "日本"}')]
    # Each call is emitted the moment its element closes.
    parser = JsonArrayToolCallParser()
    first_end = text.index("}},") + 2
    assert len(parser.feed(text[:first_end]).tool_calls) == 2
    cut = JsonArrayToolCallParser()
    assert fold(stream(cut, [text[: first_end + 20]])) == (None, [calls[0]])


def test_named_tool_call_parser() -> None:
    parser = NamedToolCallParser("get_weather")
    deltas = stream(parser, ['{"city": ', "", '"Paris"}'])
    assert fold(deltas) == (None, [("get_weather", '{"city": "Paris"}')])
    assert [len(d.tool_calls) for d in deltas] == [2, 0, 1, 0]
    assert fold(stream(NamedToolCallParser("f"), [])) == (None, [])


def test_make_tool_parser() -> None:
    assert TOOL_PARSERS == ("hermes", "llama3_json", "pythonic")
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        make_tool_parser("mistral")


# --- streaming == non-streaming -----------------------------------------------------------------

STREAM_CASES = {
    "hermes": [
        "Plain <b>text</b> with a <tool and <toolbox> in it.",
        f"Thinking aloud.\n\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n"
        '{"name": "t", "arguments": {"u": "ü🦀"}}\n</tool_call>\n',
        '<tool_call>{"name": oops}</tool_call>  \n after <tool_call>{"name": "x"}</tool_call>',
        f"<tool_call>\n{WEATHER}\n</tool_c",
        '<tool_call>{"name": "x", "arg',
    ],
    "llama3_json": [
        "  Just text, nothing else.",
        '<|python_tag|>{"name": "a", "parameters": {"x": "é"}};{"name": "b", "parameters": {}}',
        '{"name": "a", "parameters": {}} trailing',
        " <|python_tag|>print(1)",
    ],
    "pythonic": [
        '[get_weather(city="Paris"), other(n=[1, 2], d={"k": None})]',
        '<|python_start|>[f(a="日本")]<|python_end|>',
        "[1] a citation, then prose.",
        "  [f(x)] not keyword args",
        "No brackets here.",
    ],
}


@pytest.mark.parametrize(
    "name,text", [(name, text) for name, texts in STREAM_CASES.items() for text in texts]
)
def test_streaming_matches_non_streaming(name: str, text: str) -> None:
    expected = parse(name, text)
    assert fold(stream(make_tool_parser(name), list(text))) == expected
    rng = random.Random(f"{name}:{text}")
    for _ in range(30):
        assert fold(stream(make_tool_parser(name), random_chunks(text, rng))) == expected


def test_json_array_streaming_any_split() -> None:
    text = '[{"name": "a", "parameters": {"s": "[{\\\\"}}, {"name": "b", "arguments": {}}]'
    expected = fold(stream(JsonArrayToolCallParser(), [text]))
    assert expected == (None, [("a", '{"s": "[{\\\\"}'), ("b", "{}")])
    rng = random.Random(0)
    for _ in range(30):
        assert fold(stream(JsonArrayToolCallParser(), random_chunks(text, rng))) == expected

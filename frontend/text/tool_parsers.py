"""Tool-call parsers: one choice's generated text -> message content plus structured tool calls.

The formats are those vLLM's `--tool-call-parser` names (hermes, llama3_json, pythonic), plus two
that constrained decoding makes simple: a JSON array of calls (tool_choice "required") and a bare
arguments object (a named tool_choice). Text in, deltas out: this module knows nothing of tokens.

NOTE: the non-streaming result is defined as the fold of feed(text) + finish(). Every parser decides
only from the text seen so far and never takes back what it released, so the same text fed in any
split folds to the same content and calls; the streaming and non-streaming paths cannot disagree.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class ToolCallDelta:
    index: int  # 0, 1, ... in the order calls appear in the output
    id: str | None = None  # set on a call's first delta only
    name: str | None = None  # set on a call's first delta only
    arguments: str = ""  # a fragment of the JSON-encoded arguments object


@dataclass
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object


class StreamingToolParser(Protocol):
    """One instance per generated choice."""

    def feed(self, text: str) -> ParsedDelta: ...

    def finish(self) -> ParsedDelta: ...


def _new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (could still grow
    into it, so must not be released yet)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _call_from_obj(obj: Any) -> tuple[str, str] | None:
    """(name, arguments JSON) of a {"name", "arguments" | "parameters"} object, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    # A call of a function without parameters often omits them altogether.
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
    if isinstance(args, str):  # some models encode the arguments object as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def _emit_call(out: ParsedDelta, index: int, name: str, arguments: str) -> None:
    out.tool_calls.append(ToolCallDelta(index, _new_call_id(), name, ""))
    out.tool_calls.append(ToolCallDelta(index, arguments=arguments))


class HermesToolParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, with text around them.

    Text outside blocks comes in segments (before the first block, between blocks, after the last).
    A segment that is only whitespace is dropped (the newlines models put around blocks); any other
    is content, streamed once its first non-whitespace character arrives. The exception is an
    output with no block at all: it is returned exactly as generated.
    """

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buf = ""  # outside a block: the held part of the segment; inside: the block so far
        self._in_block = False
        self._seen_block = False
        self._committed = False  # the current segment showed non-whitespace: it is all content
        self._scan_from = 0  # inside a block: where the search for END resumes
        self._num_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._buf += text
        while True:
            if self._in_block:
                j = self._buf.find(self.END, self._scan_from)
                if j < 0:
                    self._scan_from = max(0, len(self._buf) - len(self.END) + 1)
                    return out
                self._close_block(self._buf[:j], out)
                self._buf = self._buf[j + len(self.END) :]
                self._in_block, self._committed = False, False
                continue
            i = self._buf.find(self.START)
            if i < 0:
                head = self._buf[: len(self._buf) - _partial_tag_len(self._buf, self.START)]
                if self._committed or head.strip():
                    self._committed = True
                    out.content += head
                    self._buf = self._buf[len(head) :]
                return out
            if self._committed or self._buf[:i].strip():
                out.content += self._buf[:i]
            self._buf = self._buf[i + len(self.START) :]
            self._in_block, self._seen_block, self._scan_from = True, True, 0

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._in_block:
            # EOS before </tool_call>: a complete call is still a call (after any partial end tag).
            inner = self._buf[: len(self._buf) - _partial_tag_len(self._buf, self.END)]
            call = self._parse_block(inner)
            if call is None:
                out.content += self.START + self._buf
            else:
                self._emit(call, out)
        elif self._committed or self._buf.strip() or not self._seen_block:
            out.content += self._buf
        self._buf = ""
        return out

    def _close_block(self, inner: str, out: ParsedDelta) -> None:
        call = self._parse_block(inner)
        if call is None:
            out.content += self.START + inner + self.END
        else:
            self._emit(call, out)

    def _emit(self, call: tuple[str, str], out: ParsedDelta) -> None:
        _emit_call(out, self._num_calls, *call)
        self._num_calls += 1

    @staticmethod
    def _parse_block(inner: str) -> tuple[str, str] | None:
        try:
            return _call_from_obj(json.loads(inner.strip()))
        except json.JSONDecodeError:
            return None


class _WholeOutputToolParser:
    """Formats whose calls are the whole output. The first characters decide: plain text streams as
    it comes; a likely call list is held to the end and parsed, and if it does not parse it is
    returned whole as content."""

    def __init__(self) -> None:
        self._buf = ""
        self._mode: str | None = None  # None (undecided), "calls" or "text"

    def feed(self, text: str) -> ParsedDelta:
        if self._mode == "text":
            return ParsedDelta(content=text)
        self._buf += text
        if self._mode is None:
            self._mode = self._classify(self._buf)
        if self._mode == "text":
            out, self._buf = ParsedDelta(content=self._buf), ""
            return out
        return ParsedDelta()

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        calls = self._parse(self._buf) if self._mode == "calls" else None
        if calls:
            for index, call in enumerate(calls):
                _emit_call(out, index, *call)
        else:
            out.content = self._buf
        self._buf = ""
        return out

    def _classify(self, text: str) -> str | None:
        raise NotImplementedError

    def _parse(self, text: str) -> list[tuple[str, str]] | None:
        raise NotImplementedError


def _strip_leading_tag(text: str, tag: str) -> str | None:
    """`text` without leading whitespace and an optional `tag`; None while it could still be the
    tag or what follows it is still only whitespace (undecided)."""
    s = text.lstrip()
    if len(s) <= len(tag) and tag.startswith(s):
        return None
    if s.startswith(tag):
        s = s[len(tag) :].lstrip()
    return s or None


class Llama3JsonToolParser(_WholeOutputToolParser):
    """Llama 3.x JSON calls: `{"name": ..., "parameters": {...}}`, several separated by `;`,
    optionally after `<|python_tag|>`."""

    TAG = "<|python_tag|>"

    def _classify(self, text: str) -> str | None:
        s = _strip_leading_tag(text, self.TAG)
        if s is None:
            return None
        if s[0] != "{":
            return "text"
        rest = s[1:].lstrip()
        if not rest:
            return None
        return "calls" if rest[0] == '"' else "text"

    def _parse(self, text: str) -> list[tuple[str, str]] | None:
        s = text.strip().removeprefix(self.TAG)
        decoder, calls, i = json.JSONDecoder(), [], 0
        while True:
            while i < len(s) and (s[i].isspace() or s[i] == ";"):
                i += 1
            if i == len(s):
                return calls or None
            try:
                obj, i = decoder.raw_decode(s, i)
            except json.JSONDecodeError:
                return None
            call = _call_from_obj(obj)
            if call is None:
                return None
            calls.append(call)


# What the start of a pythonic call list looks like: "[" name "(". _OPENING_SO_FAR is a start that
# could still grow into it, so the decision waits.
_PYTHONIC_OPENING = re.compile(r"\[\s*[A-Za-z_]\w*\s*\(")
_PYTHONIC_OPENING_SO_FAR = re.compile(r"\[\s*(?:[A-Za-z_]\w*\s*)?")


class PythonicToolParser(_WholeOutputToolParser):
    """Llama 3.2 / 4 pythonic calls: `[get_weather(city="Paris"), other()]`, optionally between
    `<|python_start|>` and `<|python_end|>`. Keyword arguments with literal values only."""

    START, END = "<|python_start|>", "<|python_end|>"

    def _classify(self, text: str) -> str | None:
        s = _strip_leading_tag(text, self.START)
        if s is None:
            return None
        if _PYTHONIC_OPENING.match(s):
            return "calls"
        return None if _PYTHONIC_OPENING_SO_FAR.fullmatch(s) else "text"

    def _parse(self, text: str) -> list[tuple[str, str]] | None:
        s = text.strip().removeprefix(self.START).removesuffix(self.END).strip()
        try:
            tree = ast.parse(s, mode="eval")
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return None
        calls = []
        for node in tree.body.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return None
            try:
                kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
                if None in kwargs:  # **kwargs
                    return None
                calls.append((node.func.id, json.dumps(kwargs, ensure_ascii=False)))
            except (ValueError, TypeError, SyntaxError, RecursionError):
                return None
        return calls


class JsonArrayToolCallParser:
    """For tool_choice "required": the output is constrained to a JSON array of
    {"name": str, "parameters" | "arguments": object}. Each element becomes a call as soon as it
    closes; nothing is ever content, and an element cut off by the end of generation is ignored."""

    def __init__(self) -> None:
        self._depth = 0  # 1 inside the array, 2+ inside an element
        self._in_string = False
        self._escaped = False
        self._elem: list[str] = []
        self._num_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        for ch in text:
            if self._depth < 2:
                if ch == "[" and self._depth == 0:
                    self._depth = 1
                elif ch == "{" and self._depth == 1:
                    self._depth, self._elem = 2, [ch]
                continue  # whitespace, commas and brackets between elements
            self._elem.append(ch)
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 1:
                    self._close_element(out)
        return out

    def finish(self) -> ParsedDelta:
        return ParsedDelta()

    def _close_element(self, out: ParsedDelta) -> None:
        text, self._elem = "".join(self._elem), []
        try:
            call = _call_from_obj(json.loads(text))
        except json.JSONDecodeError:
            call = None
        if call is not None:
            _emit_call(out, self._num_calls, *call)
            self._num_calls += 1


class NamedToolCallParser:
    """For a named tool_choice: the output is constrained to that tool's arguments object, so all
    of it is the arguments of call 0."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._started = False

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if not text:
            return out
        if not self._started:
            self._started = True
            out.tool_calls.append(ToolCallDelta(0, _new_call_id(), self.name, ""))
        out.tool_calls.append(ToolCallDelta(0, arguments=text))
        return out

    def finish(self) -> ParsedDelta:
        return ParsedDelta()


_PARSERS: dict[str, type[StreamingToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "pythonic": PythonicToolParser,
}
TOOL_PARSERS: tuple[str, ...] = tuple(_PARSERS)


def make_tool_parser(name: str) -> StreamingToolParser:
    if name not in _PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {TOOL_PARSERS}")
    return _PARSERS[name]()


def parse_tool_calls(parser: StreamingToolParser, text: str) -> tuple[str | None, list[ToolCall]]:
    """The whole output at once: (content or None, calls), the fold of feed(text) + finish()."""
    content, calls = "", {}
    for delta in (parser.feed(text), parser.finish()):
        content += delta.content
        for d in delta.tool_calls:
            call = calls.setdefault(d.index, ToolCall(id="", name="", arguments=""))
            if d.name is not None:
                call.id, call.name = d.id or "", d.name
            call.arguments += d.arguments
    return content or None, [calls[i] for i in sorted(calls)]

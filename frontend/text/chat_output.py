"""One chat choice's generated text -> reasoning, content and tool calls, streamed or whole.

The reasoning parser (if the server has one) splits the text first; the tool parser (if the request
uses tools) reads what is content after it. A whole message is the fold of the stream, so a
streamed choice reassembles to exactly the unstreamed one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from frontend.common.protocol import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from frontend.text.reasoning_parsers import StreamingReasoningParser
from frontend.text.tool_parsers import ParsedDelta, StreamingToolParser, ToolCallDelta


@dataclass
class ChoiceDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ChoiceParser:
    def __init__(
        self,
        reasoning: StreamingReasoningParser | None,
        tools: StreamingToolParser | None,
        max_calls: int | None = None,
        include_reasoning: bool = True,
    ) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.max_calls = max_calls  # parallel_tool_calls false: calls after the first are dropped
        self.include_reasoning = include_reasoning

    def feed(self, text: str) -> ChoiceDelta:
        if self.reasoning is None:
            return self._tools(ParsedDelta(), "", text, final=False)
        r = self.reasoning.feed(text)
        return self._tools(ParsedDelta(), r.reasoning, r.content, final=False)

    def finish(self) -> ChoiceDelta:
        reasoning, content = "", ""
        if self.reasoning is not None:
            r = self.reasoning.finish()
            reasoning, content = r.reasoning, r.content
        return self._tools(ParsedDelta(), reasoning, content, final=True)

    def _tools(self, out: ParsedDelta, reasoning: str, content: str, final: bool) -> ChoiceDelta:
        if self.tools is None:
            out.content = content
        else:
            parsed = self.tools.feed(content) if content else ParsedDelta()
            out.content, out.tool_calls = parsed.content, parsed.tool_calls
            if final:
                last = self.tools.finish()
                out.content += last.content
                out.tool_calls += last.tool_calls
        calls = out.tool_calls
        if self.max_calls is not None:
            calls = [c for c in calls if c.index < self.max_calls]
        return ChoiceDelta(reasoning if self.include_reasoning else "", out.content, calls)


@dataclass
class ParsedMessage:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]


def parse_message(parser: ChoiceParser, text: str) -> ParsedMessage:
    """The whole message: the fold of feed(text) and finish()."""
    parts = [parser.feed(text), parser.finish()]
    reasoning = "".join(p.reasoning for p in parts)
    content = "".join(p.content for p in parts)
    calls: dict[int, ToolCall] = {}
    for d in (d for p in parts for d in p.tool_calls):
        if d.index not in calls:
            calls[d.index] = ToolCall(d.id or "", FunctionCall(d.name or "", ""))
        calls[d.index].function.arguments += d.arguments
    return ParsedMessage(reasoning or None, content or None, [calls[i] for i in sorted(calls)])


def delta_message(delta: ChoiceDelta) -> DeltaMessage:
    """A stream chunk's delta: reasoning under both names vLLM has used, tool calls as OpenAI's
    (one entry per call index: clients merge a chunk's entries by index, and some keep only the
    last of two with the same index)."""
    merged: dict[int, DeltaToolCall] = {}
    for d in delta.tool_calls:
        entry = merged.get(d.index)
        if entry is None:
            merged[d.index] = DeltaToolCall(
                d.index,
                d.id,
                "function" if d.id is not None else None,
                DeltaFunctionCall(d.name, d.arguments),
            )
            continue
        assert entry.function is not None
        entry.function.arguments = (entry.function.arguments or "") + d.arguments
    reasoning = delta.reasoning or None
    return DeltaMessage(
        content=delta.content or None,
        reasoning_content=reasoning,
        reasoning=reasoning,
        tool_calls=list(merged.values()) or None,
    )

"""The server's chat flags: tool calling and reasoning (--enable-auto-tool-choice,
--tool-call-parser, --reasoning-parser)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChatOptions:
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # frontend/text/tool_parsers.py TOOL_PARSERS
    reasoning_parser: str | None = None  # frontend/text/reasoning_parsers.py REASONING_PARSERS

"""Response types more than one API package answers with: usage, logprobs, tool calls, chat deltas.

OpenAI's shapes (as vLLM serves them): the text layer builds logprobs and tool calls in them
(frontend/text/logprobs.py, frontend/text/chat_output.py), serving counts usage in them, and the API
packages put them in their own responses. This module knows nothing about tokenizers or the engine.
"""

from __future__ import annotations

import msgspec


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class UsageInfo(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ChatCompletionLogProb(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[ChatCompletionLogProb] = []


class CompletionLogProbs(msgspec.Struct):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class PromptLogprob(msgspec.Struct):
    """vLLM's Logprob, in prompt_logprobs: [None, {token id: PromptLogprob}, ...]."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobsList = list[dict[str, PromptLogprob] | None]


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class DeltaFunctionCall(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    """A streamed tool call: index, id, type and name on its first chunk, then argument pieces."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

"""What every chat-shaped route shares (OpenAI's chat completions and Responses, Anthropic's
Messages): the server's chat options, the output constraint when the model reasons first, and the
parser of one choice's text into reasoning, content and tool calls.

The routes themselves (their requests, their answers) live in their API packages.
"""

from __future__ import annotations

from typing import Any

import msgspec

from enginecore.messages import MultiModalItem, StructuredOutputSpec
from frontend.common.decoding import MediaRef
from frontend.serving.base import OpenAIServing
from frontend.text.chat_options import ChatOptions
from frontend.text.chat_output import ChoiceParser
from frontend.text.reasoning_parsers import make_reasoning_parser, prompt_opens_reasoning
from frontend.text.tool_calling import ToolPlan

REASONING_END = "</think>"


class ChatPath:
    """The shared half of the chat routes; openai/chat.py's ChatServing adds /v1/chat/completions."""

    def __init__(self, serving: OpenAIServing, options: ChatOptions | None = None) -> None:
        self.serving = serving
        self.options = options or ChatOptions()
        self._reasoning_end_ids: list[int] | None = None

    def after_reasoning(
        self, constraint: StructuredOutputSpec | None, prompt_text: str
    ) -> tuple[StructuredOutputSpec | None, bool]:
        """(the constraint, starting after the reasoning when the model will reason first;
        whether the prompt opened a think block)."""
        name = self.options.reasoning_parser
        if name is None:
            return constraint, False
        opens = prompt_opens_reasoning(prompt_text)
        # deepseek_r1 reasons from its first token unless the prompt already closed the block.
        reasons_first = opens or (
            name == "deepseek_r1" and not prompt_text.rstrip().endswith(REASONING_END)
        )
        if constraint is not None and reasons_first:
            if self._reasoning_end_ids is None:
                tokenizer = self.serving.tokenizer
                self._reasoning_end_ids = tokenizer.encode(REASONING_END, add_special_tokens=False)
            constraint = msgspec.structs.replace(
                constraint, reasoning_end_token_ids=self._reasoning_end_ids
            )
        return constraint, opens

    async def image_prompt(
        self,
        prompt_text: str,
        images: list[MediaRef],
        options: dict[str, Any] | None,
        param: str,
        add_special_tokens: bool = False,
    ) -> tuple[list[int], list[MultiModalItem]]:
        """A rendered chat prompt with image markers -> its token ids with the images'
        placeholders, and the images' items (frontend/media/)."""
        images_path = self.serving.images
        assert images_path is not None, "image parts are only collected where images are served"
        return await images_path.make(prompt_text, images, options, param, add_special_tokens)

    def choice_parser(
        self, plan: ToolPlan, opens_reasoning: bool, include_reasoning: bool = True
    ) -> ChoiceParser:
        """A parser of one choice's text into reasoning, content and tool calls."""
        name = self.options.reasoning_parser
        reasoning = make_reasoning_parser(name, opens_reasoning) if name else None
        tools = plan.new_parser() if plan.new_parser is not None else None
        return ChoiceParser(reasoning, tools, plan.max_calls, include_reasoning)

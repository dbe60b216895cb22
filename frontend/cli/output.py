"""`tern launch` flags of what the model is given and how its output is read: the chat template,
the default sampling parameters (generation config), the tool-call and reasoning parsers, and the
bound on JSON numbers in structured output. Builds the ChatOptions and the StructuredOutputConfig,
and loads the chat template (the FrontendConfig carries both)."""

from __future__ import annotations

import argparse
from pathlib import Path

import jinja2

from enginecore.config import StructuredOutputConfig
from frontend.text.chat_options import ChatOptions
from frontend.text.reasoning_parsers import REASONING_PARSERS
from frontend.text.tool_parsers import TOOL_PARSERS


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("chat and output")
    group.add_argument(
        "--generation-config",
        default="auto",
        help="default sampling parameters: 'auto' (the model's generation_config.json), 'vllm' "
        "(none: the API's defaults), or a folder holding a generation_config.json",
    )
    group.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template file, or the template itself, replacing the model's",
    )
    _add_parser_args(group)
    group.add_argument(
        "--no-json-number-bound",
        dest="json_number_bound",
        action="store_false",
        help="let JSON numbers in structured output have any number of digits (by default at "
        "most 17 significant digits and a 3-digit exponent, so a weak model cannot loop in one)",
    )


def _add_parser_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide when to call tools (tool_choice "auto"); needs '
        "--tool-call-parser",
    )
    group.add_argument(
        "--tool-call-parser",
        choices=TOOL_PARSERS,
        default=None,
        help="how tool calls are written in the model's output",
    )
    group.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="split <think>...</think> off into message.reasoning_content",
    )


def chat_options_from_args(args: argparse.Namespace) -> ChatOptions:
    return ChatOptions(
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )


def structured_output_config_from_args(args: argparse.Namespace) -> StructuredOutputConfig:
    return StructuredOutputConfig(bound_json_numbers=args.json_number_bound)


def load_chat_template(value: str | None) -> str | None:
    """A template file's text, or the argument itself when it is a template; checked for syntax."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        template = path.read_text()
    elif any(c in value for c in "{}\n"):
        template = value
    else:
        raise ValueError(f"--chat-template {value}: no such file, and not a Jinja template")
    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: template syntax error (line {e.lineno}): {e}") from None
    return template

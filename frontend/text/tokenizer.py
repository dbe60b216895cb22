"""The frontend's tokenizer: prompts and chat messages to token ids, plus what the model's files say
about stopping (EOS ids) and default sampling settings.

Loaded once in the frontend process from the model directory (tokenizer.json, tokenizer_config.json,
generation_config.json). The engine core and the workers never see text.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
from pathlib import Path
from typing import Any

import tokenizers
from jinja2 import TemplateError
from transformers import TokenizersBackend

from enginecore.config import GGUF_SOURCE_FILE
from frontend.common.errors import bad_request
from frontend.text.tokenizer_class import auto_tokenizer

logger = logging.getLogger("tern.frontend")

# Sampling defaults a model's generation_config.json may recommend; vLLM applies them to requests
# that leave the field out, and so do we.
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class Tokenizer:
    """A Hugging Face tokenizer with the model's EOS ids and generation defaults."""

    def __init__(self, model_path: str | Path, chat_template: str | None = None) -> None:
        """`chat_template` (the template's text) replaces the model's own."""
        path = Path(model_path)
        # A GGUF file's tokenizer is the tokenizer.json transformers converted from it: loaded as
        # it is (AutoTokenizer would rebuild some families' pre-tokenizers from their class).
        is_gguf = (path / GGUF_SOURCE_FILE).is_file()
        try:
            self.hf = (
                TokenizersBackend.from_pretrained(str(path)) if is_gguf else auto_tokenizer(path)
            )
        except Exception as e:
            raise ValueError(f"cannot load a tokenizer from {path}: {e}") from e
        backend = getattr(self.hf, "backend_tokenizer", None)
        if not isinstance(backend, tokenizers.Tokenizer):  # noqa: TRY004 (a user-facing error)
            raise ValueError(
                f"{path} has no fast (tokenizers) tokenizer; tern needs tokenizer.json"
            )
        self.backend: tokenizers.Tokenizer = backend
        if chat_template is not None:
            self.hf.chat_template = chat_template
        self.vocab_size = len(self.hf)
        gen_config = _read_json(path / "generation_config.json")
        self.eos_token_ids = _eos_token_ids(gen_config, self.hf.eos_token_id)
        self.generation_defaults: dict[str, Any] = {
            k: gen_config[k] for k in GENERATION_DEFAULT_KEYS if gen_config.get(k) is not None
        }

    @functools.cached_property
    def _template_call_params(self) -> set[str]:
        params = inspect.signature(self.hf.apply_chat_template).parameters.values()
        return {p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD}

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_strs(self, token_ids: list[int]) -> list[str]:
        """Each token's string in the vocabulary (byte-level pieces as stored, e.g. 'Ġthe')."""
        return [self.backend.id_to_token(t) or "" for t in token_ids]

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Renders the chat template and tokenizes it. Template errors are the client's (400)."""
        text = self.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
        )
        # NOTE: the rendered template already holds the special tokens it wants (BOS, role markers);
        # vLLM tokenizes it without adding more unless the client asks for add_special_tokens.
        return self.encode(text, add_special_tokens=add_special_tokens)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The chat template's text for these messages (and tools, if the template shows them)."""
        if not self.has_chat_template:
            raise bad_request("this model has no chat template; use /v1/completions", "messages")
        kwargs = dict(chat_template_kwargs or {})
        # NOTE: only template variables: apply_chat_template's own parameters (tools, documents,
        # tokenize, return_tensors, ...) would change what the call does.
        reserved = sorted(set(kwargs) & self._template_call_params)
        if reserved:
            raise bad_request(
                f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs"
            )
        try:
            text = self.hf.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                tools=tools or None,
                **kwargs,
            )
        except (TemplateError, ValueError, TypeError, KeyError) as e:
            raise bad_request(f"the chat template failed on these messages: {e}", "messages") from e
        return text


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path) as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _eos_token_ids(gen_config: dict[str, Any], tokenizer_eos: int | None) -> list[int]:
    """EOS ids from generation_config.json (int or list) plus the tokenizer's own, in order."""
    raw = gen_config.get("eos_token_id")
    ids = [raw] if isinstance(raw, int) else list(raw or [])
    if tokenizer_eos is not None:
        ids.append(tokenizer_eos)
    return list(dict.fromkeys(i for i in ids if isinstance(i, int)))

"""Request decoding shared by every API package: a body into its msgspec struct, with 400s that name
the field, and the checks several protocols run (unsupported fields, logprob counts, chat messages).

A known field this server does not implement is declared once, on its struct, with the values that
mean "not used": `best_of: Annotated[Any, Unsupported(None, 1)] = UNSET`. Any other value is a 400
naming the field (check_unsupported), so a request is never silently served without it.

Errors are APIError (frontend/common/errors.py). This module knows nothing about tokenizers, the
engine or any one API's fields.
"""

from __future__ import annotations

import functools
import json
import re
import typing
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from msgspec import UNSET

from frontend.common.errors import bad_request

T = TypeVar("T")
M = TypeVar("M")

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# Why a part other than text is refused on a model served without image inputs.
_TEXT_ONLY = {
    "image_url": "this model is served without image inputs",
    "video_url": "this model is served without video inputs",
    "input_audio": "this model is served without audio inputs",
    "audio_url": "this model is served without audio inputs",
}
MAX_LOGPROBS = 20  # most likely tokens per position (vLLM's default --max-logprobs)

_PARAM_RE = re.compile(r"at `\$\.([A-Za-z_][A-Za-z0-9_]*)")
_FIELD_RE = re.compile(r"field `([A-Za-z_][A-Za-z0-9_]*)`")

_decoders: dict[type, msgspec.json.Decoder[Any]] = {}


@dataclass(frozen=True)
class MediaRef:
    """An image, video or audio part of a request: its URL (an input_audio part's bytes as a data: URL),
    the request field that holds it (for errors) and its modality."""

    url: str
    param: str
    modality: str = "image"


# Content part types -> the modality they carry.
_MEDIA_PARTS = {
    "image_url": "image",
    "video_url": "video",
    "input_audio": "audio",
    "audio_url": "audio",
}


def decode_request(body: bytes, typ: type[T]) -> T:
    """Decodes a request body into `typ` and runs its validate() if it has one.

    Raises APIError(400) with `param` set when the offending field is known.
    """
    decoder = _decoders.get(typ)
    if decoder is None:
        decoder = _decoders[typ] = msgspec.json.Decoder(typ)
    try:
        req = decoder.decode(body)
    except msgspec.ValidationError as e:
        msg = str(e)
        m = _PARAM_RE.search(msg) or _FIELD_RE.search(msg)
        raise bad_request(msg, m.group(1) if m else None) from None
    except msgspec.DecodeError as e:
        raise bad_request(f"malformed JSON body: {e}") from None
    except UnicodeDecodeError as e:  # msgspec's error for strings that are not UTF-8
        raise bad_request(f"the request body is not valid UTF-8: {e}") from None
    validate = getattr(req, "validate", None)
    if validate is not None:
        validate()
    return req


class Unsupported:
    """The annotation of a known field this server does not implement: the values that mean "not
    used" (the field's default, UNSET, is always allowed)."""

    __slots__ = ("allowed",)

    def __init__(self, *allowed: Any) -> None:
        self.allowed = allowed


def field_markers(cls: type, marker: type[M]) -> dict[str, M]:
    """The fields of struct `cls` (its bases' first) annotated `Annotated[..., marker(...)]`."""
    return _field_markers(cls, marker)


@functools.cache
def _field_markers(cls: type, marker: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls, include_extras=True)
    return {
        name: m
        for name, hint in hints.items()
        for m in getattr(hint, "__metadata__", ())
        if isinstance(m, marker)
    }


@functools.cache
def unsupported_fields(cls: type) -> dict[str, tuple[Any, ...]]:
    """Field name -> the values that mean "not used", of every Unsupported field of `cls` (once
    per request type: every request is checked against it)."""
    return {name: m.allowed for name, m in field_markers(cls, Unsupported).items()}


def check_unsupported(req: Any) -> None:
    """400 naming the first Unsupported field of `req` set to a value other than its "not used"
    ones."""
    for name, allowed in unsupported_fields(type(req)).items():
        value = getattr(req, name)
        if value is not UNSET and not _is_allowed(value, allowed):
            raise bad_request(f"'{name}' is not supported by this server", name)


def _is_allowed(value: Any, allowed: tuple[Any, ...]) -> bool:
    # NOTE: type-checked equality, so that `1` does not pass for `True` nor `0` for `False`.
    for a in allowed:
        strict = value is None or a is None or isinstance(a, bool) or isinstance(value, bool)
        if (value is a) if strict else (value == a):
            return True
    return False


def check_num_logprobs(k: int | None, param: str) -> None:
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise bad_request(f"{param} must be in [0, {MAX_LOGPROBS}], got {k}", param)


def check_spaces_between_special_tokens(req: Any) -> None:
    """Spaces around shown special tokens are what the tokenizers backend cannot do."""
    if req.spaces_between_special_tokens is True and req.skip_special_tokens is False:
        raise bad_request(
            "spaces_between_special_tokens: true is not supported with skip_special_tokens: "
            "false (special tokens are joined to the text without spaces)",
            "spaces_between_special_tokens",
        )


def normalize_messages(
    messages: list[dict[str, Any]],
    media: list[MediaRef] | None = None,
    modalities: tuple[str, ...] = ("image",),
) -> list[dict[str, Any]]:
    """Chat messages as chat templates expect them, from any form OpenAI's API allows.

    `content` is always there and a string (templates index it): text-part lists are joined,
    an assistant's absent or null content (a turn of tool calls only) is "", and an assistant's
    `refusal` stands in for its content; tool calls' arguments become objects. Raises APIError
    (400, param messages[i].<field>) for what the API forbids: a missing or unknown role, content
    missing where it is required, non-text parts, tool calls off an assistant message.

    `media`: when given (the model takes `modalities`), their parts are allowed (`image_url`;
    vLLM's `video_url`; `input_audio` and vLLM's `audio_url`): a message with one keeps its content
    as a list of text and `{"type": "image"}` / `{"type": "video"}` / `{"type": "audio"}` parts
    (the form multimodal chat templates read),
    and each part's URL is appended to `media` in prompt order.
    """
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    return [_normalize_message(i, m, media, modalities) for i, m in enumerate(messages)]


def _normalize_message(
    i: int, message: Any, media: list[MediaRef] | None, modalities: tuple[str, ...]
) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise bad_request("each message must be an object", f"messages[{i}]")
    role = message.get("role")
    if not isinstance(role, str):
        raise bad_request("each message needs a string 'role'", f"messages[{i}].role")
    if role not in CHAT_ROLES:
        raise bad_request(
            f"unsupported role {role!r}; expected one of {', '.join(CHAT_ROLES)}",
            f"messages[{i}].role",
        )
    for name in ("name", "tool_call_id", "refusal"):
        value = message.get(name)
        if value is not None and not isinstance(value, str):
            raise bad_request(f"{name} must be a string", f"messages[{i}].{name}")
    out = {k: v for k, v in message.items() if k != "refusal"}
    out["content"] = _content(i, role, message, media, modalities)
    if role == "developer":  # OpenAI's newer name for system instructions; templates know system
        out["role"] = "system"
    if message.get("tool_calls") is not None:
        out["tool_calls"] = _template_tool_calls(i, message)
    elif "tool_calls" in out:
        del out["tool_calls"]  # null: templates test for the key
    return out


def _content(
    i: int,
    role: str,
    message: dict[str, Any],
    media: list[MediaRef] | None,
    modalities: tuple[str, ...],
) -> str | list[dict[str, Any]]:
    """The message's content: one string, or with media the list of its text and media parts."""
    content = message.get("content")
    if media is None or not isinstance(content, list):
        return _content_text(i, role, message)
    served = [k for k, modality in _MEDIA_PARTS.items() if modality in modalities]
    if not any(isinstance(p, dict) and p.get("type") in served for p in content):
        return _content_text(i, role, message)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        param = f"messages[{i}].content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind in served:
            modality = _MEDIA_PARTS[kind]
            media.append(MediaRef(_media_url(part, kind, param), param, modality))
            parts.append({"type": modality})
        elif kind in _MEDIA_PARTS:
            raise bad_request(f"this model is served without {_MEDIA_PARTS[kind]} inputs", param)
        else:
            raise bad_request(f"content part type {kind!r} is not supported with media", param)
    return parts


def _media_url(part: dict[str, Any], kind: str, param: str) -> str:
    """A media part's URL (an image_url's `detail` is accepted and ignored, as vLLM does); an
    input_audio part's base64 `data` becomes a data: URL of its `format`."""
    if kind == "input_audio":
        audio = part.get("input_audio")
        data = audio.get("data") if isinstance(audio, dict) else None
        fmt = audio.get("format", "wav") if isinstance(audio, dict) else None
        if not isinstance(data, str) or not data or not isinstance(fmt, str):
            raise bad_request("an input_audio part needs input_audio.data, base64", param)
        return f"data:audio/{fmt};base64,{data}"
    value = part.get(kind)
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise bad_request(f"a {kind} part needs {kind}.url, a string", param)
    return url


def _content_text(i: int, role: str, message: dict[str, Any]) -> str:
    """The message's content as one string (absent or null only on an assistant turn)."""
    content = message.get("content")
    if content is None:
        if role != "assistant":
            raise bad_request(f"a {role} message needs 'content'", f"messages[{i}].content")
        return message.get("refusal") or ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("content must be a string or a list of parts", f"messages[{i}].content")
    texts = []
    for j, part in enumerate(content):
        param = f"messages[{i}].content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        # An assistant's parts may be refusals (OpenAI's ChatCompletionContentPartRefusal).
        key = "refusal" if kind == "refusal" and role == "assistant" else "text"
        if kind != key:
            raise bad_request(
                f"content part type {kind!r} is not supported ({_TEXT_ONLY.get(kind, 'text only')})",
                param,
            )
        if not isinstance(part.get(key), str):
            raise bad_request(f"a {kind} content part needs a string {key!r}", param)
        texts.append(part[key])
    # vLLM joins the text parts of a message with newlines for string-content templates.
    return "\n".join(texts)


def _template_tool_calls(i: int, message: dict[str, Any]) -> list[dict[str, Any]]:
    """An assistant message's tool calls as chat templates read them: arguments as an object (as
    vLLM passes them; templates render them with tojson), not OpenAI's JSON string."""
    param = f"messages[{i}].tool_calls"
    calls = message["tool_calls"]
    if message.get("role") != "assistant" or not isinstance(calls, list):
        raise bad_request("tool_calls must be a list, on an assistant message", param)
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request("a tool call needs function.name", f"{param}[{j}]")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except json.JSONDecodeError as e:
                raise bad_request(
                    f"function.arguments is not valid JSON: {e}", f"{param}[{j}]"
                ) from None
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out

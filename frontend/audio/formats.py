"""A finished transcription in OpenAI's five response formats (json, text, srt, verbose_json, vtt),
as the response body and its media type.

It renders pieces already decoded to text: the transcript, its segments with their times and
scores, the task, the language, the duration. It knows nothing of tokenizers, models or requests.
What OpenAI answers was read from its API's replies: json and verbose_json as application/json,
the other three as "text/plain; charset=utf-8" (srt and vtt too, not application/x-subrip or
text/vtt: github.com/morioka/tiny-openai-whisper-api issue 7 shows the API's headers), and
verbose_json's `language` as the full lowercase name ("english"), not the code.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass

import msgspec

RESPONSE_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
JSON_MEDIA_TYPE = "application/json"
TEXT_MEDIA_TYPE = "text/plain; charset=utf-8"


@functools.cache
def language_names() -> dict[str, str]:
    """Whisper's language codes -> the names OpenAI reports ("en" -> "english"), from
    transformers' copy of openai/whisper's table (99 languages and Cantonese, "yue"); imported
    when first asked (0.26 s: a text server never is)."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    return dict(LANGUAGES)


# Segment's float fields, made plain floats when it is built.
_FLOAT_FIELDS = (
    "start",
    "end",
    "temperature",
    "avg_logprob",
    "compression_ratio",
    "no_speech_prob",
)


@dataclass
class Segment:
    """One segment of verbose_json, with OpenAI's fields in OpenAI's order."""

    id: int
    seek: int  # the window's start, in 10 ms mel frames (openai/whisper's unit)
    start: float  # seconds
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float

    def __post_init__(self) -> None:
        # Plain Python numbers, so the JSON has OpenAI's types: 0 given as a start encodes as
        # 0.0, and numpy or torch scalars (which msgspec does not encode) become floats.
        for name in _FLOAT_FIELDS:
            setattr(self, name, float(getattr(self, name)))
        self.id, self.seek = int(self.id), int(self.seek)
        self.tokens = [int(t) for t in self.tokens]


def compression_ratio(text: str) -> float:
    """How well the UTF-8 text compresses, as openai/whisper computes it to spot repetition loops:
    len(bytes) / len(zlib.compress(bytes)). Empty text gives 0.0 (0 over zlib's 8-byte minimum)."""
    text_bytes = text.encode("utf-8")
    return len(text_bytes) / len(zlib.compress(text_bytes))


def language_name(code: str) -> str:
    """The language's name as OpenAI reports it ("en" -> "english"); a name is returned as is.
    Raises ValueError for a language Whisper does not know."""
    key, names = code.strip().lower(), language_names()
    if key in names:
        return names[key]
    if key in names.values():
        return key
    raise ValueError(f"unknown language {code!r}; Whisper's are {', '.join(names)}")


@dataclass
class Word:
    """One word of verbose_json (timestamp_granularities "word"), as OpenAI writes it: no
    leading space."""

    word: str
    start: float  # seconds
    end: float

    def __post_init__(self) -> None:
        self.word, self.start, self.end = str(self.word), float(self.start), float(self.end)


def render(
    response_format: str,
    text: str,
    segments: list[Segment],
    *,
    task: str,
    language: str,
    duration: float,
    words: list[Word] | None = None,
    with_segments: bool = True,
) -> tuple[bytes, str]:
    """(body, media type) of the transcription in `response_format`. `text` is used as given (the
    caller strips Whisper's leading space, as OpenAI's text has none); `language` is a name or a
    code, reported as a name. verbose_json lists `words` when given, and its segments unless
    `with_segments` is off (OpenAI's answer to timestamp_granularities ["word"] has none).
    Raises ValueError for a format not in RESPONSE_FORMATS."""
    if response_format == "json":
        return msgspec.json.encode({"text": text}), JSON_MEDIA_TYPE
    if response_format == "text":
        return (text + "\n").encode(), TEXT_MEDIA_TYPE  # OpenAI ends the text with a newline
    if response_format == "srt":
        return srt(segments).encode(), TEXT_MEDIA_TYPE
    if response_format == "vtt":
        return vtt(segments).encode(), TEXT_MEDIA_TYPE
    if response_format == "verbose_json":
        body: dict[str, object] = {
            "task": task,
            "language": language_name(language),
            "duration": float(duration),
            "text": text,
        }
        if words is not None:
            body["words"] = words  # msgspec encodes dataclasses field by field
        if with_segments:
            body["segments"] = segments
        return msgspec.json.encode(body), JSON_MEDIA_TYPE
    raise ValueError(
        f"unknown response_format {response_format!r}; expected one of {', '.join(RESPONSE_FORMATS)}"
    )


def srt(segments: list[Segment]) -> str:
    """SubRip: numbered blocks from 1, "N\\nHH:MM:SS,mmm --> HH:MM:SS,mmm\\ntext\\n\\n"."""
    return "".join(
        f"{n}\n{timestamp(s.start, ',')} --> {timestamp(s.end, ',')}\n{_cue_text(s)}\n\n"
        for n, s in enumerate(segments, start=1)
    )


def vtt(segments: list[Segment]) -> str:
    """WebVTT: the header, then "HH:MM:SS.mmm --> HH:MM:SS.mmm\\ntext\\n\\n" per segment."""
    cues = "".join(
        f"{timestamp(s.start, '.')} --> {timestamp(s.end, '.')}\n{_cue_text(s)}\n\n"
        for s in segments
    )
    return "WEBVTT\n\n" + cues


def timestamp(seconds: float, decimal_marker: str) -> str:
    """HH:MM:SS{marker}mmm, rounded to the millisecond (3725.5 -> "01:02:05,500" with ","); hours
    grow past 99 rather than wrap."""
    assert seconds >= 0, seconds
    # Round once, in integer milliseconds: 59.9996 s becomes 00:01:00.000, not 00:00:59.1000.
    ms = round(seconds * 1000)
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal_marker}{ms:03d}"


def _cue_text(segment: Segment) -> str:
    # "-->" in a cue's text would read as a timing line; openai/whisper's writers replace it too.
    return segment.text.strip().replace("-->", "->")

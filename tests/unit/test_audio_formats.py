"""frontend/audio/formats.py: one transcription rendered in each of OpenAI's response formats, with
the bodies, media types and verbose_json types OpenAI's API answers."""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest

from frontend.audio.formats import (
    RESPONSE_FORMATS,
    Segment,
    compression_ratio,
    language_name,
    language_names,
    render,
    timestamp,
)

TEXT = "Hello there. Goodbye --> now."


def segments() -> list[Segment]:
    return [
        Segment(0, 0, 0, 2.25, " Hello there.", [50364, 2425, 456, 13], 0.0, -0.25, 0.9, 0.01),
        Segment(1, 372000, 3723.0, 3725.5, " Goodbye --> now.", [50414, 23], 0.2, -0.5, 1.1, 0.02),
    ]


def rendered(response_format: str) -> tuple[bytes, str]:
    return render(
        response_format, TEXT, segments(), task="transcribe", language="en", duration=3725.5
    )


def test_json() -> None:
    body, media_type = rendered("json")
    assert json.loads(body) == {"text": TEXT}
    assert media_type == "application/json"


def test_text_ends_with_a_newline() -> None:
    assert rendered("text") == (TEXT.encode() + b"\n", "text/plain; charset=utf-8")


def test_srt() -> None:
    assert rendered("srt") == (
        b"1\n00:00:00,000 --> 00:00:02,250\nHello there.\n\n"
        b"2\n01:02:03,000 --> 01:02:05,500\nGoodbye -> now.\n\n",
        "text/plain; charset=utf-8",
    )


def test_vtt() -> None:
    assert rendered("vtt") == (
        b"WEBVTT\n\n"
        b"00:00:00.000 --> 00:00:02.250\nHello there.\n\n"
        b"01:02:03.000 --> 01:02:05.500\nGoodbye -> now.\n\n",
        "text/plain; charset=utf-8",
    )


def test_verbose_json_has_openais_keys_and_types() -> None:
    body, media_type = rendered("verbose_json")
    assert media_type == "application/json"
    obj = json.loads(body)
    assert list(obj) == ["task", "language", "duration", "text", "segments"]
    assert (obj["task"], obj["language"], obj["duration"], obj["text"]) == (
        "transcribe",
        "english",
        3725.5,
        TEXT,
    )
    types = {
        "id": int,
        "seek": int,
        "start": float,
        "end": float,
        "text": str,
        "tokens": list,
        "temperature": float,
        "avg_logprob": float,
        "compression_ratio": float,
        "no_speech_prob": float,
    }
    for segment in obj["segments"]:
        assert list(segment) == list(types)
        assert {k: type(v) for k, v in segment.items()} == types
    assert obj["segments"][0]["start"] == 0.0  # given as the int 0
    assert obj["segments"][1]["tokens"] == [50414, 23]
    assert obj["segments"][1]["text"] == " Goodbye --> now."  # as given: only cues are rewritten


def test_numpy_scores_encode() -> None:
    segment = Segment(0, 0, np.float32(0.5), 1.0, " a", [np.int64(7)], 0.0, np.float64(-0.1), 1, 0)
    body, _ = render("verbose_json", "a", [segment], task="translate", language="fr", duration=1)
    obj = json.loads(body)
    assert obj["segments"][0]["start"] == 0.5 and obj["segments"][0]["tokens"] == [7]
    assert obj["language"] == "french" and obj["duration"] == 1.0


def test_every_format_renders_and_unknown_raises() -> None:
    for response_format in RESPONSE_FORMATS:
        body, _ = rendered(response_format)
        assert body
    with pytest.raises(ValueError, match="response_format"):
        rendered("tsv")


@pytest.mark.parametrize(
    "seconds, srt_time",
    [
        (0.0, "00:00:00,000"),
        (3725.5, "01:02:05,500"),
        (59.9996, "00:01:00,000"),  # rounds up across the minute
        (1.0004, "00:00:01,000"),
        (0.0015, "00:00:00,002"),
        (360000.0, "100:00:00,000"),
    ],
)
def test_timestamps_round_to_milliseconds(seconds: float, srt_time: str) -> None:
    assert timestamp(seconds, ",") == srt_time
    assert timestamp(seconds, ".") == srt_time.replace(",", ".")


def test_language_names() -> None:
    assert len(language_names()) >= 99
    assert language_name("en") == "english"
    assert language_name("ZH") == "chinese"
    assert language_name("yue") == "cantonese"
    assert language_name("english") == "english"
    with pytest.raises(ValueError, match="unknown language"):
        language_name("xx")


def test_compression_ratio() -> None:
    text = "hello hello hello hello hello hello"
    assert compression_ratio(text) == len(text) / len(zlib.compress(text.encode()))
    assert compression_ratio("") == 0.0
    assert compression_ratio("ab" * 200) > 10  # a repetition loop compresses well

"""/v1/audio/transcriptions and /v1/audio/translations end to end, through the openai SDK, on a
tiny random Whisper (scripts/make_tiny_whisper.py) served by `tern launch`.

The oracle is Hugging Face's WhisperForConditionalGeneration in float32 on the same audio: the
test decodes the file as the server does (frontend/audio/decoding.py, FFmpeg), cuts the same 30 s
windows, extracts features with the checkpoint's feature extractor and decodes each window
greedily over HF's forward with the same decoder prompt and suppressed tokens; HF's tokenizer
turns the tokens into the text every response format must show.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch

from frontend.audio.decoding import decode_audio, split_windows
from tests.audio_files import encode_audio
from tests.conftest import _load_script

MAX_TOKENS = 16
EXTRA = {"max_completion_tokens": MAX_TOKENS}


@pytest.fixture(scope="module")
def whisper_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _load_script("make_tiny_whisper").make_tiny_whisper(tmp_path_factory.mktemp("whisper"))


@pytest.fixture(scope="module")
def oracle(whisper_dir: Path) -> _Oracle:
    return _Oracle(whisper_dir)


@pytest.fixture
def server(shared_server: Any, whisper_dir: Path) -> Any:
    return shared_server(
        "--model", str(whisper_dir), "--served-model-name", "whisper", "--dtype", "float32",
        "--max-audio-seconds", "70",
        "--max-audio-filesize-mb", "2",
    )  # fmt: skip


def _client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


def _speech(seconds: float, seed: int) -> np.ndarray:
    """A few tones and noise: audio whose windows differ."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(16000 * seconds)) / 16000
    freq = rng.uniform(150, 900) * (1 + 0.3 * np.sin(2 * np.pi * 0.2 * t))
    return (0.3 * np.sin(2 * np.pi * freq * t) + 0.05 * rng.standard_normal(t.size)).astype(
        np.float32
    )


class _Oracle:
    def __init__(self, model_dir: Path) -> None:
        import transformers

        self.hf = transformers.WhisperForConditionalGeneration.from_pretrained(model_dir).eval()
        # Attention probabilities are an eager model's output (word timestamps).
        self.eager = transformers.WhisperForConditionalGeneration.from_pretrained(
            model_dir, attn_implementation="eager"
        ).eval()
        self.extractor = transformers.WhisperFeatureExtractor.from_pretrained(model_dir)
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        self.g = json.loads((model_dir / "generation_config.json").read_text())

    def features(self, samples: np.ndarray) -> torch.Tensor:
        return self.extractor(samples, sampling_rate=16000, return_tensors="pt")["input_features"]

    def detect(self, samples: np.ndarray) -> str:
        """Hugging Face's detect_language: the likeliest language token after <|startoftranscript|>."""
        with torch.inference_mode():
            logits = self.hf(
                input_features=self.features(samples),
                decoder_input_ids=torch.tensor([[self.g["decoder_start_token_id"]]]),
            ).logits[0, -1]
        langs = self.g["lang_to_id"]
        best = max(langs, key=lambda token: float(logits[langs[token]]))
        return best.strip("<|>")

    def no_speech(self, samples: np.ndarray) -> float:
        """OpenAI's whisper's no_speech_prob: P(<|nospeech|>) right after <|startoftranscript|>."""
        with torch.inference_mode():
            logits = self.hf(
                input_features=self.features(samples),
                decoder_input_ids=torch.tensor([[self.g["decoder_start_token_id"]]]),
            ).logits[0, -1]
        return float(logits.softmax(-1)[self.g["no_timestamps_token_id"] - 1])

    def prompt(self, task: str, language: str, timed: bool) -> list[int]:
        g = self.g
        return [g["decoder_start_token_id"], g["lang_to_id"][f"<|{language}|>"],
                g["task_to_id"][task]] + ([] if timed else [g["no_timestamps_token_id"]])  # fmt: skip

    def window_tokens(
        self, samples: np.ndarray, task: str, language: str, timed: bool = False
    ) -> list[int]:
        """Greedy over HF's forward with generate's logits processors, in its order: the
        begin-suppressed and suppressed tokens, then (timed) its timestamp rule."""
        from transformers import GenerationConfig
        from transformers.generation.logits_process import (
            LogitsProcessorList,
            SuppressTokensAtBeginLogitsProcessor,
            SuppressTokensLogitsProcessor,
            WhisperTimeStampLogitsProcessor,
        )

        g = self.g
        prompt = self.prompt(task, language, timed)
        processors = LogitsProcessorList([
            SuppressTokensAtBeginLogitsProcessor(g["begin_suppress_tokens"], len(prompt)),
            SuppressTokensLogitsProcessor(g["suppress_tokens"]),
        ])  # fmt: skip
        if timed:
            config = GenerationConfig(**g)
            processors.append(WhisperTimeStampLogitsProcessor(config, begin_index=len(prompt)))
        ids, features = list(prompt), self.features(samples)
        with torch.inference_mode():
            for _ in range(MAX_TOKENS):
                out = self.hf(input_features=features, decoder_input_ids=torch.tensor([ids]))
                scores = processors(torch.tensor([ids]), out.logits[:, -1])
                ids.append(int(scores[0].argmax()))
                if ids[-1] == g["eos_token_id"]:
                    break
        return ids[len(prompt) :]

    def transcribe(
        self, audio: bytes, task: str = "transcribe", language: str | None = "en", timed=False
    ) -> tuple[str, list[list[int]], str]:
        """(text, each window's output tokens, the language) as the server must answer."""
        samples = decode_audio(audio)
        windows = split_windows(samples)
        language = language or self.detect(windows[0][1])
        tokens = [self.window_tokens(w, task, language, timed) for _, w in windows]
        texts = [self.tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
        return "".join(texts).strip(), tokens, language

    def words(self, audio: bytes, language: str = "en") -> list[tuple[str, float, float]]:
        """(word, start, end) in the audio's time as Hugging Face times a transcription's words:
        each window's timed greedy tokens, the cross-attentions of one eager forward over the
        tokens read, _extract_token_timestamps, the ASR pipeline's grouping of the text tokens."""
        from transformers.models.whisper.tokenization_whisper import _collate_word_timestamps

        from tests.whisper_alignment import hf_token_times

        samples = decode_audio(audio)
        windows = split_windows(samples)
        eos, out = self.g["eos_token_id"], []
        for i, (start, w) in enumerate(windows):
            end = windows[i + 1][0] if i + 1 < len(windows) else len(samples) / 16000
            prompt = self.prompt("transcribe", language, timed=True)
            tokens = self.window_tokens(w, "transcribe", language, timed=True)
            with torch.inference_mode():
                attentions = self.eager(
                    input_features=self.features(w),
                    decoder_input_ids=torch.tensor([(prompt + tokens)[:-1]]),
                    output_attentions=True,
                ).cross_attentions
            heads = [tuple(pair) for pair in self.g["alignment_heads"]]
            times = hf_token_times(self.eager, attentions, heads, -(-len(w) // 160), len(prompt))
            text = [(len(prompt) + k, t) for k, t in enumerate(tokens) if t < eos]
            spans = [(round(times[k - 1], 2), round(times[k], 2)) for k, _ in text]
            chunks = _collate_word_timestamps(
                self.tokenizer, [t for _, t in text], spans, "english", False
            )
            for c in chunks:
                lo, hi = c["timestamp"]
                out.append((c["text"].strip(), min(start + lo, end), min(start + hi, end)))
        return out

    def before_eos(self, tokens: list[int]) -> list[int]:
        eos = self.g["eos_token_id"]
        return tokens[: tokens.index(eos)] if eos in tokens else tokens


def test_transcription_formats_equal_hf(server: Any, oracle: _Oracle) -> None:
    """One 40 s flac (two windows): json and text without timestamps, verbose_json, srt and vtt
    with timed segments, each showing HF's tokens."""
    audio = encode_audio(_speech(40.0, 1), 16000, "flac")
    text, tokens, _ = oracle.transcribe(audio)
    timed_text, timed_tokens, _ = oracle.transcribe(audio, timed=True)
    assert text and len(tokens) == 2
    client = _client(server)
    file = ("speech.flac", audio)
    answer = client.audio.transcriptions.create(
        model="whisper", file=file, language="en", extra_body=EXTRA
    )
    assert answer.text == text
    plain = client.audio.transcriptions.create(
        model="whisper", file=file, language="en", response_format="text", extra_body=EXTRA
    )
    assert plain.strip() == text
    verbose = client.audio.transcriptions.create(
        model="whisper", file=file, language="en", response_format="verbose_json",
        timestamp_granularities=["segment"], extra_body=EXTRA,
    )  # fmt: skip
    assert verbose.text == timed_text and verbose.language == "english"
    assert verbose.duration == pytest.approx(40.0, abs=0.05)
    begin = oracle.g["no_timestamps_token_id"] + 1
    segments = verbose.segments
    windows = split_windows(decode_audio(audio))  # cut at a quiet stretch of 29-30 s
    bounds = [(lo, hi) for (lo, _), (hi, _) in zip(windows, [*windows[1:], (verbose.duration, 0)])]
    assert len(bounds) == 2 and 29.0 <= bounds[1][0] < 30.0
    for w, (lo, hi) in enumerate(bounds):
        window = [s for s in segments if s.seek == int(lo * 100)]
        assert sum((s.tokens for s in window), []) == oracle.before_eos(timed_tokens[w])
        for s in window:  # each segment's times: its own timestamp tokens, within the audio
            stamps = [lo + (t - begin) * 0.02 for t in s.tokens if t >= begin]
            if len(stamps) == 2:
                assert s.start == pytest.approx(min(stamps[0], hi), abs=1e-6)
                assert s.end == pytest.approx(min(stamps[1], hi), abs=1e-6)
    expected = {int(lo * 100): oracle.no_speech(w) for lo, w in windows}
    for s in segments:
        assert s.no_speech_prob == pytest.approx(expected[s.seek], rel=1e-3)
    assert [s.id for s in segments] == list(range(len(segments)))
    assert all(s.start <= s.end for s in segments)
    assert any(t >= begin for s in segments for t in s.tokens)  # the model timed something
    srt = client.audio.transcriptions.create(
        model="whisper", file=file, language="en", response_format="srt", extra_body=EXTRA
    )
    vtt = client.audio.transcriptions.create(
        model="whisper", file=file, language="en", response_format="vtt", extra_body=EXTRA
    )
    assert srt.count(" --> ") == len(segments) and vtt.startswith("WEBVTT\n\n")
    assert vtt.count(" --> ") == len(segments)
    cues = [s.text.strip() for s in segments]
    assert all(cue in srt and cue in vtt for cue in cues if cue)


def test_word_timestamps_equal_hf(server: Any, oracle: _Oracle) -> None:
    """timestamp_granularities word: each window's words and times as Hugging Face aligns them
    (the second window's offset by its start); with "segment" too the segments stay, without it
    verbose_json has only words, as OpenAI answers."""
    audio = encode_audio(_speech(40.0, 8), 16000, "flac")
    expected = oracle.words(audio)
    second = split_windows(decode_audio(audio))[1][0]
    assert any(start < second for _, start, _ in expected)
    assert any(start >= second for _, start, _ in expected)
    assert any(end > start for _, start, end in expected)  # not all at one time
    client = _client(server)
    for granularities in (["word", "segment"], ["word"]):
        verbose = client.audio.transcriptions.create(
            model="whisper", file=("a.flac", audio), language="en",
            response_format="verbose_json", timestamp_granularities=granularities,
            extra_body=EXTRA,
        )  # fmt: skip
        words = [(w.word, w.start, w.end) for w in verbose.words]
        assert [w for w, _, _ in words] == [w for w, _, _ in expected]
        np.testing.assert_allclose(
            [t for _, s, e in words for t in (s, e)],
            [t for _, s, e in expected for t in (s, e)], atol=1e-6,
        )  # fmt: skip
        assert (verbose.segments is not None) == ("segment" in granularities)


def test_streamed_transcript_events(server: Any, oracle: _Oracle) -> None:
    audio = encode_audio(_speech(35.0, 2), 16000, "mp3")
    text, _, _ = oracle.transcribe(audio)
    stream = _client(server).audio.transcriptions.create(
        model="whisper", file=("a.mp3", audio), language="en", stream=True, extra_body=EXTRA
    )
    events = list(stream)
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    done = [e for e in events if e.type == "transcript.text.done"]
    assert len(done) == 1 and done[0].text == text
    assert "".join(deltas) == text and len(deltas) > 1
    assert done[0].usage.output_tokens > 0


@pytest.mark.parametrize("fmt", ["wav", "ogg", "webm", "m4a"])
def test_container_formats(server: Any, oracle: _Oracle, fmt: str) -> None:
    audio = encode_audio(_speech(4.0, 3), 22050, fmt)
    text, _, _ = oracle.transcribe(audio)
    answer = _client(server).audio.transcriptions.create(
        model="whisper", file=(f"a.{fmt}", audio), language="en", extra_body=EXTRA
    )
    assert answer.text == text


def test_language_detected_and_translation(server: Any, oracle: _Oracle) -> None:
    """No language: the model's likeliest language token decides it (verbose_json names it);
    translations decode with <|translate|>."""
    audio = encode_audio(_speech(6.0, 4), 16000, "wav")
    text, tokens, language = oracle.transcribe(audio, language=None, timed=True)
    client = _client(server)
    verbose = client.audio.transcriptions.create(
        model="whisper", file=("a.wav", audio), response_format="verbose_json", extra_body=EXTRA
    )
    from frontend.audio.formats import language_name

    assert verbose.language == language_name(language)
    assert sum((s.tokens for s in verbose.segments), []) == oracle.before_eos(tokens[0])
    translated, t_tokens, _ = oracle.transcribe(audio, "translate", language=None)
    answer = client.audio.translations.create(
        model="whisper", file=("a.wav", audio), extra_body=EXTRA
    )
    assert answer.text == translated


def test_bad_audio_is_refused(server: Any) -> None:
    url = f"{server.base_url}/v1/audio/transcriptions"

    def post(data: bytes, **fields: str) -> httpx.Response:
        return httpx.post(url, files={"file": ("a.wav", data)}, data=fields, timeout=60)

    for body, status, words in [
        (b"", 400, "empty"),
        (b"RIFF\x00\x01not really a wav at all" * 10, 400, "decode"),
        (np.random.default_rng(0).bytes(3 * 10**6), 413, "limit"),  # beyond 2 MB
        (encode_audio(_speech(75.0, 5), 16000, "mp3"), 413, "70"),  # beyond 70 s
    ]:
        r = post(body)
        assert r.status_code == status, (r.status_code, r.text)
        error = r.json()["error"]
        assert words in error["message"] and error["type"]
    wav = encode_audio(_speech(2.0, 6), 16000, "wav")
    for fields, param in [
        ({"timestamp_granularities[]": "word"}, "timestamp_granularities[]"),  # json
        ({"timestamp_granularities[]": "char", "response_format": "verbose_json"},
         "timestamp_granularities[]"),
        ({"response_format": "tsv"}, "response_format"),
        ({"language": "klingon"}, "language"),
        ({"frobnicate": "1"}, "frobnicate"),
        ({"stream": "true", "response_format": "srt"}, None),
    ]:  # fmt: skip
        r = post(wav, **fields)
        assert r.status_code == 400, (fields, r.text)
        assert r.json()["error"]["param"] == param
    r = httpx.post(url, json={"model": "whisper"}, timeout=30)
    assert r.status_code == 400 and "multipart" in r.json()["error"]["message"]
    # The server still answers.
    assert post(wav, language="en", max_completion_tokens="4").status_code == 200
    # A text prompt without audio cannot run on a speech-to-text model.
    r = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": "whisper", "prompt": "hello", "max_tokens": 4},
        timeout=30,
    )
    assert r.status_code == 400 and "audio" in r.json()["error"]["message"]


def test_tensor_parallel_transcription_equals_hf(
    launch_server: Any, whisper_dir: Path, oracle: _Oracle
) -> None:
    """--tp 2: every projection split by heads over two gloo ranks, the answer HF's."""
    server = launch_server(
        "--model", str(whisper_dir), "--served-model-name", "whisper", "--dtype", "float32",
        "--tp", "2",
    )  # fmt: skip
    audio = encode_audio(_speech(35.0, 7), 16000, "flac")
    text, tokens, _ = oracle.transcribe(audio, timed=True)
    verbose = _client(server).audio.transcriptions.create(
        model="whisper", file=("a.flac", audio), language="en", response_format="verbose_json",
        extra_body=EXTRA,
    )  # fmt: skip
    assert verbose.text == text
    assert sum((s.tokens for s in verbose.segments), []) == sum(map(oracle.before_eos, tokens), [])
    # Word timestamps: the alignment heads span both ranks' heads (their rows are summed).
    verbose = _client(server).audio.transcriptions.create(
        model="whisper", file=("a.flac", audio), language="en", response_format="verbose_json",
        timestamp_granularities=["word"], extra_body=EXTRA,
    )  # fmt: skip
    expected = oracle.words(audio)
    assert [w.word for w in verbose.words] == [w for w, _, _ in expected]
    np.testing.assert_allclose(
        [t for w in verbose.words for t in (w.start, w.end)],
        [t for _, s, e in expected for t in (s, e)], atol=1e-6,
    )  # fmt: skip

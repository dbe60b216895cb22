"""POST /v1/audio/transcriptions and /v1/audio/translations, as OpenAI defines them: a
multipart/form-data body with the audio `file`, `model`, `language`, `prompt`, `temperature`,
`response_format` (json, text, srt, verbose_json, vtt), `timestamp_granularities[]` and `stream`.

The file is decoded (decoding.py, in a thread: FFmpeg holds no event loop) and cut into windows
of at most 30 s (at a quiet stretch of each one's last second); each window is one engine request
(speech.py says what it carries), all started at once, and their texts join in window order. verbose_json, srt and vtt show timed segments: their start
and end in the audio, their tokens, the mean logprob of their tokens and (verbose_json) their
window's no_speech_prob, the probability of <|nospeech|> right after <|startoftranscript|> as
OpenAI's whisper reads it (a one-token probe per window: the prompt logprob of <|nospeech|>).
`timestamp_granularities[]` "word" adds verbose_json's `words`, timed by aligning the decoder's
cross-attention at the checkpoint's alignment heads to the audio (alignment.py); a model whose
generation_config.json names no alignment heads answers it with a 400.

With stream=true the answer is OpenAI's transcript events: `transcript.text.delta` as text is
released, window after window, then `transcript.text.done` with the whole text and the usage.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np
from starlette.datastructures import FormData, UploadFile
from starlette.requests import Request
from starlette.responses import Response

from enginecore.messages import CROSS_ATTENTION_FRAMES, CrossAttentionRows, MultiModalItem
from frontend.audio import alignment
from frontend.audio.decoding import AudioError, decode_audio, split_windows
from frontend.audio.formats import (
    RESPONSE_FORMATS,
    Segment,
    Word,
    compression_ratio,
    render,
)
from frontend.audio.speech import SAMPLE_RATE, TIME_PRECISION, SpeechModel
from frontend.common.errors import APIError, bad_request
from frontend.common.http import json_response, sse
from frontend.media.policy import MediaPolicy
from frontend.serving.base import OpenAIServing
from frontend.serving.generation import Generation, RequestGroup
from frontend.serving.sampling import RequestSampling

# Form fields OpenAI's API and its SDK send, and vLLM's sampling extras; any other is a 400.
_FIELDS = {
    "file", "model", "language", "prompt", "response_format", "temperature",
    "timestamp_granularities[]", "timestamp_granularities", "stream", "seed", "top_p", "top_k",
    "chunking_strategy", "include[]", "max_completion_tokens",
}  # fmt: skip


@dataclass
class TranscriptionRequest:
    audio: bytes
    model: str | None = None
    language: str | None = None
    prompt: str | None = None
    response_format: str = "json"
    temperature: float = 0.0
    seed: int | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    stream: bool = False
    granularities: list[str] = field(default_factory=list)


class TranscriptionServing:
    def __init__(self, serving: OpenAIServing, policy: MediaPolicy) -> None:
        self.serving = serving
        self.policy = policy

    async def transcriptions(self, http_request: Request) -> Response:
        return await self._create(http_request, "transcribe")

    async def translations(self, http_request: Request) -> Response:
        return await self._create(http_request, "translate")

    async def _create(self, http_request: Request, task: str) -> Response:
        s = self.serving
        speech = s.speech
        if speech is None:
            raise bad_request(f"the model {s.model_name} does not take audio", "model")
        req = await self._read_form(http_request, task)
        if s.check_model(req.model) is not None:
            raise bad_request("speech-to-text models are served without LoRA adapters", "model")
        language = speech.language_code(req.language)
        with_words = "word" in req.granularities
        if with_words and speech.alignment_heads is None:
            raise bad_request(
                "word timestamps need the model's alignment heads, which its "
                "generation_config.json does not name (alignment_heads)",
                "timestamp_granularities[]",
            )
        try:
            samples = await asyncio.to_thread(
                decode_audio, req.audio, SAMPLE_RATE, self.policy.max_audio_seconds
            )
        except AudioError as e:
            raise APIError(str(e), e.status, "file") from None
        windows = split_windows(samples, SAMPLE_RATE)
        items = await asyncio.to_thread(lambda: [speech.audio_item(w) for _, w in windows])
        request_id, keys, headers = s.request_ids(http_request, "trsc-", None)
        if language is None and speech.is_multilingual:
            language = await self._detect_language(http_request, request_id, items[0])
        # Formats with segments time them; json and text need no timestamps (OpenAI's whisper-1).
        timed = req.response_format in ("verbose_json", "srt", "vtt")
        prompt_ids = speech.decoder_prompt(language, task, req.prompt, timestamps=timed)
        sampling = RequestSampling(
            max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
            top_k=req.top_k, seed=req.seed, skip_special_tokens=True,
            suppress_token_ids=speech.suppress_ids,
            begin_suppress_token_ids=speech.begin_suppress_ids,
            timestamps=speech.timestamp_rule() if timed else None,
            cross_attention=CrossAttentionRows(speech.alignment_heads) if with_words else None,
        )  # fmt: skip
        sampling.verify()
        group = s.start(
            request_id, keys, sampling, [prompt_ids] * len(windows), "file", logprobs=0,
            mm_items_per_prompt=[[item] for item in items],
        )  # fmt: skip
        duration = len(samples) / SAMPLE_RATE
        view = _Transcript(speech, task, language or "en", duration, [t for t, _ in windows])
        view.num_frames = [speech.num_frames(w) for _, w in windows]
        if req.stream:
            return s.sse_response(self._stream(group, view), group, headers)
        if req.response_format == "verbose_json":
            probe = self._start_no_speech_probe(request_id, items)
            try:
                if await probe.collect_unless_disconnected(http_request) is None:
                    group.close()
                    return Response(status_code=499)
            except Exception:
                group.close()
                raise
            view.no_speech = [_first_prompt_prob(g) for g in probe.gens]
        if await group.collect_unless_disconnected(http_request) is None:
            return Response(status_code=499)
        text = view.text(group.gens)
        if req.response_format == "json":  # with OpenAI's usage of whisper-1: the audio's seconds
            usage = {"type": "duration", "seconds": math.ceil(duration)}
            return json_response({"text": text, "usage": usage}, headers=headers)
        words = None
        if with_words:  # ~0.1 s of numpy per 30 s window: off the event loop
            words = await asyncio.to_thread(view.words, group.gens, len(prompt_ids))
        body, media_type = render(
            req.response_format, text, view.segments(group.gens), task=task,
            language=view.language, duration=duration, words=words,
            with_segments=not req.granularities or "segment" in req.granularities,
        )  # fmt: skip
        return Response(body, media_type=media_type, headers=headers)

    def _start_no_speech_probe(self, request_id: str, items: list[MultiModalItem]) -> RequestGroup:
        """Per window, a request whose prompt is <|startoftranscript|> <|nospeech|> and which
        asks its prompt logprobs: the second is log P(<|nospeech|> | the audio, start)."""
        speech = self.serving.speech
        assert speech is not None
        probe_id = request_id + "-nospeech"
        return self.serving.start(
            probe_id, [probe_id], RequestSampling(max_tokens=1, temperature=0.0),
            [speech.no_speech_prompt()] * len(items), "file", prompt_logprobs=0,
            mm_items_per_prompt=[[item] for item in items],
        )  # fmt: skip

    async def _detect_language(
        self, http_request: Request, request_id: str, item: MultiModalItem
    ) -> str:
        """The language token the model puts after <|startoftranscript|> for the first window,
        among its language tokens (Hugging Face's detect_language), greedily."""
        s, speech = self.serving, self.serving.speech
        assert speech is not None
        sampling = RequestSampling(
            max_tokens=1, temperature=0.0, allowed_token_ids=list(speech.language_ids.values())
        )
        group = s.start(
            request_id + "-lang", [request_id + "-lang"], sampling,
            [speech.language_detection_prompt()], "file", mm_items=[item],
        )  # fmt: skip
        if await group.collect_unless_disconnected(http_request) is None:
            raise APIError("the client went away", 499)
        return speech.language_of(group.gens[0].output_token_ids[0])

    async def _stream(self, group: RequestGroup, view: _Transcript) -> AsyncIterator[bytes]:
        """Each window's text as it is released, in window order (later windows run meanwhile and
        queue their outputs); the server's SSE framing adds [DONE] and any failure's event."""
        for i, gen in enumerate(group.gens):
            sent = ""
            while not gen.is_finished:
                await gen.next_text()
                text = view.window_text(gen, lstrip=i == 0)
                # NOTE: a character whose bytes are split across tokens decodes as U+FFFD until
                # its last byte arrives: hold back what is not final yet.
                final = text if gen.is_finished else text.rstrip("\ufffd")
                if len(final) > len(sent) and final.startswith(sent):
                    delta, sent = final[len(sent) :], final
                    yield sse({"type": "transcript.text.delta", "delta": delta})
        usage = group.usage()
        done = {
            "type": "transcript.text.done",
            "text": view.text(group.gens),
            "usage": {
                "type": "tokens", "input_tokens": usage.prompt_tokens,
                "output_tokens": usage.completion_tokens, "total_tokens": usage.total_tokens,
            },
        }  # fmt: skip
        yield sse(done)

    async def _read_form(self, http_request: Request, task: str) -> TranscriptionRequest:
        content_type = http_request.headers.get("content-type", "")
        if not content_type.startswith("multipart/form-data"):
            raise bad_request("the body must be multipart/form-data with the audio as `file`")
        try:
            form = await http_request.form(max_files=1, max_fields=32)
        except APIError:
            raise
        except Exception as e:  # starlette's MultiPartException, a malformed body
            raise bad_request(f"could not read the form: {e}") from None
        try:
            return await _parse_form(form, task, self.policy.max_audio_bytes)
        finally:
            await form.close()


async def _parse_form(form: FormData, task: str, max_bytes: int) -> TranscriptionRequest:
    unknown = sorted(set(form.keys()) - _FIELDS)
    if unknown:
        raise bad_request(f"unsupported parameter {unknown[0]!r}", unknown[0])
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise bad_request("the audio `file` is missing", "file")
    audio = await upload.read(max_bytes + 1)
    if len(audio) > max_bytes:
        raise APIError(
            f"the audio file is larger than this server's limit of {max_bytes} bytes "
            "(--max-audio-filesize-mb)", 413, "file",
        )  # fmt: skip
    text = {k: v for k, v in form.multi_items() if isinstance(v, str)}
    req = TranscriptionRequest(audio, model=text.get("model"), prompt=text.get("prompt"))
    if task == "transcribe":
        req.language = text.get("language") or None
    elif "language" in text:
        raise bad_request("translations take no language (the audio's is detected)", "language")
    req.response_format = text.get("response_format", "json")
    if req.response_format not in RESPONSE_FORMATS:
        raise bad_request(
            f"response_format must be one of {', '.join(RESPONSE_FORMATS)}", "response_format"
        )
    req.temperature = _number(text, "temperature", float, 0.0)
    req.seed = _number(text, "seed", int, None)
    req.top_p = _number(text, "top_p", float, None)
    req.top_k = _number(text, "top_k", int, None)
    req.max_tokens = _number(text, "max_completion_tokens", int, None)
    req.stream = _flag(text, "stream")
    if req.stream and req.response_format not in ("json", "text"):
        raise bad_request("stream=true answers transcript events: response_format json or text")
    req.granularities = [
        v for k, v in form.multi_items() if k.startswith("timestamp_granularities")
    ]  # fmt: skip
    if any(g not in ("segment", "word") for g in req.granularities):
        raise bad_request(
            "timestamp_granularities are 'segment' or 'word'", "timestamp_granularities[]"
        )
    if req.granularities and req.response_format != "verbose_json":
        raise bad_request(
            "timestamp_granularities need response_format verbose_json", "timestamp_granularities[]"
        )
    if text.get("chunking_strategy", "auto") != "auto":
        raise bad_request("chunking_strategy: only 'auto' (30 s windows)", "chunking_strategy")
    if any(k == "include[]" for k, _ in form.multi_items()):
        raise bad_request("include[] (logprobs) is not offered", "include[]")
    return req


def _number(text: dict[str, str], name: str, kind: type, default: object) -> object:
    if name not in text:
        return default
    try:
        return kind(text[name])
    except ValueError:
        raise bad_request(f"{name} must be a number, got {text[name]!r}", name) from None


def _flag(text: dict[str, str], name: str) -> bool:
    value = text.get(name, "false").lower()
    if value not in ("true", "false"):
        raise bad_request(f"{name} must be true or false, got {value!r}", name)
    return value == "true"


def _first_prompt_prob(gen: Generation) -> float:
    """The probability of a generation's second prompt token given its first."""
    lp = gen.prompt_logprobs
    if lp is None or not lp.logprobs:
        raise APIError("the engine returned no prompt logprobs for the no-speech probe", 500)
    return math.exp(lp.logprobs[0])


class _Transcript:
    """The text and segments of a request's windows, decoded by the model's own tokenizer (which
    drops timestamp tokens as Hugging Face's decode does)."""

    def __init__(
        self, speech: SpeechModel, task: str, language: str, duration: float, starts: list[float]
    ) -> None:
        self.speech = speech
        self.task = task
        self.language = language
        self.duration = duration
        self.starts = starts
        self.no_speech: list[float] | None = None  # per window (verbose_json only)
        self.num_frames: list[int] = []  # per window, its feature frames of real audio

    def window_text(self, gen: Generation, lstrip: bool = False) -> str:
        text = self.speech.tokenizer.hf.decode(gen.output_token_ids, skip_special_tokens=True)
        return text.lstrip() if lstrip else text

    def text(self, gens: list[Generation]) -> str:
        return "".join(self.window_text(g) for g in gens).strip()

    def segments(self, gens: list[Generation]) -> list[Segment]:
        """Each window's timed segments: its timestamp pairs <|t0|> text <|t1|> (text after the
        last pair runs to the window's end); a window without timestamps is one segment."""
        out: list[Segment] = []
        for i, gen in enumerate(gens):
            start, end = self._bounds(i)
            logprobs = gen.all_output_logprobs
            values = logprobs.logprobs if logprobs is not None else []
            for lo, hi, first, last in self._pairs(gen.output_token_ids, end - start):
                tokens = gen.output_token_ids[first:last]
                text = self.speech.tokenizer.hf.decode(tokens, skip_special_tokens=True)
                scores = values[first:last]
                out.append(
                    Segment(
                        id=len(out),
                        seek=int(start * 100),
                        # NOTE: times in a window's padding, past the audio, end at its end
                        start=min(start + lo, end),
                        end=min(start + hi, end),
                        text=text,
                        tokens=list(tokens),
                        temperature=gen.params.temperature,
                        avg_logprob=sum(scores) / len(scores) if scores else 0.0,
                        compression_ratio=compression_ratio(text),
                        no_speech_prob=self.no_speech[i] if self.no_speech else 0.0,
                    )  # fmt: skip
                )
        return out

    def words(self, gens: list[Generation], num_prompt: int) -> list[Word]:
        """Each window's words, timed by its cross-attention rows (alignment.py), in the audio's
        time (a time in a window's padding ends at its end)."""
        speech = self.speech
        assert speech.alignment_heads is not None
        out: list[Word] = []
        for i, gen in enumerate(gens):
            start, end = self._bounds(i)
            rows = np.frombuffer(bytes(gen.cross_attention), dtype=np.float32).reshape(
                -1, len(speech.alignment_heads), CROSS_ATTENTION_FRAMES
            )
            if len(rows) != max(len(gen.output_token_ids) - 1, 0):  # one per token read
                raise APIError(
                    f"the engine returned {len(rows)} cross-attention rows for "
                    f"{len(gen.output_token_ids)} tokens", 500,
                )  # fmt: skip
            times = alignment.token_times(
                rows, self.num_frames[i], num_prompt, speech.median_filter_width
            )
            for word, lo, hi in alignment.words(
                speech.tokenizer.hf, gen.output_token_ids, times, self.language, speech.eos_id
            ):
                # NOTE: a window that read one output token aligns it nowhere (Hugging Face's
                # time is then -0.02): a word starts no earlier than its window.
                lo, hi = max(lo, 0.0), max(hi, 0.0)
                out.append(Word(word.strip(), min(start + lo, end), min(start + hi, end)))
        return out

    def _bounds(self, i: int) -> tuple[float, float]:
        """Window i's start and end in the audio (seconds)."""
        end = self.starts[i + 1] if i + 1 < len(self.starts) else self.duration
        return self.starts[i], end

    def _pairs(self, tokens: list[int], length: float) -> list[tuple[float, float, int, int]]:
        """(start s, end s, first token, end token) of each segment of one window's output."""
        begin, eos = self.speech.no_timestamps_id + 1, self.speech.eos_id
        spans: list[tuple[float, float, int, int]] = []
        opened: tuple[float, int] | None = None  # an open pair's time and first token
        text_from = 0  # the first token not in a segment yet
        for i, tok in enumerate(tokens):
            if tok == eos:
                tokens = tokens[:i]
                break
            if tok < begin:
                continue
            seconds = (tok - begin) * TIME_PRECISION
            if opened is None:
                opened = (seconds, i)
            else:
                spans.append((opened[0], seconds, opened[1], i + 1))
                opened, text_from = None, i + 1
        rest = tokens[text_from:]
        if any(t < begin for t in rest) or not spans:
            lo = opened[0] if opened is not None else (spans[-1][1] if spans else 0.0)
            spans.append((lo, length, text_from, len(tokens)))
        return spans

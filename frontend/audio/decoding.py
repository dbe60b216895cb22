"""Audio file bytes -> float32 mono samples at 16 kHz (Whisper's input), decoded by FFmpeg through
PyAV; and those samples cut into the (at most) 30 s windows Whisper's encoder reads.

Only the demuxers of the containers OpenAI's transcription API takes (flac, mp3, mp4, mpeg, mpga,
m4a, ogg, wav, webm) and raw ADTS AAC and AIFF are opened: naming them keeps FFmpeg's playlist
demuxers (hls, concat), which open further URLs and files, out of reach of user bytes, and no
protocol is allowed for a nested open either. This module knows nothing of requests, models or
tokens; every refusal is an `AudioError` whose `status` the route answers with.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import av

# FFmpeg demuxer names; a probed format's name ("mov,mp4,m4a,3gp,3g2,mj2") passes when any of its
# aliases is listed (av_match_list).
AUDIO_DEMUXERS = ("wav", "flac", "mp3", "ogg", "matroska", "webm", "mov", "mp4", "aac", "aiff")
_READ_FORMATS = "flac, m4a, mp3, mp4, ogg, wav, webm, aac, aiff"
# An empty whitelist refuses every protocol: the input is a memory buffer, which needs none.
_OPEN_OPTIONS = {"format_whitelist": ",".join(AUDIO_DEMUXERS), "protocol_whitelist": ""}


class AudioError(ValueError):
    """Audio the server will not transcribe; `status` is the HTTP status to answer with (400, or
    413 for audio longer than the server's cap)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def decode_audio(
    data: bytes, sample_rate: int = 16000, max_seconds: float | None = None
) -> np.ndarray:
    """The first audio stream of the file in `data`, downmixed to mono and resampled to
    `sample_rate`, as a 1-D float32 array. Beyond `max_seconds` (when set) decoding stops and a
    413 `AudioError` is raised; any other failure is a 400 `AudioError`."""
    import av  # 0.6 s to import: only servers that are sent audio pay for it

    assert sample_rate > 0, sample_rate
    if not data:
        raise AudioError("the audio file is empty (0 bytes)")
    max_samples = None if max_seconds is None else int(max_seconds * sample_rate)
    declared = None
    try:
        with av.open(io.BytesIO(data), container_options=_OPEN_OPTIONS) as container:
            if not container.streams.audio:
                raise AudioError("the audio file holds no audio stream")
            declared = container.duration / av.time_base if container.duration else None
            samples = _MonoDecoder(sample_rate, max_samples).decode(container)
    except _TooLong:
        raise _too_long(declared, max_seconds) from None
    except AudioError:
        raise
    except (av.error.FFmpegError, ValueError) as e:
        # PyAV raises ValueError for what it cannot represent (an unknown channel layout, for one).
        reason = e.strerror if isinstance(e, av.error.FFmpegError) else str(e)
        raise AudioError(
            f"could not decode the audio file: {reason} (the formats read are {_READ_FORMATS})"
        ) from None
    if samples.size == 0:
        raise AudioError("the audio is empty (0 samples)")
    return samples


class _TooLong(Exception):
    """Raised inside decoding as soon as the samples pass the cap."""


class _MonoDecoder:
    """Decodes a container's first audio stream, packet by packet, into mono chunks at one rate."""

    def __init__(self, sample_rate: int, max_samples: int | None) -> None:
        self.sample_rate = sample_rate
        self.max_samples = max_samples
        self.chunks: list[np.ndarray] = []
        self.num_samples = 0
        self.resampler: av.AudioResampler | None = None
        self.source: tuple[str, str, int] | None = None  # (format, layout, rate) it was made for

    def decode(self, container: av.container.InputContainer) -> np.ndarray:
        import av

        first_error = None
        for packet in container.demux(container.streams.audio[0]):
            try:
                frames = packet.decode()
            except av.error.FFmpegError as e:
                # ffmpeg's CLI (openai/whisper's decoder) skips a packet it cannot decode too: the
                # tags between two concatenated mp3s are one. A file of nothing else is refused.
                first_error = first_error or e
                continue
            for frame in frames:
                self._push(frame)
        self._flush()
        if not self.chunks and first_error is not None:
            raise first_error
        return np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.float32)

    def _push(self, frame: av.AudioFrame) -> None:
        # A stream may change rate or layout midway (chained Ogg, concatenated mp3s); a resampler
        # is set up for one input, so each run of alike frames gets its own.
        source = (frame.format.name, frame.layout.name, frame.sample_rate)
        if source != self.source:
            self._flush()
            self.resampler, self.source = _resampler(self.sample_rate), source
        self._take(self.resampler.resample(frame))

    def _flush(self) -> None:
        """Takes the samples the resampler's filter still holds."""
        if self.resampler is not None:
            self._take(self.resampler.resample(None))

    def _take(self, frames: list[av.AudioFrame | None]) -> None:
        for frame in frames:
            if frame is None:  # a passthrough resampler (input already flt mono) echoes a flush
                continue
            chunk = frame.to_ndarray().reshape(-1)  # packed mono (1, n) -> (n,)
            self.chunks.append(chunk)
            self.num_samples += chunk.size
        if self.max_samples is not None and self.num_samples > self.max_samples:
            raise _TooLong  # stop here: hours of audio are not decoded to then be refused


def _resampler(sample_rate: int) -> av.AudioResampler:
    import av

    # rematrix_maxval=1 scales the downmix so no output sample exceeds the loudest input one
    # (stereo -> mono averages the channels), as the s16 output of openai/whisper's ffmpeg
    # command does; left at its float default, a loud stereo file would downmix past 1.0.
    return av.AudioResampler(
        format="flt", layout="mono", rate=sample_rate, options={"rematrix_maxval": "1"}
    )


def _too_long(declared: float | None, max_seconds: float | None) -> AudioError:
    """The 413 for audio beyond the cap. Decoding stopped at the cap, so the length said is the
    container's declared duration when it is past the cap, else only "more than" the cap."""
    assert max_seconds is not None
    if declared is not None and declared > max_seconds:
        length = f"{declared:.1f} s"
    else:
        length = f"more than {max_seconds:g} s"
    return AudioError(
        f"the audio lasts {length}, beyond this server's limit of {max_seconds:g} s "
        "(--max-audio-seconds)",
        status=413,
    )


def split_windows(
    samples: np.ndarray,
    sample_rate: int = 16000,
    window_s: float = 30.0,
    search_s: float = 1.0,
    stretch_s: float = 0.1,
) -> list[tuple[float, np.ndarray]]:
    """`samples` as consecutive, non-overlapping windows of at most `window_s` seconds, each with
    its start time in seconds. Audio longer than a window is cut where it is quietest, as vLLM
    cuts it (fewer words split between two windows): each cut lands in the last `search_s` before
    the window's end, at the start of the `stretch_s` stretch there of least energy (RMS).
    Every window with any samples is kept, however short the last one is (Whisper pads each
    window to 30 s anyway); the windows are views into `samples`, not copies."""
    assert samples.ndim == 1, samples.shape
    window = int(round(window_s * sample_rate))
    search = int(round(search_s * sample_rate))
    stretch = int(round(stretch_s * sample_rate))
    assert window > search >= stretch > 0, (window_s, search_s, stretch_s, sample_rate)
    out: list[tuple[float, np.ndarray]] = []
    start = 0
    while start < samples.size:
        end = start + window
        if end >= samples.size:  # the rest fits
            out.append((start / sample_rate, samples[start:]))
            break
        cut = _quietest(samples, end - search, end, stretch)
        out.append((start / sample_rate, samples[start:cut]))
        start = cut
    return out


def _quietest(samples: np.ndarray, lo: int, hi: int, stretch: int) -> int:
    """The first sample of the quietest of the whole `stretch`-long stretches that tile [lo, hi)
    from lo (the first of equals)."""
    n = (hi - lo) // stretch
    stretches = samples[lo : lo + n * stretch].reshape(n, stretch).astype(np.float64)
    energy = np.sqrt((stretches**2).mean(axis=1))
    return lo + int(np.argmin(energy)) * stretch

"""Audio files made in memory for tests: samples -> the bytes of a wav (16-bit or float), flac,
mp3, ogg, opus, webm or m4a file, encoded by FFmpeg through PyAV (the encoders its wheel ships).

Shared by the unit tests of frontend/audio and the transcription integration tests; it knows
nothing of the server.
"""

from __future__ import annotations

import io

import av
import numpy as np

# fmt -> (FFmpeg muxer, encoder, the encoder's sample rate or None for the input's). Opus runs at
# 48 kHz only; "ogg" is Vorbis, "opus" is Opus in Ogg.
AUDIO_FORMATS: dict[str, tuple[str, str, int | None]] = {
    "wav": ("wav", "pcm_s16le", None),
    "wav_f32": ("wav", "pcm_f32le", None),
    "flac": ("flac", "flac", None),
    "mp3": ("mp3", "libmp3lame", None),
    "ogg": ("ogg", "vorbis", None),
    "opus": ("ogg", "libopus", 48000),
    "webm": ("webm", "libopus", 48000),
    "m4a": ("ipod", "aac", None),
}


def sine(
    seconds: float, sample_rate: int, freq: float = 440.0, channels: int = 1, amplitude: float = 0.5
) -> np.ndarray:
    """A sine tone as float32: (n,) for one channel, (n, channels) for more (the same in each)."""
    t = np.arange(int(round(seconds * sample_rate))) / sample_rate
    tone = (amplitude * np.sin(2 * np.pi * freq * t)).astype(np.float32)
    return tone if channels == 1 else np.repeat(tone[:, None], channels, axis=1)


def encode_audio(samples: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """`samples` (float in [-1, 1]; (n,) mono or (n, channels)) as the bytes of a `fmt` file, one
    of AUDIO_FORMATS. The encoder converts sample format and rate itself (PyAV resamples a frame
    to what the codec takes). Mono goes to Vorbis as stereo: FFmpeg's own Vorbis encoder, the only
    one PyAV's wheel has, encodes two channels only. Zero samples make a file of headers only."""
    if fmt not in AUDIO_FORMATS:
        raise ValueError(f"unknown audio format {fmt!r}; known: {sorted(AUDIO_FORMATS)}")
    muxer, codec, codec_rate = AUDIO_FORMATS[fmt]
    samples = np.asarray(samples, dtype=np.float32)
    if samples.ndim == 1:
        samples = samples[:, None]
    assert samples.ndim == 2 and samples.shape[1] in (1, 2), samples.shape
    if codec == "vorbis" and samples.shape[1] == 1:
        samples = np.repeat(samples, 2, axis=1)
    layout = "mono" if samples.shape[1] == 1 else "stereo"
    # Packed float: one plane of interleaved samples, (1, n * channels).
    frame = av.AudioFrame.from_ndarray(
        np.ascontiguousarray(samples).reshape(1, -1), format="flt", layout=layout
    )
    frame.sample_rate = sample_rate
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=muxer) as container:
        stream = container.add_stream(codec, rate=codec_rate or sample_rate, layout=layout)
        if codec == "vorbis":
            stream.codec_context.options = {"strict": "experimental"}
        if samples.shape[0]:
            for packet in stream.encode(frame):
                container.mux(packet)
        else:
            container.start_encoding()  # no packets to mux: the headers alone
        for packet in stream.encode(None):  # flush the encoder's delayed packets
            container.mux(packet)
    return buffer.getvalue()

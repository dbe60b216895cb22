"""Audio files made in memory for tests: samples -> the bytes of a wav (16-bit or float), flac,
mp3, ogg, opus, webm or m4a file, encoded by FFmpeg through PyAV (the encoders its wheel ships).

Shared by the unit tests of frontend/audio and the audio integration tests, with the tiny random
Qwen2-Audio both the in-process and the server tests run; it knows nothing of the server.
"""

from __future__ import annotations

import io
from typing import Any

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


def tiny_qwen2_audio(vocab_size: int, audio_token: int) -> Any:
    """A random Qwen2AudioForConditionalGeneration (2-layer Whisper-style tower of 64 wide, 2-layer
    Qwen2 text model) with decisive weights: norms around 1, the rest at 0.2."""
    import torch
    import transformers

    config = transformers.Qwen2AudioConfig(
        audio_config=transformers.Qwen2AudioEncoderConfig(
            d_model=64, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128,
            num_mel_bins=128, max_source_positions=1500,
        ).to_dict(),
        text_config=transformers.Qwen2Config(
            hidden_size=64, num_hidden_layers=2, vocab_size=vocab_size, intermediate_size=128,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
            tie_word_embeddings=False,
        ).to_dict(),
        audio_token_index=audio_token,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.Qwen2AudioForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            is_norm = "norm" in name and name.endswith(".weight")
            p.normal_(1.0 if is_norm else 0.0, 0.1 if is_norm else 0.2)
    return hf

"""frontend/audio/decoding.py: every container and codec the transcription route takes decodes to
the same 16 kHz mono tone; what is not audio, or too long, is refused with its status."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest

from frontend.audio.decoding import AudioError, decode_audio, split_windows
from tests.audio_files import AUDIO_FORMATS, encode_audio, sine

SOURCE_RATE = 22050
SECONDS = 2.5


def dominant_frequency(samples: np.ndarray, sample_rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(samples.size)))
    return float(np.fft.rfftfreq(samples.size, 1 / sample_rate)[np.argmax(spectrum)])


@pytest.mark.parametrize("channels", [2, 1])
@pytest.mark.parametrize("fmt", sorted(AUDIO_FORMATS))
def test_decodes_each_format_to_16k_mono(fmt: str, channels: int) -> None:
    data = encode_audio(sine(SECONDS, SOURCE_RATE, channels=channels), SOURCE_RATE, fmt)
    samples = decode_audio(data)
    assert samples.dtype == np.float32 and samples.ndim == 1
    # Lossy codecs pad (encoder delay, whole frames): a few percent either way.
    assert abs(samples.size / 16000 - SECONDS) < 0.04 * SECONDS, samples.size
    assert abs(dominant_frequency(samples, 16000) - 440.0) < 5.0
    assert np.abs(samples).max() <= 1.0
    # A 0.5 amplitude tone stays one: the downmix averages the channels, it does not sum them.
    assert 0.4 < np.abs(samples).max() < 0.6


def test_other_sample_rate() -> None:
    samples = decode_audio(encode_audio(sine(1.0, 44100), 44100, "flac"), sample_rate=8000)
    assert abs(samples.size - 8000) <= 10
    assert abs(dominant_frequency(samples, 8000) - 440.0) < 5.0


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "empty"),
        (np.random.default_rng(0).bytes(20000), "could not decode"),
        (b"Dear diary,\nno audio here at all.\n" * 40, "could not decode"),
    ],
    ids=["empty", "random", "text"],
)
def test_not_audio_is_400(data: bytes, message: str) -> None:
    with pytest.raises(AudioError, match=message) as info:
        decode_audio(data)
    assert info.value.status == 400


def test_truncated_header_is_400() -> None:
    data = encode_audio(sine(1.0, 16000), 16000, "wav")
    with pytest.raises(AudioError) as info:
        decode_audio(data[:30])
    assert info.value.status == 400


def test_video_without_audio_is_400() -> None:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for _ in range(3):
            frame = av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    with pytest.raises(AudioError, match="no audio stream") as info:
        decode_audio(buffer.getvalue())
    assert info.value.status == 400


def test_zero_samples_is_400() -> None:
    with pytest.raises(AudioError, match=r"0 samples") as info:
        decode_audio(encode_audio(np.zeros(0, np.float32), 16000, "wav"))
    assert info.value.status == 400


def test_duration_cap_is_413() -> None:
    data = encode_audio(sine(SECONDS, SOURCE_RATE), SOURCE_RATE, "mp3")
    with pytest.raises(AudioError, match=r"lasts 2\.5 s, beyond .* limit of 1 s") as info:
        decode_audio(data, max_seconds=1.0)
    assert info.value.status == 413
    assert decode_audio(data, max_seconds=3.0).size > 0


def test_duration_cap_counts_decoded_samples() -> None:
    # Two flac files back to back: the header declares the first one's 1 s, the decoder reads on
    # into the second, and the samples past the cap are what refuse it.
    data = encode_audio(sine(1.0, 16000), 16000, "flac") * 2
    assert decode_audio(data).size == 32000
    with pytest.raises(AudioError, match=r"lasts more than 1\.5 s, beyond") as info:
        decode_audio(data, max_seconds=1.5)
    assert info.value.status == 413


def test_split_windows() -> None:
    """Long audio is cut at the quietest 100 ms stretch of each window's last second; a window
    that holds the rest takes it whole."""
    rng = np.random.default_rng(0)
    samples = rng.uniform(-0.5, 0.5, 65 * 16000).astype(np.float32)
    samples[int(29.3 * 16000) : int(29.4 * 16000)] *= 0.01  # a pause at 29.3 s
    samples[int(58.5 * 16000) : int(58.6 * 16000)] *= 0.01  # and 29.2 s after it
    windows = split_windows(samples)
    assert [start for start, _ in windows] == pytest.approx([0.0, 29.3, 58.5])
    assert [w.size for _, w in windows] == [468800, 467200, 104000]
    np.testing.assert_array_equal(np.concatenate([w for _, w in windows]), samples)
    # Silence before the last second does not count: the cut stays within it.
    quiet_early = samples.copy()
    quiet_early[int(10 * 16000) : int(11 * 16000)] = 0.0
    assert 29.0 <= split_windows(quiet_early)[1][0] < 30.0
    assert len(split_windows(samples[:480000])) == 1  # exactly one window: no empty tail
    assert split_windows(samples[:0]) == []


def test_float_wav_at_16k_mono_passes_through() -> None:
    tone = sine(1.0, 16000)
    samples = decode_audio(encode_audio(tone, 16000, "wav_f32"))
    np.testing.assert_array_equal(samples, tone)  # nothing to convert: the exact samples


def test_loud_stereo_stays_in_range() -> None:
    loud = sine(1.0, 16000, channels=2, amplitude=1.0)
    samples = decode_audio(encode_audio(loud, 16000, "wav_f32"))
    assert np.abs(samples).max() <= 1.0
    np.testing.assert_allclose(samples, loud[:, 0], atol=1e-6)  # the two channels' average


def test_rate_change_midway() -> None:
    # Two mp3s back to back, at 22.05 and 44.1 kHz: one stream whose rate changes.
    data = encode_audio(sine(1.0, 22050), 22050, "mp3") + encode_audio(
        sine(1.0, 44100, freq=880.0), 44100, "mp3"
    )
    samples = decode_audio(data)
    assert abs(samples.size / 16000 - 2.0) < 0.1
    assert abs(dominant_frequency(samples[:14000], 16000) - 440.0) < 5.0
    assert abs(dominant_frequency(samples[-14000:], 16000) - 880.0) < 5.0

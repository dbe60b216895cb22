"""Word timestamps' alignment (frontend/audio/alignment.py) against Hugging Face's own functions:
the dynamic time warping (ties included), the median filter, and the token times
WhisperGenerationMixin._extract_token_timestamps derives from a generation's cross-attentions."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers.models.whisper import generation_whisper as hf

from frontend.audio import alignment
from tests.conftest import _load_script
from tests.whisper_alignment import hf_token_times


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (12, 40), (40, 12)])
def test_time_warping_takes_hugging_faces_path(shape: tuple[int, int]) -> None:
    rng = np.random.default_rng(shape[0] * 100 + shape[1])
    for matrix in (rng.standard_normal(shape), rng.integers(0, 3, shape).astype(np.float64)):
        ours = alignment._dynamic_time_warping(matrix)  # the integer matrix is full of ties
        theirs = hf._dynamic_time_warping(matrix)
        assert [a.tolist() for a in ours] == [b.tolist() for b in theirs]


def test_median_filter_is_hugging_faces() -> None:
    x = np.random.default_rng(0).standard_normal((2, 5, 30)).astype(np.float32)
    for width in (1, 3, 7):
        expected = hf._median_filter(torch.from_numpy(x), width).numpy()
        np.testing.assert_array_equal(alignment._median_filter(x, width), expected)
    short = x[..., :3]
    np.testing.assert_array_equal(alignment._median_filter(short, 7), short)


def _hf_token_times(rows: np.ndarray, heads, num_frames: int, num_prompt: int) -> list[float]:
    num_layers = 1 + max(layer for layer, _ in heads)
    num_heads = 1 + max(head for _, head in heads)
    full = torch.rand(num_layers, 1, num_heads, num_prompt + len(rows), 1500)
    for j, (layer, head) in enumerate(heads):
        full[layer, 0, head, num_prompt:] = torch.from_numpy(rows[:, j])
    model = SimpleNamespace(
        config=SimpleNamespace(decoder_layers=num_layers, median_filter_width=7)
    )
    return hf_token_times(model, tuple(full), heads, num_frames, num_prompt)


@pytest.mark.parametrize("num_outputs,num_frames", [(1, 3000), (2, 700), (9, 1234), (30, 3000)])
def test_token_times_are_hugging_faces(num_outputs: int, num_frames: int) -> None:
    heads = [(1, 0), (1, 2), (0, 3)]
    rng = np.random.default_rng(num_outputs)
    logits = rng.standard_normal((num_outputs - 1, len(heads), 1500)).astype(np.float32) * 3
    rows = torch.from_numpy(logits).softmax(-1).numpy()
    ours = alignment.token_times(rows, num_frames, 4, 7)
    theirs = _hf_token_times(rows, heads, num_frames, 4)
    assert len(ours) == 4 + num_outputs
    np.testing.assert_array_equal(np.array(ours, np.float32), np.array(theirs, np.float32))


def test_words_group_as_hugging_faces_pipeline(tmp_path: Path) -> None:
    """Words from the pipeline's grouping: spaces start words, punctuation joins its word,
    timestamp and special tokens are not words; a word spans its tokens' times."""
    from transformers import WhisperTokenizer
    from transformers.models.whisper.tokenization_whisper import _collate_word_timestamps

    _load_script("make_tiny_whisper")._tokenizer(tmp_path, 600)
    tokenizer = WhisperTokenizer.from_pretrained(tmp_path)
    text = tokenizer.encode(" Hello world, this is tern.", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    stamp = tokenizer.convert_tokens_to_ids("<|0.00|>")
    tokens = [stamp, *text, stamp + 50, eos]
    times = [0.0] * 3 + [0.02 * (k + 1) for k in range(len(tokens))]
    ours = alignment.words(tokenizer, tokens, times, "en", eos)
    spans = [(round(times[3 + i - 1], 2), round(times[3 + i], 2)) for i in range(1, 1 + len(text))]
    theirs = _collate_word_timestamps(tokenizer, text, spans, "english", False)
    assert [(w, s, e) for w, s, e in ours] == [(c["text"], *c["timestamp"]) for c in theirs]
    assert [w.strip() for w, _, _ in ours] == ["Hello", "world,", "this", "is", "tern."]

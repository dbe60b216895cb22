"""Word timestamps for Whisper, as Hugging Face computes them (WhisperGenerationMixin.
_extract_token_timestamps, then the ASR pipeline's word grouping).

While a window is decoded the workers keep, for every output token the decoder reads, its
cross-attention probabilities over the window's 1500 encoder frames at the checkpoint's alignment
heads (generation_config.json `alignment_heads`: the heads whose attention follows the speech).
Aligning them to the audio:
1. keep the frames of real audio (a window's padding is cut: num_frames // 2 encoder frames);
2. standardise each head's rows over the tokens, smooth each row with a median filter across
   frames (the config's median_filter_width, 7 as released), average over the heads;
3. dynamic time warping over the negated matrix: a monotonic path from the first token at the
   first frame to the last token at the last frame; a token's time is the frame where the path
   first reaches it (20 ms a frame). The decoder prompt's tokens are at 0; the last output
   token, never read, repeats the time before it.
A token's span runs from the previous token's time to its own, and words are the text tokens
grouped as Hugging Face groups them (on spaces and punctuation, or on characters for languages
written without spaces): `_combine_tokens_into_words` is borrowed, not rewritten.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from frontend.audio.formats import language_names

TIME_PRECISION = 0.02  # seconds per encoder frame


def token_times(
    rows: np.ndarray, num_frames: int, num_prompt: int, filter_width: int
) -> list[float]:
    """Each token's time in its window (seconds, float32 as Hugging Face keeps them): the
    prompt's, then one per output token. rows: (outputs read, heads, 1500) float32, one per
    output token but the last; num_frames: the window's feature frames of real audio."""
    times = np.zeros(num_prompt + len(rows) + 1, dtype=np.float32)
    if len(rows) == 0:
        return times.tolist()
    weights = rows[:, :, : num_frames // 2].transpose(1, 0, 2)  # (heads, tokens, frames)
    # NOTE: a single row has no spread (0 / 0); Hugging Face's alignment then degenerates the
    # same way, which keeps the two equal.
    with np.errstate(divide="ignore", invalid="ignore"):
        weights = (weights - weights.mean(axis=1, keepdims=True)) / weights.std(
            axis=1, keepdims=True
        )
    matrix = _median_filter(weights, filter_width).mean(axis=0)
    text_indices, time_indices = _dynamic_time_warping(-matrix.astype(np.float64))
    jumps = np.pad(np.diff(text_indices), (1, 0), constant_values=1).astype(bool)
    jump_times = (time_indices[jumps] * TIME_PRECISION).astype(np.float32)
    times[num_prompt:-1] = jump_times
    times[-1] = jump_times[-1]
    return times.tolist()


def words(
    tokenizer: Any, tokens: list[int], times: list[float], language: str, eos_id: int
) -> list[tuple[str, float, float]]:
    """(word, start s, end s) of one window's output `tokens`, whose times are `times`' last
    len(tokens) (the prompt's come before): text tokens only (below <|endoftext|>), rounded to
    10 ms as the pipeline rounds them."""
    from transformers.models.whisper.tokenization_whisper import _combine_tokens_into_words

    offset = len(times) - len(tokens)
    text: list[int] = []
    spans: list[tuple[float, float]] = []
    for i, token in enumerate(tokens):
        if token < eos_id:
            k = offset + i
            text.append(token)
            spans.append((round(times[k - 1] if k else 0.0, 2), round(times[k], 2)))
    if not text:
        return []
    name = language_names().get(language, "english")
    grouped, _, indices = _combine_tokens_into_words(tokenizer, text, name)
    return [(w, spans[idx[0]][0], spans[idx[-1]][1]) for w, idx in zip(grouped, indices)]


def _median_filter(x: np.ndarray, width: int) -> np.ndarray:
    """A median over `width` frames along the last axis, edges reflected (torch's "reflect")."""
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    padded = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(pad, pad)], mode="reflect")
    windows = np.lib.stride_tricks.sliding_window_view(padded, width, axis=-1)
    return np.sort(windows, axis=-1)[..., pad]


def _dynamic_time_warping(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cheapest monotonic path through `matrix` (tokens, frames): its (token, frame) pairs.
    Hugging Face's recurrence and tie-breaking (a diagonal step only when strictly cheapest, then
    a token step, else a frame step; costs kept in float32), computed one anti-diagonal at a time
    (a diagonal's cells depend only on the two before it) instead of cell by cell."""
    n, m = matrix.shape
    cost = np.full((n + 1, m + 1), np.inf, dtype=np.float32)
    trace = np.full((n + 1, m + 1), -1, dtype=np.int8)
    cost[0, 0] = 0
    for d in range(2, n + m + 1):
        i = np.arange(max(1, d - m), min(n, d - 1) + 1)
        j = d - i
        c0, c1, c2 = cost[i - 1, j - 1], cost[i - 1, j], cost[i, j - 1]
        diagonal = (c0 < c1) & (c0 < c2)
        up = ~diagonal & (c1 < c0) & (c1 < c2)
        step = np.where(diagonal, 0, np.where(up, 1, 2)).astype(np.int8)
        best = np.where(diagonal, c0, np.where(up, c1, c2))
        cost[i, j] = (matrix[i - 1, j - 1] + best.astype(np.float64)).astype(np.float32)
        trace[i, j] = step
    trace[0, :] = 2
    trace[:, 0] = 1
    i, j = n, m
    text_indices, time_indices = [], []
    while i > 0 or j > 0:
        text_indices.append(i - 1)
        time_indices.append(j - 1)
        t = trace[i, j]
        if t == 0:
            i, j = i - 1, j - 1
        elif t == 1:
            i -= 1
        else:
            j -= 1
    return np.array(text_indices[::-1]), np.array(time_indices[::-1])

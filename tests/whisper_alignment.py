"""Hugging Face's token timestamps for tests: WhisperGenerationMixin._extract_token_timestamps over
cross-attentions laid out as `generate` returns them (the first step reads the decoder prompt,
each later step one output token)."""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.whisper.generation_whisper import WhisperGenerationMixin


class _GenerateOutput:
    """What generate returns, as far as _extract_token_timestamps reads it (greedy: no
    beam_indices)."""

    def __init__(self, cross_attentions: list, sequences: torch.Tensor) -> None:
        self.cross_attentions, self.sequences = cross_attentions, sequences

    def __contains__(self, key: str) -> bool:
        return False


def hf_token_times(
    model: Any,
    cross_attentions: tuple[torch.Tensor, ...],
    heads: list[tuple[int, int]],
    num_frames: int,
    num_prompt: int,
) -> list[float]:
    """cross_attentions: per decoder layer (1, heads, positions read, 1500), the prompt's then
    one per output token but the last; `model` has the config (decoder_layers,
    median_filter_width). Returns one time per token: the prompt's, then the outputs'."""
    num_read = cross_attentions[0].size(2)
    steps = [tuple(x[:, :, :num_prompt] for x in cross_attentions)]
    steps += [
        tuple(x[:, :, k : k + 1] for x in cross_attentions) for k in range(num_prompt, num_read)
    ]
    out = _GenerateOutput(steps, torch.zeros(1, num_read + 1, dtype=torch.long))
    times = WhisperGenerationMixin._extract_token_timestamps(
        model, out, heads, num_frames=torch.tensor([num_frames]), num_input_ids=num_prompt
    )
    return times[0].tolist()

"""Qwen2-Audio's audio tower and projector, as one placeholder encoder (workers/vision/encoders.py
ImageEncoder's interface: one item's processor tensors in, the rows of its placeholders out).

The tower is Whisper's encoder (workers/models/whisper.py) over one 30 s window of 128 log-mel
bins, with Hugging Face's Qwen2-Audio differences: attention skips the window's padding frames
(`feature_attention_mask`), the last layer's states are averaged in pairs (AvgPool1d(2, 2)) before
the final norm, and only the audio's own rows are kept: ((L - 1) // 2 + 1 - 2) // 2 + 1 of them
for L mel frames, as the processor counts its <|AUDIO|> placeholders. The projector is one Linear
to the language model's width. Replicated on every rank, as image encoders are.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workers.distributed import ParallelContext
from workers.models.whisper import WhisperEncoder
from workers.vision.encoders import ImageEncoder


def num_audio_rows(num_frames: int) -> int:
    """Placeholders of an audio of `num_frames` mel frames (Qwen2AudioProcessor's count)."""
    return ((num_frames - 1) // 2 + 1 - 2) // 2 + 1


class Qwen2AudioTower(WhisperEncoder):
    def forward(self, features: torch.Tensor, num_frames: int) -> torch.Tensor:
        """(mel bins, 3000) features of which the first `num_frames` are audio -> (rows, d)."""
        num_conv = (num_frames - 1) // 2 + 1
        key_mask = torch.arange(self.num_frames // 2, device=features.device) < num_conv
        h = self.layer_states(features, key_mask)  # (S, d_model)
        h = F.avg_pool1d(h.transpose(0, 1)[None], 2, 2)[0].transpose(0, 1)
        return self.layer_norm(h)[: num_audio_rows(num_frames)]


class Qwen2AudioProjector(nn.Module):
    def __init__(self, audio_size: int, text_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(audio_size, text_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class Qwen2AudioEncoder(ImageEncoder):
    CHECKPOINT_PREFIXES = (
        (("model.audio_tower.", "audio_tower."), "vision_tower."),
        (("model.multi_modal_projector.", "multi_modal_projector."), "multi_modal_projector."),
    )

    def encode(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """`input_features` (1, mel bins, 3000) and `feature_attention_mask` (1, 3000)."""
        features = tensors["input_features"].reshape(tensors["input_features"].shape[-2:])
        num_frames = int(tensors["feature_attention_mask"].sum())
        if not 0 < num_frames <= features.shape[-1]:
            raise ValueError(f"an audio of {num_frames} mel frames")
        weight = next(self.parameters())
        rows = self.vision_tower(features.to(weight.device, weight.dtype), num_frames)
        return self.multi_modal_projector(rows)


def build_qwen2_audio(hf: dict[str, Any]) -> ImageEncoder:
    audio = dict(hf.get("audio_config") or {})
    text = hf.get("text_config") or {}
    for key, default in (("encoder_layers", 32), ("encoder_attention_heads", 20),
                         ("encoder_ffn_dim", 5120), ("d_model", 1280), ("num_mel_bins", 128),
                         ("max_source_positions", 1500)):  # fmt: skip
        audio.setdefault(key, default)
    tower = Qwen2AudioTower(audio, ParallelContext.single())
    projector = Qwen2AudioProjector(audio["d_model"], text["hidden_size"])
    return Qwen2AudioEncoder(tower, projector, int(hf.get("audio_token_index", 151646)))

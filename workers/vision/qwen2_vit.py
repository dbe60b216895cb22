"""Qwen2-VL's vision transformer (Hugging Face's Qwen2VisionTransformerPretrainedModel): Qwen's
patch embedding (no bias) and 2D rotary positions as the later towers (qwen_vit.py), LayerNorm
blocks with a two-layer MLP (`fc1`, `fc2`; quick GELU by default, `embed_dim * mlp_ratio` wide),
attention over each whole frame (no windows, no learned position table), and the merger Qwen2.5-VL
kept (`ln_q`, here a LayerNorm, then two linears around a GELU) turning each spatial_merge_size^2
block of patches into one text-hidden row.

Its config.json names the tower's width `embed_dim` and the merger's output (the language model's
width) `hidden_size`. Patches arrive in merge-block order (qwen_vit.py), the order the merger and
the placeholders read. Parameter names are Hugging Face's (`model.visual.*`). It is Qwen2.5-VL's
tower (qwen2_5_vit.py) with these norms and MLPs and no windows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from workers.vision.qwen2_5_vit import Qwen25VisionTransformer
from workers.vision.vit import activation


@dataclass(frozen=True)
class Qwen2VisionConfig:  # Qwen2VLVisionConfig's defaults, under the names the shared parts read
    depth: int = 32
    hidden_size: int = 1280  # config.json's embed_dim
    out_hidden_size: int = 3584  # config.json's hidden_size
    hidden_act: str = "quick_gelu"
    mlp_ratio: float = 4.0
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    rope_theta: float = 10000.0
    window_size: int = 0  # no windows
    fullatt_block_indexes: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, vision: dict[str, Any]) -> Qwen2VisionConfig:
        rope = vision.get("rope_parameters") or {}
        merged = {**vision, "rope_theta": rope.get("rope_theta", 10000.0)}
        merged.pop("hidden_size", None)
        if "embed_dim" in vision:
            merged["hidden_size"] = vision["embed_dim"]
        if "hidden_size" in vision:
            merged["out_hidden_size"] = vision["hidden_size"]
        return cls(**{k: merged[k] for k in cls.__dataclass_fields__ if k in merged})


class Qwen2VisionMLP(nn.Module):
    def __init__(self, config: Qwen2VisionConfig):
        super().__init__()
        width = int(config.hidden_size * config.mlp_ratio)
        self.fc1 = nn.Linear(config.hidden_size, width)
        self.act = activation(config.hidden_act)
        self.fc2 = nn.Linear(width, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Qwen2VisionTransformer(Qwen25VisionTransformer):
    def __init__(self, config: Qwen2VisionConfig):
        super().__init__(config, nn.LayerNorm, Qwen2VisionMLP)

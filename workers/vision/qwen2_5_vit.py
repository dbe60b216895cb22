"""Qwen2.5-VL's vision transformer (Hugging Face's Qwen2_5_VisionTransformerPretrainedModel):
Qwen's patch embedding (no bias) and 2D rotary positions as Qwen3.5's tower (qwen_vit.py), but
RMSNorm blocks with gated SiLU MLPs, no learned position table, and **window attention**: most
blocks attend only inside windows of `window_size` pixels (window_size / patch / merge merged
tokens a side; the image's right and bottom windows are cut short), the blocks in
`fullatt_block_indexes` over each whole frame. The merger (RMSNorm `ln_q`, then two linears around
a GELU) turns each spatial_merge_size^2 block of patches into one text-hidden row.

Patches arrive as the processor writes them (merge-block order, qwen_vit.py); the tower regroups
the merged blocks window by window for its blocks and puts the merger's rows back in the
processor's order, as Hugging Face's `get_vision_window_index` and its inverse do. Parameter names
are Hugging Face's (`model.visual.*`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from workers.vision.qwen_vit import (
    QwenPatchEmbed,
    QwenVisionBlock,
    Segments,
    patch_rotary,
    patch_rotary_frequencies,
)
from workers.vision.vit import RMSNorm, activation


@dataclass(frozen=True)
class Qwen25VisionConfig:  # Qwen2_5_VLVisionConfig's defaults
    depth: int = 32
    hidden_size: int = 3584
    hidden_act: str = "silu"
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    window_size: int = 112
    out_hidden_size: int = 3584
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    rope_theta: float = 10000.0

    @classmethod
    def from_hf(cls, vision: dict[str, Any]) -> Qwen25VisionConfig:
        rope = vision.get("rope_parameters") or {}
        merged = {**vision, "rope_theta": rope.get("rope_theta", 10000.0)}
        if "fullatt_block_indexes" in merged:
            merged["fullatt_block_indexes"] = tuple(merged["fullatt_block_indexes"])
        return cls(**{k: merged[k] for k in cls.__dataclass_fields__ if k in merged})


class Qwen25VisionMLP(nn.Module):
    def __init__(self, config: Qwen25VisionConfig):
        super().__init__()
        self.act = activation(config.hidden_act)
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class QwenLinearPatchMerger(nn.Module):
    """Qwen2-VL's and Qwen2.5-VL's merger: `ln_q` over each patch (a LayerNorm, an RMSNorm), the
    spatial_merge_size^2 patches of a block concatenated, then two linears around a GELU."""

    def __init__(self, config: Any, norm: type[nn.Module]):
        super().__init__()
        self.merged_size = config.hidden_size * config.spatial_merge_size**2
        self.ln_q = norm(config.hidden_size, eps=1e-6)
        # Hugging Face's nn.Sequential(Linear, GELU, Linear): parameters mlp.0.* and mlp.2.*
        self.mlp = nn.Sequential(
            nn.Linear(self.merged_size, self.merged_size),
            nn.GELU(),
            nn.Linear(self.merged_size, config.out_hidden_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, H) -> (N / m^2, out)
        return self.mlp(self.ln_q(x).view(-1, self.merged_size))


def window_order(
    grid_thw: tuple[int, int, int], m: int, window: int
) -> tuple[torch.Tensor, list[int]]:
    """The merged blocks of a (t, h, w) patch grid regrouped window by window (`window` merged
    blocks a side, frame by frame, windows row by row): (block indices in that order, the
    number of patches in each window)."""
    t, h, w = grid_thw
    bh, bw = h // m, w // m
    blocks = torch.arange(t * bh * bw).reshape(t, bh, bw)
    order, lengths = [], []
    for frame in blocks:
        for top in range(0, bh, window):
            for left in range(0, bw, window):
                ids = frame[top : top + window, left : left + window].reshape(-1)
                order.append(ids)
                lengths.append(ids.numel() * m * m)
    return torch.cat(order), lengths


class Qwen25VisionTransformer(nn.Module):
    """`norm` and `mlp` build the blocks' norms and MLPs (Qwen2-VL's tower is this one with
    LayerNorms, its own MLP and no windows: `window_size` 0)."""

    def __init__(
        self,
        config: Any,
        norm: type[nn.Module] = RMSNorm,
        mlp: Callable[[Any], nn.Module] = Qwen25VisionMLP,
    ):
        super().__init__()
        self.config = config
        self.patch_embed = QwenPatchEmbed(config, bias=False)
        self.blocks = nn.ModuleList(
            QwenVisionBlock(config, norm, mlp(config)) for _ in range(config.depth)
        )
        self.merger = QwenLinearPatchMerger(config, norm)
        inv_freq = patch_rotary_frequencies(
            config.hidden_size // config.num_heads, config.rope_theta
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.window = config.window_size // config.spatial_merge_size // config.patch_size

    def forward(self, patches: torch.Tensor, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        """One image's patches (t h w, C T P P) -> (t h w / m^2, out_hidden_size)."""
        t, h, w = grid_thw
        m = self.config.spatial_merge_size
        if patches.shape[0] != t * h * w:
            raise ValueError(f"{patches.shape[0]} patches for a {t}x{h}x{w} grid")
        # Without windows (0), one window a frame: every block attends over the whole frame.
        order, window_lengths = window_order(grid_thw, m, self.window or max(h, w))
        rows = (order[:, None] * m * m + torch.arange(m * m)).reshape(-1)  # patches, windowed

        x = self.patch_embed(patches)[rows]
        cos, sin = (c[rows] for c in patch_rotary(self.inv_freq, grid_thw, m))
        windows, frames = Segments(window_lengths), Segments([h * w] * t)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames if i in self.config.fullatt_block_indexes else windows)
        merged = self.merger(x)
        return merged[torch.argsort(order)]  # back in the processor's (placeholder) order

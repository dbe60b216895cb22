"""Qwen3-VL's / Qwen3.5's vision transformer (Hugging Face's Qwen3VLVisionModel, Qwen3_5VisionModel):
patches of (temporal, patch, patch) pixels embedded by a linear map (the checkpoint's Conv3d, whose
stride equals its kernel), learned position embeddings resampled bilinearly to each image's grid, 2D
rotary attention inside each frame, then the merger that concatenates each spatial_merge_size^2
block of patches into one text-hidden row.

Qwen3-VL's **deepstack** (Qwen3.5 drops it): after each block of `deepstack_visual_indexes` a merger
of its own (normed after the merge) turns that block's output into rows too; the language model adds
the k-th of them to its hidden states at the image's placeholders after its k-th layer. The tower
returns them beside the main rows: (rows, out_hidden_size * (1 + len(deepstack_visual_indexes))).

Patches arrive as the processor writes them: (num_patches, channels * temporal * patch * patch),
already in merge-block order (each block's patches consecutive), the order the merger and the
language model's placeholders read. Parameter names are Hugging Face's (`model.visual.*`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workers.vision.vit import activation


@dataclass(frozen=True)
class QwenVisionConfig:
    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    rope_theta: float = 10000.0
    deepstack_visual_indexes: tuple[int, ...] = ()  # Qwen3-VL's [8, 16, 24]; Qwen3.5: none

    @classmethod
    def from_hf(cls, vision: dict[str, Any], deepstack: bool = False) -> QwenVisionConfig:
        """config.json's vision_config over Qwen3VLVisionConfig's defaults (its deepstack layers
        only where the model has them: Qwen3.5's config class carries the field unused)."""
        rope = vision.get("rope_parameters") or {}
        merged = {**vision, "rope_theta": rope.get("rope_theta", 10000.0)}
        merged["deepstack_visual_indexes"] = (
            tuple(vision.get("deepstack_visual_indexes", (8, 16, 24))) if deepstack else ()
        )
        return cls(**{k: merged[k] for k in cls.__dataclass_fields__ if k in merged})


def merge_block_order(grid: torch.Tensor, m: int) -> torch.Tensor:
    """(h, w, ...) -> (h * w, ...) with each m x m block's entries consecutive."""
    h, w = grid.shape[:2]
    rest = grid.shape[2:]
    return grid.reshape(h // m, m, w // m, m, *rest).transpose(1, 2).reshape(h * w, *rest)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def patch_rotary_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """(head_dim / 4,) the frequencies of Qwen's 2D vision rotation (a quarter of a head each for
    rows and columns)."""
    quarter = torch.arange(0, head_dim // 2, 2, dtype=torch.float32) / (head_dim // 2)
    return 1.0 / theta**quarter


def patch_rotary(
    inv_freq: torch.Tensor, grid_thw: tuple[int, int, int], m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (t h w, head_dim) float32 in merge-block order: a quarter of the frequencies turn
    by the patch's row, a quarter by its column, the halves repeated (rotate-half layout)."""
    t, h, w = grid_thw
    device = inv_freq.device
    rows, cols = torch.meshgrid(
        torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij"
    )
    hw = merge_block_order(torch.stack((rows, cols), -1), m)
    freqs = (hw[..., None].float() * inv_freq).flatten(1)  # (h w, head_dim / 2)
    freqs = torch.cat((freqs, freqs), -1).repeat(t, 1)
    return freqs.cos(), freqs.sin()


def rotate_vision(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k (N, heads, D) rotated by cos, sin (N, D), in float32 as Hugging Face rotates."""
    cos, sin = cos[:, None], sin[:, None]
    q32, k32 = q.float(), k.float()
    q = (q32 * cos + rotate_half(q32) * sin).to(q.dtype)
    k = (k32 * cos + rotate_half(k32) * sin).to(k.dtype)
    return q, k


class Segments:
    """A partition of a tower's rows into consecutive segments that attend only within
    themselves (Hugging Face's cu_seqlens: a frame, or Qwen2.5-VL's window), grouped by length so
    that each length is one batched attention."""

    def __init__(self, lengths: list[int]) -> None:
        starts = torch.tensor([0, *lengths]).cumsum(0)[:-1].tolist()
        by_length: dict[int, list[int]] = defaultdict(list)
        for start, length in zip(starts, lengths):
            if length:
                by_length[length].append(start)
        # (rows of the segments of one length, in segment order): one gather, one scatter each.
        self.groups = [
            (length, (torch.tensor(s)[:, None] + torch.arange(length)).reshape(-1))
            for length, s in by_length.items()
        ]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v (N, heads, D) -> (N, heads, D), each segment attending within itself."""
        if len(self.groups) == 1 and self.groups[0][1].numel() == q.shape[0]:
            length, _ = self.groups[0]  # equal segments covering the rows in order: no gather
            batched = [t.reshape(-1, length, *t.shape[1:]).transpose(1, 2) for t in (q, k, v)]
            return F.scaled_dot_product_attention(*batched).transpose(1, 2).reshape(q.shape)
        out = torch.empty_like(q)
        for length, rows in self.groups:
            batched = [t[rows].reshape(-1, length, *t.shape[1:]).transpose(1, 2) for t in (q, k, v)]
            out[rows] = F.scaled_dot_product_attention(*batched).transpose(1, 2).flatten(0, 1)
        return out


class QwenVisionAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.proj = nn.Linear(hidden_size, hidden_size)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments
    ) -> torch.Tensor:  # (N, H) -> (N, H)
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, -1).unbind(1)  # (N, heads, D) each
        q, k = rotate_vision(q, k, cos, sin)
        return self.proj(segments.attend(q, k, v).reshape(n, -1))


class QwenVisionMLP(nn.Module):
    def __init__(self, config: QwenVisionConfig):
        super().__init__()
        self.act = activation(config.hidden_act)
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class QwenVisionBlock(nn.Module):
    """Pre-norm: attention inside each segment, then the MLP. Qwen3.5's norms are LayerNorms and
    its MLP fc1/fc2; Qwen2.5-VL's RMSNorms and a gated MLP (qwen2_5_vit.py)."""

    def __init__(self, config: Any, norm: type[nn.Module], mlp: nn.Module):
        super().__init__()
        self.norm1 = norm(config.hidden_size, eps=1e-6)
        self.norm2 = norm(config.hidden_size, eps=1e-6)
        self.attn = QwenVisionAttention(config.hidden_size, config.num_heads)
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class QwenPatchEmbed(nn.Module):
    def __init__(self, config: Any, bias: bool = True):  # Qwen2.5-VL's has no bias
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(
            config.in_channels, config.hidden_size, kernel, stride=kernel, bias=bias
        )

    def forward(self, patches: torch.Tensor) -> torch.Tensor:  # (N, C T P P) -> (N, H)
        # A Conv3d whose stride is its kernel, on one kernel's worth of input each: a linear map.
        return F.linear(patches, self.proj.weight.flatten(1), self.proj.bias)


class QwenPatchMerger(nn.Module):
    """`norm_after_merge`: the deepstack mergers' LayerNorm over each merged row (Hugging Face's
    use_postshuffle_norm); the main merger's normalises each patch first."""

    def __init__(self, config: QwenVisionConfig, norm_after_merge: bool = False):
        super().__init__()
        self.merged_size = config.hidden_size * config.spatial_merge_size**2
        self.norm_after_merge = norm_after_merge
        normed = self.merged_size if norm_after_merge else config.hidden_size
        self.norm = nn.LayerNorm(normed, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged_size, self.merged_size)
        self.linear_fc2 = nn.Linear(self.merged_size, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, H) -> (N / m^2, out)
        if self.norm_after_merge:
            x = self.norm(x.view(-1, self.merged_size))
        else:
            x = self.norm(x).view(-1, self.merged_size)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class QwenVisionTransformer(nn.Module):
    def __init__(self, config: QwenVisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = QwenPatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.grid_side = int(config.num_position_embeddings**0.5)
        self.blocks = nn.ModuleList(
            QwenVisionBlock(config, nn.LayerNorm, QwenVisionMLP(config))
            for _ in range(config.depth)
        )
        self.merger = QwenPatchMerger(config)
        self.deepstack_merger_list = nn.ModuleList(
            QwenPatchMerger(config, norm_after_merge=True) for _ in config.deepstack_visual_indexes
        )
        inv_freq = patch_rotary_frequencies(
            config.hidden_size // config.num_heads, config.rope_theta
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, patches: torch.Tensor, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        """One image's (or video's) patches (t h w, C T P P) -> (t h w / m^2, out_hidden_size),
        times 1 + the number of deepstack layers (main rows first, then each deepstack's)."""
        t, h, w = grid_thw
        if patches.shape[0] != t * h * w:
            raise ValueError(f"{patches.shape[0]} patches for a {t}x{h}x{w} grid")
        x = self.patch_embed(patches) + self._position_embeddings(h, w).repeat(t, 1).to(
            patches.dtype
        )
        cos, sin = patch_rotary(self.inv_freq, (t, h, w), self.config.spatial_merge_size)
        deepstack = []
        frames = Segments([h * w] * t)  # each frame attends within itself
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames)
            if i in self.config.deepstack_visual_indexes:
                k = self.config.deepstack_visual_indexes.index(i)
                deepstack.append(self.deepstack_merger_list[k](x))
        return torch.cat([self.merger(x), *deepstack], dim=-1)

    def _position_embeddings(self, h: int, w: int) -> torch.Tensor:
        """The learned (side, side) table resampled to (h, w) (bilinear, corners aligned, as HF),
        in merge-block order: (h w, hidden)."""
        side = self.grid_side
        table = self.pos_embed.weight.float().T.reshape(1, -1, side, side)
        grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)
        return merge_block_order(grid[0].permute(1, 2, 0), self.config.spatial_merge_size)

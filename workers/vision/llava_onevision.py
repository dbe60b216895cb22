"""LLaVA-OneVision's "anyres" image layout: how an image's features are laid out in the prompt.

The processor gives one image as its base view (the whole image resized to S x S) followed by the
tiles of the grid resolution that best fits it (`image_grid_pinpoints`, chosen as Hugging Face's
`select_best_resolution`), the image resized into that grid and padded to it. Its placeholder
rows are, in this order:
- the base view's rows ((S / patch)^2);
- the grid's patch features as one picture, row by row, with the padding's rows and columns
  removed ("unpadding", to the original aspect ratio), shrunk by bilinear interpolation when it
  holds more than `anyres_max_N` base views' worth (by more than 10%), each row followed by the
  learned `image_newline`.
An image that shares its prompt with other images (`batch_num_images` > 1) is its base view and
one `image_newline` only, as Hugging Face's model and processor do. A video is each frame's
patch features pooled 2x2 (bilinear, to ceil(side / 2) a side), frame after frame, then one
`image_newline`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from workers.vision.projectors import LlavaMultiModalProjector


def select_best_resolution(
    original_size: tuple[int, int], resolutions: list[list[int]]
) -> tuple[int, int]:
    """(height, width) -> the (height, width) of `resolutions` that keeps the most of the image
    once fitted in it, then wastes the least (Hugging Face's, tie for tie)."""
    height, width = original_size
    best, max_effective, min_wasted = None, 0, float("inf")
    for res_height, res_width in resolutions:
        scale = min(res_width / width, res_height / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = res_width * res_height - effective
        if effective > max_effective or (effective == max_effective and wasted < min_wasted):
            best, max_effective, min_wasted = (res_height, res_width), effective, wasted
    assert best is not None, "image_grid_pinpoints is empty"
    return best


def unpad(features: torch.Tensor, original_size: tuple[int, int]) -> torch.Tensor:
    """(C, H, W) features of an image fitted and centred in H x W -> the rows and columns that
    hold the image (Hugging Face's `unpad_image`, its rounding included)."""
    original_height, original_width = original_size
    _, height, width = features.shape
    if original_width / original_height > width / height:  # wider: padding above and below
        new_height = int(round(original_height * (width / original_width), 7))
        padding = (height - new_height) // 2
        return features[:, padding : height - padding, :]
    new_width = int(round(original_width * (height / original_height), 7))
    padding = (width - new_width) // 2
    return features[:, :, padding : width - padding]


class LlavaOnevisionProjector(LlavaMultiModalProjector):
    """LLaVA's two-layer MLP, the `image_newline` row (the checkpoint's `model.image_newline`) and
    the anyres layout of one image's projected pictures."""

    def __init__(
        self,
        feature_size: int,
        text_hidden_size: int,
        act: str,
        bias: bool,
        image_size: int,
        patches_per_side: int,
        grid_pinpoints: list[list[int]],
        aspect_ratio: str,
    ):
        super().__init__(feature_size, text_hidden_size, act, bias)
        self.image_newline = nn.Parameter(torch.zeros(text_hidden_size))
        self.image_size = image_size
        self.patches_per_side = patches_per_side
        self.grid_pinpoints = [list(r) for r in grid_pinpoints]
        if not aspect_ratio.startswith("anyres_max_"):
            raise ValueError(f"vision_aspect_ratio {aspect_ratio!r} (anyres_max_N) not supported")
        self.max_num_patches = int(aspect_ratio.removeprefix("anyres_max_"))

    def grid_shape(self, image_size: tuple[int, int]) -> tuple[int, int]:
        """(height, width) of an image -> the (rows, columns) of tiles the processor cut."""
        height, width = select_best_resolution(image_size, self.grid_pinpoints)
        return height // self.image_size, width // self.image_size

    def num_pictures(self, image_size: tuple[int, int]) -> int:
        """The base view and the grid's tiles, as many as the processor gives."""
        rows, cols = self.grid_shape(image_size)
        return 1 + rows * cols

    def layout(self, pictures: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
        """(N, P, hidden) projected pictures of one image (the base view first) -> its rows in
        prompt order (module docstring)."""
        base = pictures[0]
        if pictures.shape[0] == 1:  # an image among several: its base view and one newline
            return torch.cat([base, self.image_newline[None].to(base)])
        side = self.patches_per_side
        if base.shape[0] != side * side:
            raise ValueError("anyres needs every patch of the base view (select strategy 'full')")
        rows, cols = self.grid_shape(image_size)
        grid = pictures[1:].view(rows, cols, side, side, -1)
        grid = grid.permute(4, 0, 2, 1, 3).flatten(1, 2).flatten(2, 3)  # (C, rows*side, cols*side)
        grid = unpad(grid, image_size)
        _, height, width = grid.shape
        ratio = math.sqrt(height * width / (self.max_num_patches * side**2))
        if ratio > 1.1:
            size = [int(height // ratio), int(width // ratio)]
            grid = F.interpolate(grid[None], size, mode="bilinear")[0]
        newline = self.image_newline[:, None, None].expand(*grid.shape[:-1], 1).to(grid)
        grid = torch.cat([grid, newline], dim=-1).flatten(1, 2).transpose(0, 1)  # (rows, C)
        return torch.cat([base, grid])

    def video_layout(self, frames: torch.Tensor) -> torch.Tensor:
        """(F, P, hidden) projected frames of one video -> its rows: each frame's features
        bilinearly pooled to ceil(side / 2) a side, frame after frame, then one newline
        (Hugging Face's apply_pooling and get_video_features)."""
        side = self.patches_per_side
        if frames.shape[1] != side * side:
            raise ValueError("videos need every patch of a frame (select strategy 'full')")
        grid = frames.view(frames.shape[0], side, side, -1).permute(0, 3, 1, 2)
        pooled = F.interpolate(grid, size=[math.ceil(side / 2)] * 2, mode="bilinear")
        rows = pooled.permute(0, 2, 3, 1).reshape(-1, frames.shape[-1])
        return torch.cat([rows, self.image_newline[None].to(rows)])

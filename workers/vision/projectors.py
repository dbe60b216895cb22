"""Multi-modal projectors: a vision tower's patch features -> rows in the language model's
embedding space, one per placeholder token.

- LLaVA: linear_1 (feature size -> text hidden), the projector's activation, linear_2 (text hidden
  -> text hidden); biases as `multimodal_projector_bias` says. One row per patch.
- Gemma 3: the patches laid back on their square grid, average-pooled down to `mm_tokens_per_image`
  (a square number), Gemma's RMSNorm (scale 1 + weight, in fp32), then a matmul with
  `mm_input_projection_weight` (vision hidden, text hidden). One row per pooled cell, row-major.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.vision.vit import activation


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, feature_size: int, text_hidden_size: int, act: str, bias: bool):
        super().__init__()
        self.linear_1 = nn.Linear(feature_size, text_hidden_size, bias=bias)
        self.act = activation(act)
        self.linear_2 = nn.Linear(text_hidden_size, text_hidden_size, bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # (..., F) -> (..., text hidden)
        return self.linear_2(self.act(self.linear_1(features)))


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaled by (1 + weight), computed in fp32 and cast back, as Gemma's."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class Gemma3MultiModalProjector(nn.Module):
    def __init__(
        self,
        vision_hidden_size: int,
        text_hidden_size: int,
        patches_per_side: int,
        tokens_per_image: int,
        eps: float,
    ):
        super().__init__()
        tokens_per_side = int(tokens_per_image**0.5)
        if tokens_per_side**2 != tokens_per_image or patches_per_side % tokens_per_side:
            raise ValueError(
                f"mm_tokens_per_image {tokens_per_image} must be a square whose side divides the "
                f"{patches_per_side} patches per side"
            )
        self.patches_per_side = patches_per_side
        self.tokens_per_image = tokens_per_image
        self.avg_pool = nn.AvgPool2d(patches_per_side // tokens_per_side)
        self.mm_soft_emb_norm = GemmaRMSNorm(vision_hidden_size, eps)
        self.mm_input_projection_weight = nn.Parameter(
            torch.zeros(vision_hidden_size, text_hidden_size)
        )

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """(B, P, H) patches in row-major order -> (B, mm_tokens_per_image, text hidden)."""
        b, _, h = patches.shape
        side = self.patches_per_side
        grid = patches.transpose(1, 2).reshape(b, h, side, side)  # (B, H, side, side)
        pooled = self.avg_pool(grid).flatten(2).transpose(1, 2)  # (B, tokens, H)
        return (self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight).type_as(patches)

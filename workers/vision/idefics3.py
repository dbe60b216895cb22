"""Idefics3's (and SmolVLM's) vision transformer and connector.

- The tower is SigLIP's (patch convolution with bias, no class token, `post_layernorm` on the last
  hidden state) with NaViT's variable-resolution position embeddings: a picture of p x q patches
  (its real part, by `pixel_attention_mask`) reads position embedding (i * side / p, j * side / q)
  of the learned side x side grid, bucketed as Hugging Face's `Idefics3VisionEmbeddings`; padding
  patches read position 0 and no patch attends to them.
- The connector is a pixel shuffle (each scale x scale block of patches side by side in one
  feature, in Hugging Face's order) and one linear map without bias (`modality_projection.proj`)
  into the text model's embedding space: (side / scale)^2 rows a picture.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from workers.vision.vit import VisionConfig, VisionEncoder

# transformers' Idefics3VisionConfig defaults, for the fields a released config.json leaves out.
IDEFICS3_VISION_DEFAULTS = {
    "hidden_size": 1152, "intermediate_size": 3072, "num_hidden_layers": 12,
    "num_attention_heads": 16, "image_size": 224, "patch_size": 32, "num_channels": 3,
    "layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh",
}  # fmt: skip


def idefics3_vision_config(vision: dict[str, Any]) -> VisionConfig:
    return VisionConfig.from_hf(vision, IDEFICS3_VISION_DEFAULTS)


def patch_mask_of(pixel_attention_mask: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(B, H, W) pixel mask -> (B, H / patch, W / patch) bool: patches holding any real pixel."""
    rows = pixel_attention_mask.unfold(1, patch_size, patch_size)  # (B, H / p, W, p)
    blocks = rows.unfold(2, patch_size, patch_size)  # (B, H / p, W / p, p, p)
    return blocks.sum(dim=(-1, -2)) > 0


class Idefics3VisionEmbeddings(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.patch_size = config.patch_size
        self.side = config.patches_per_side
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, config.patch_size, config.patch_size
        )
        self.position_embedding = nn.Embedding(self.side**2, config.hidden_size)

    def position_ids(self, patch_mask: torch.Tensor) -> torch.Tensor:
        """(B, P_h, P_w) patch mask -> (B, P_h * P_w) position ids, computed as Hugging Face's
        (fp32 fractions, bucketed right) so that rounding picks the same buckets."""
        b, rows, cols = patch_mask.shape
        device = patch_mask.device
        boundaries = torch.arange(1 / self.side, 1.0, 1 / self.side, device=device)
        step_h = 1.0 / patch_mask[:, :, 0].sum(dim=1)  # (B,) over each picture's real rows
        step_w = 1.0 / patch_mask[:, 0, :].sum(dim=1)
        frac_h = torch.arange(rows, device=device, dtype=torch.float32)[None] * step_h[:, None]
        frac_w = torch.arange(cols, device=device, dtype=torch.float32)[None] * step_w[:, None]
        bucket_h = torch.bucketize(frac_h.clamp(max=1.0 - 1e-6), boundaries, right=True)
        bucket_w = torch.bucketize(frac_w.clamp(max=1.0 - 1e-6), boundaries, right=True)
        ids = (bucket_h[:, :, None] * self.side + bucket_w[:, None, :]).reshape(b, -1)
        return torch.where(patch_mask.reshape(b, -1), ids, torch.zeros_like(ids))

    def forward(self, pixel_values: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) pictures, (B, H / patch, W / patch) mask -> (B, P, hidden)."""
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        return patches + self.position_embedding(self.position_ids(patch_mask))


class Idefics3VisionTransformer(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.patch_size = config.patch_size
        self.embeddings = Idefics3VisionEmbeddings(config)
        self.encoder = VisionEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(
        self, pixel_values: torch.Tensor, pixel_attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(B, C, H, W) pictures and their (B, H, W) pixel mask (None: no padding) -> the normed
        last hidden state, (B, P, hidden), patches row-major."""
        b, _, height, width = pixel_values.shape
        if pixel_attention_mask is None:
            patch_mask = pixel_values.new_ones(
                b, height // self.patch_size, width // self.patch_size, dtype=torch.bool
            )
        else:
            patch_mask = patch_mask_of(pixel_attention_mask, self.patch_size)
        x = self.embeddings(pixel_values, patch_mask)
        key_mask = None if bool(patch_mask.all()) else patch_mask.reshape(b, -1)
        return self.post_layernorm(self.encoder(x, key_mask=key_mask)[-1])


class Idefics3ModalityProjection(nn.Module):
    def __init__(self, feature_size: int, text_hidden_size: int):
        super().__init__()
        self.proj = nn.Linear(feature_size, text_hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Idefics3Connector(nn.Module):
    def __init__(self, vision_hidden_size: int, text_hidden_size: int, scale_factor: int):
        super().__init__()
        self.scale_factor = scale_factor
        self.modality_projection = Idefics3ModalityProjection(
            vision_hidden_size * scale_factor**2, text_hidden_size
        )

    def pixel_shuffle(self, x: torch.Tensor) -> torch.Tensor:
        """(B, side^2, H) -> (B, (side / s)^2, H * s^2), Hugging Face's reshapes step by step."""
        b, seq, h = x.shape
        s = self.scale_factor
        side = int(seq**0.5)
        if side * side != seq or side % s:
            raise ValueError(f"pixel shuffle by {s} needs a square grid of patches, got {seq}")
        x = x.view(b, side, side // s, h * s)  # (B, rows, cols / s, s patches side by side)
        x = x.permute(0, 2, 1, 3).reshape(b, side // s, side // s, h * s * s)
        return x.permute(0, 2, 1, 3).reshape(b, seq // (s * s), h * s * s)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:  # (B, P, H) -> (B, P / s^2, text)
        return self.modality_projection(self.pixel_shuffle(patches))

"""SigLIP's vision transformer as Gemma 3 uses it: patch convolution (with bias), learned position
embeddings, no class token and no LayerNorm before the encoder, `post_layernorm` on the last hidden
state, which is what the projector takes. The attention-pooling head some SigLIP checkpoints carry
(`vision_use_head`) is not built: Gemma 3 never runs it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from workers.vision.vit import VisionConfig, VisionEncoder

# transformers' SiglipVisionConfig defaults, for the fields a released config.json leaves out.
SIGLIP_VISION_DEFAULTS = {
    "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
    "num_attention_heads": 12, "image_size": 224, "patch_size": 16, "num_channels": 3,
    "layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh",
}  # fmt: skip


def siglip_vision_config(vision: dict[str, Any]) -> VisionConfig:
    return VisionConfig.from_hf(vision, SIGLIP_VISION_DEFAULTS)


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.image_size = config.image_size
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, config.patch_size, config.patch_size
        )
        self.position_embedding = nn.Embedding(config.patches_per_side**2, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # (B, C, S, S) -> (B, P, H)
        _, _, height, width = pixel_values.shape
        if height != self.image_size or width != self.image_size:
            raise ValueError(
                f"SigLIP takes {self.image_size}px square images, got {height}x{width}"
            )
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        return patches + self.position_embedding.weight


class SiglipVisionTransformer(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.embeddings = SiglipVisionEmbeddings(config)
        self.encoder = VisionEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(B, C, S, S) -> the normed last hidden state, (B, P, H), patches in row-major order."""
        return self.post_layernorm(self.encoder(self.embeddings(pixel_values))[-1])

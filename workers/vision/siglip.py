"""SigLIP's vision transformer as Gemma 3 and LLaVA-OneVision use it: patch convolution (with bias),
learned position embeddings, no class token and no LayerNorm before the encoder; Gemma 3's
projector takes `post_layernorm` of the last hidden state, LLaVA-OneVision's the hidden states its
`vision_feature_layer` selects. The attention-pooling head some SigLIP checkpoints carry
(`vision_use_head`) is not built: Gemma 3 never runs it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from workers.vision.vit import VisionConfig, VisionEncoder, feature_layer_indices

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
    """Gemma 3 takes the normed last hidden state; LLaVA-OneVision (`feature_layers` given) the
    hidden states it selects, unnormed, side by side, the first patch dropped under "default" as
    Hugging Face drops CLIP's class token."""

    def __init__(
        self,
        config: VisionConfig,
        feature_layers: int | list[int] | None = None,
        select_strategy: str = "full",
    ):
        super().__init__()
        self.feature_layers = (
            None
            if feature_layers is None
            else feature_layer_indices(feature_layers, config.num_hidden_layers)
        )
        self.drops_first_patch = select_strategy == "default"
        self.embeddings = SiglipVisionEmbeddings(config)
        self.encoder = VisionEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    @property
    def feature_size(self) -> int:
        num_layers = 1 if self.feature_layers is None else len(self.feature_layers)
        return self.post_layernorm.normalized_shape[0] * num_layers

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(B, C, S, S) -> (B, P, feature_size), patches in row-major order."""
        x = self.embeddings(pixel_values)
        if self.feature_layers is None:
            return self.post_layernorm(self.encoder(x)[-1])
        hidden_states = self.encoder(x, num_layers=max(self.feature_layers))
        features = torch.cat([hidden_states[i] for i in self.feature_layers], dim=-1)
        return features[:, 1:] if self.drops_first_patch else features

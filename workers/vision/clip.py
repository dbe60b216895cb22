"""CLIP's vision transformer as LLaVA uses it: patch convolution (no bias), a class token in front,
learned position embeddings, a LayerNorm before the encoder (`pre_layrnorm`, Hugging Face's
spelling), and the image features taken from one or several hidden states (`vision_feature_layer`,
indexed as Hugging Face's `hidden_states`: 0 is the encoder's input), with the class token dropped
("default") or kept ("full"). `post_layernorm` is held so the checkpoint loads whole, but only
CLIP's pooled output runs it, and LLaVA never reads that."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from workers.vision.vit import VisionConfig, VisionEncoder, feature_layer_indices

# transformers' CLIPVisionConfig defaults, for the fields a released config.json leaves out.
CLIP_VISION_DEFAULTS = {
    "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
    "num_attention_heads": 12, "image_size": 224, "patch_size": 32, "num_channels": 3,
    "layer_norm_eps": 1e-5, "hidden_act": "quick_gelu",
}  # fmt: skip
SELECT_STRATEGIES = ("default", "full")


def clip_vision_config(vision: dict[str, Any]) -> VisionConfig:
    return VisionConfig.from_hf(vision, CLIP_VISION_DEFAULTS)


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.image_size = config.image_size
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size))
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, config.patch_size, config.patch_size,
            bias=False,
        )  # fmt: skip
        self.position_embedding = nn.Embedding(config.patches_per_side**2 + 1, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # (B, C, S, S) -> (B, 1 + P, H)
        b, _, height, width = pixel_values.shape
        if height != self.image_size or width != self.image_size:
            raise ValueError(f"CLIP takes {self.image_size}px square images, got {height}x{width}")
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)  # (B, P, H)
        cls = self.class_embedding.expand(b, 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPVisionTransformer(nn.Module):
    def __init__(
        self,
        config: VisionConfig,
        feature_layers: int | list[int] = -2,
        select_strategy: str = "default",
    ):
        super().__init__()
        if select_strategy not in SELECT_STRATEGIES:
            raise ValueError(
                f"vision_feature_select_strategy {select_strategy!r} (one of {SELECT_STRATEGIES})"
            )
        self.feature_layers = feature_layer_indices(feature_layers, config.num_hidden_layers)
        self.drops_class_token = select_strategy == "default"
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = VisionEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    @property
    def feature_size(self) -> int:
        """Width of the features: the hidden size times the number of layers concatenated."""
        return self.pre_layrnorm.normalized_shape[0] * len(self.feature_layers)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(B, C, S, S) -> the selected hidden states side by side, (B, [1 +] P, feature_size)."""
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        # NOTE: layers past the deepest selected one would not change the features; not run.
        hidden_states = self.encoder(x, num_layers=max(self.feature_layers))
        selected = [hidden_states[i] for i in self.feature_layers]
        if self.drops_class_token:
            selected = [h[:, 1:] for h in selected]
        return torch.cat(selected, dim=-1)

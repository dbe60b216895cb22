"""Mistral 3's image encoder: the Pixtral vision transformer (images at their own aspect ratio, a
patch convolution, RMSNorm, 2D axial rotary positions, gated SiLU MLPs) and Mistral 3's projector
(RMSNorm, a learned merge of each 2x2 block of patches, two linears). One image's patches attend to
each other only. Its rows come out row by row, as the processor writes `[IMG]` runs between
`[IMG_BREAK]`s. Parameter names are Hugging Face's, so a checkpoint's tensors load by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workers.vision.vit import RMSNorm, activation

# PixtralVisionConfig's defaults (transformers 5), for what a released config.json leaves out.
PIXTRAL_DEFAULTS = {
    "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
    "num_attention_heads": 16, "num_channels": 3, "patch_size": 16, "hidden_act": "gelu",
    "head_dim": None, "rope_theta": 10000.0,
}  # fmt: skip


@dataclass(frozen=True)
class PixtralConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_channels: int
    patch_size: int
    hidden_act: str
    head_dim: int
    rope_theta: float

    @classmethod
    def from_hf(cls, vision: dict[str, Any]) -> PixtralConfig:
        merged = {**PIXTRAL_DEFAULTS, **vision}
        rope = merged.get("rope_parameters") or {}
        merged["rope_theta"] = rope.get("rope_theta", merged["rope_theta"])
        merged["head_dim"] = merged["head_dim"] or (
            merged["hidden_size"] // merged["num_attention_heads"]
        )
        return cls(**{name: merged[name] for name in cls.__dataclass_fields__})


def axial_rope(config: PixtralConfig, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (rows * cols, head_dim) of each patch, row-major: the even frequencies rotate by
    the patch's row, the odd ones by its column (Pixtral's axial rope), over the whole head."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    row, col = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    angles = torch.cat(
        [row.reshape(-1, 1).float() * inv_freq[0::2], col.reshape(-1, 1).float() * inv_freq[1::2]],
        dim=-1,
    )  # (P, dim / 2)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class PixtralAttention(nn.Module):
    def __init__(self, config: PixtralConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        h, inner = config.hidden_size, config.num_attention_heads * config.head_dim
        self.q_proj = nn.Linear(h, inner, bias=False)
        self.k_proj = nn.Linear(h, inner, bias=False)
        self.v_proj = nn.Linear(h, inner, bias=False)
        self.o_proj = nn.Linear(inner, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]  # (P, H): one image's patches

        def heads(t: torch.Tensor) -> torch.Tensor:  # (P, H) -> (heads, P, head_dim)
            return t.view(n, self.num_heads, -1).transpose(0, 1)

        q = _rotate(heads(self.q_proj(x)), cos, sin)
        k = _rotate(heads(self.k_proj(x)), cos, sin)
        out = F.scaled_dot_product_attention(q, k, heads(self.v_proj(x)))
        return self.o_proj(out.transpose(0, 1).reshape(n, -1))


class PixtralMLP(nn.Module):
    def __init__(self, config: PixtralConfig) -> None:
        super().__init__()
        self.act = activation(config.hidden_act)
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PixtralLayer(nn.Module):
    def __init__(self, config: PixtralConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, 1e-5)
        self.attention = PixtralAttention(config)
        self.ffn_norm = RMSNorm(config.hidden_size, 1e-5)
        self.feed_forward = PixtralMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class PixtralTransformer(nn.Module):
    """`transformer.layers.N` in the checkpoint."""

    def __init__(self, config: PixtralConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(PixtralLayer(config) for _ in range(config.num_hidden_layers))


class PixtralVisionTransformer(nn.Module):
    def __init__(self, config: PixtralConfig, feature_layer: int) -> None:
        super().__init__()
        self.config = config
        self.feature_layer = feature_layer
        self.patch_conv = nn.Conv2d(
            config.num_channels, config.hidden_size, config.patch_size, config.patch_size,
            bias=False,
        )  # fmt: skip
        self.ln_pre = RMSNorm(config.hidden_size, 1e-5)
        self.transformer = PixtralTransformer(config)

    def forward(self, pixel_values: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
        """One image (1, C, H', W'), padded beyond its `image_size` (height, width) -> the
        selected layer's patch features (rows * cols, hidden), row-major."""
        p = self.config.patch_size
        rows, cols = image_size[0] // p, image_size[1] // p
        patches = self.patch_conv(pixel_values)[0, :, :rows, :cols]  # (H, rows, cols)
        x = self.ln_pre(patches.flatten(1).T)
        cos, sin = (t.to(x.device, x.dtype) for t in axial_rope(self.config, rows, cols))
        hidden_states = [x]
        layers = self.transformer.layers
        last = self.feature_layer % (len(layers) + 1)  # Hugging Face's hidden_states index
        for layer in layers[:last]:
            hidden_states.append(layer(hidden_states[-1], cos, sin))
        return hidden_states[last]


class PatchMerger(nn.Module):
    """Each `merge` x `merge` block of patches (channels concatenated as torch's unfold orders
    them) -> one row, through `merging_layer`."""

    def __init__(self, hidden_size: int, merge: int) -> None:
        super().__init__()
        self.merge = merge
        self.merging_layer = nn.Linear(hidden_size * merge**2, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        grid = x.view(rows, cols, -1).permute(2, 0, 1).unsqueeze(0)  # (1, H, rows, cols)
        blocks = F.unfold(grid, kernel_size=self.merge, stride=self.merge)  # (1, H * m * m, N)
        return self.merging_layer(blocks[0].T)


class Mistral3MultiModalProjector(nn.Module):
    def __init__(
        self,
        vision_hidden: int,
        text_hidden: int,
        merge: int,
        eps: float,
        act: str,
        bias: bool,
    ) -> None:
        super().__init__()
        self.norm = RMSNorm(vision_hidden, eps)
        self.patch_merger = PatchMerger(vision_hidden, merge)
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.act = activation(act)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        x = self.patch_merger(self.norm(x), rows, cols)
        return self.linear_2(self.act(self.linear_1(x)))

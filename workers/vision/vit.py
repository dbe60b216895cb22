"""The transformer block CLIP's and SigLIP's vision towers share (pre-norm LayerNorm, bidirectional
multi-head attention with biases, a two-layer MLP), and the part of their config.json it reads.
Parameter names are Hugging Face's, so a checkpoint's tensors load by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


# The activations vision towers and projectors name in config.json (transformers' ACT2FN).
ACTIVATIONS = {
    "quick_gelu": quick_gelu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported vision activation {name!r} (one of {sorted(ACTIVATIONS)})")
    return ACTIVATIONS[name]


class RMSNorm(nn.Module):
    """Pixtral's and Qwen2.5-VL's: normalised in float32, scaled in the input's dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str

    @classmethod
    def from_hf(cls, vision: dict[str, Any], defaults: dict[str, Any]) -> VisionConfig:
        """`vision` (config.json's vision_config) over `defaults` (its transformers config class's
        defaults: released configs often leave them out)."""
        merged = {**defaults, **vision}
        return cls(**{name: merged[name] for name in cls.__dataclass_fields__})

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


def feature_layer_indices(feature_layers: int | list[int], num_hidden_layers: int) -> list[int]:
    """config.json's `vision_feature_layer` (one index or several, into Hugging Face's
    `hidden_states`: 0 is the encoder's input, -1 the last layer's output) -> indices >= 0."""
    num_states = num_hidden_layers + 1
    layers = [feature_layers] if isinstance(feature_layers, int) else list(feature_layers)
    if not all(-num_states <= i < num_states for i in layers):
        raise ValueError(f"vision_feature_layer {feature_layers} out of {num_states} states")
    return [i % num_states for i in layers]


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        h = config.hidden_size
        self.q_proj = nn.Linear(h, h)
        self.k_proj = nn.Linear(h, h)
        self.v_proj = nn.Linear(h, h)
        self.out_proj = nn.Linear(h, h)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, N, H) -> (B, N, H); `key_mask` (B, N), True where a patch is image (not padding):
        every patch attends to those only."""
        b, n, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # (B, N, H) -> (B, heads, N, head_dim)
            return t.view(b, n, self.num_heads, -1).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        mask = None if key_mask is None else key_mask[:, None, None, :]  # (B, 1, 1, N)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # both ways
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.act = activation(config.hidden_act)
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = VisionAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), key_mask)  # (B, N, H)
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    """The stack of layers (`encoder.layers.N` in the checkpoint)."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(
            VisionEncoderLayer(config) for _ in range(config.num_hidden_layers)
        )

    def forward(
        self,
        x: torch.Tensor,
        num_layers: int | None = None,
        key_mask: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Hidden states as Hugging Face indexes them: [input, after layer 1, ...], through the
        first `num_layers` layers (all by default: the later ones are skipped when unused);
        `key_mask` (B, N) marks the patches attention may read (None: all)."""
        hidden_states = [x]
        for layer in self.layers[:num_layers]:
            hidden_states.append(layer(hidden_states[-1], key_mask))
        return hidden_states

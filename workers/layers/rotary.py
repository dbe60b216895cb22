"""Rotary position embedding (neox style, as Hugging Face Llama), with the rope-scaling types we support.

`RopeParams.from_hf_config` reads both config.json styles: transformers-4 (`rope_theta` at top level,
optional `rope_scaling: {type|rope_type, factor, ...}`) and transformers-5 (`rope_parameters:
{rope_theta, rope_type, ...}`). Supported types: "default", "linear", "llama3"; anything else raises.
The cos/sin table is computed once in float32 for every position up to max_position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from workers.layers import native

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeParams:
    theta: float = 10000.0
    rope_type: str = "default"
    # The type's own parameters (factor, low_freq_factor, original_max_position_embeddings, ...).
    scaling: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> RopeParams:
        params = dict(hf.get("rope_parameters") or {})
        scaling = hf.get("rope_scaling") or {}
        if not params or ("rope_theta" not in params and "rope_type" not in params):
            params = {**scaling}
        theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
        params.pop("type", None)
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
            )
        partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise ValueError(f"partial_rotary_factor {partial} is not supported")
        if rope_type == "llama3":
            params.setdefault("original_max_position_embeddings", hf["max_position_embeddings"])
        return cls(theta=float(theta), rope_type=rope_type, scaling=params)


def compute_inv_freq(head_dim: int, rope: RopeParams) -> torch.Tensor:
    """Inverse frequencies (head_dim / 2,) in float32, computed as transformers does."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponent)
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.scaling["factor"]
    elif rope.rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope.scaling)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short ones kept, smooth in between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, rope: RopeParams) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = compute_inv_freq(head_dim, rope)
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # (P, D/2)
        # NOTE: float32 regardless of the model dtype (cast per use), as Hugging Face does.
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q (T, H, D) and k (T, Hkv, D) by their tokens' positions (T,)."""
        if native.usable(q, k) and _heads_contiguous(q) and _heads_contiguous(k):
            # NOTE: in place: q and k are this layer's fresh projections (views of its qkv output).
            native.rotary_neox_(q, k, positions, self.cos_cache, self.sin_cache)
            return q, k
        cos = self.cos_cache[positions].unsqueeze(1)  # (T, 1, D/2)
        sin = self.sin_cache[positions].unsqueeze(1)
        cos = torch.cat((cos, cos), dim=-1).to(q.dtype)  # (T, 1, D)
        sin = torch.cat((sin, sin), dim=-1).to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _heads_contiguous(x: torch.Tensor) -> bool:
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.size(2)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin

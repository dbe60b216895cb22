"""Rotary position embedding as Hugging Face computes it: neox style (rotate halves, Llama) or
interleaved (rotate pairs, GLM), over the whole head or its first `partial_rotary_factor` part.

`RopeParams.from_hf_config` reads both config.json styles: transformers-4 (`rope_theta` at top level,
optional `rope_scaling: {type|rope_type, factor, ...}`) and transformers-5 (`rope_parameters:
{rope_theta, rope_type, ...}`, or one such dict per layer type as Gemma 3's `{"sliding_attention":
..., "full_attention": ...}`). Types: "default", "linear", "llama3", "yarn", "longrope", "dynamic";
anything else raises. The cos/sin table is computed once in float32 for every position up to
max_position, with the type's attention factor folded in (yarn, longrope), so the kernels that read
it need not know the type. Two types differ from Hugging Face's by construction, beyond a limit:
- "longrope": positions below `original_max_position_embeddings` rotate by the short factors and
  later ones by the long factors (as vLLM does); Hugging Face switches the whole sequence to the long
  factors once it grows past that length, which a KV cache computed earlier cannot follow.
- "dynamic": Hugging Face rescales the base only for sequences longer than max_position_embeddings;
  the table stops there (tern never serves longer), so it is the default rotation exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from workers.kernels import elementwise_ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")
_NEEDS_ORIGINAL_MAX = ("llama3", "yarn", "longrope")
# M-RoPE layouts: Qwen2-VL / Qwen2.5-VL give each of (temporal, height, width) a run of consecutive
# frequencies (`mrope_section` in order); the later Qwen models (Qwen3-VL, Qwen3.5) interleave them.
# Hugging Face decides by the model class, whatever config.json says, and so does tern.
SECTIONED_MROPE_ARCHITECTURES = (
    "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
)


@dataclass(frozen=True)
class RopeParams:
    theta: float = 10000.0
    rope_type: str = "default"
    # The type's own parameters (factor, low_freq_factor, original_max_position_embeddings, ...).
    scaling: dict[str, Any] = field(default_factory=dict)
    partial_rotary_factor: float = 1.0

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], layer_type: str | None = None) -> RopeParams:
        """The rotation of config.json `hf`, for the layers of `layer_type` where the config has one
        per layer type (Gemma 3's local layers rotate by another base than its global ones)."""
        params = dict(hf.get("rope_parameters") or {})
        if layer_type is not None and isinstance(params.get(layer_type), dict):
            params = dict(params[layer_type])
        elif params and all(isinstance(v, dict) for v in params.values()):
            raise ValueError(f"rope_parameters has one entry per layer type: {sorted(params)}")
        scaling = hf.get("rope_scaling") or {}
        if not params or ("rope_theta" not in params and "rope_type" not in params):
            params = {**scaling}
        theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
        if layer_type == "sliding_attention" and "rope_local_base_freq" in hf:
            theta, params = hf["rope_local_base_freq"], {}  # transformers-4 Gemma 3: unscaled
        rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
        params.pop("type", None)
        if rope_type == "mrope":  # transformers-4 Qwen2.5-VL: the default rotation, in sections
            if "mrope_section" not in params:
                raise ValueError("rope type 'mrope' without mrope_section is not supported")
            rope_type = "default"
        if "mrope_section" in params:
            archs = hf.get("architectures") or [""]
            params["mrope_interleaved"] = archs[0] not in SECTIONED_MROPE_ARCHITECTURES
        if rope_type == "su":  # Phi-3's first name for longrope
            rope_type = "longrope"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
            )
        partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        if rope_type in _NEEDS_ORIGINAL_MAX:
            original = params.get("original_max_position_embeddings") or hf.get(
                "original_max_position_embeddings", hf["max_position_embeddings"]
            )
            params["original_max_position_embeddings"] = original
        if rope_type in ("yarn", "longrope") and params.get("factor") is None:
            params["factor"] = (
                hf["max_position_embeddings"] / params["original_max_position_embeddings"]
            )
        return cls(
            theta=float(theta), rope_type=rope_type, scaling=params,
            partial_rotary_factor=float(partial),
        )  # fmt: skip

    def rotary_dim(self, head_dim: int) -> int:
        return int(head_dim * self.partial_rotary_factor)


def compute_inv_freq(
    head_dim: int, rope: RopeParams, factors: list[float] | None = None
) -> torch.Tensor:
    """Inverse frequencies (rotary_dim / 2,) in float32, computed as transformers does; `factors`:
    longrope's short or long factors."""
    dim = rope.rotary_dim(head_dim)
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    if rope.rope_type == "longrope":
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta**exponent)
    inv_freq = 1.0 / (rope.theta**exponent)
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.scaling["factor"]
    elif rope.rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope.scaling)
    elif rope.rope_type == "yarn":
        inv_freq = _yarn_inv_freq(dim, rope)
    return inv_freq


def attention_factor(rope: RopeParams) -> float:
    """The scale of cos and sin (yarn and longrope's temperature), 1.0 for the other types."""
    s = rope.scaling
    if rope.rope_type not in ("yarn", "longrope"):
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = s["factor"]
    if rope.rope_type == "longrope":
        original = s["original_max_position_embeddings"]
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.get("mscale") and s.get("mscale_all_dim"):
        return float(mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"]))
    return mscale(factor)


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


def _yarn_inv_freq(dim: int, rope: RopeParams) -> torch.Tensor:
    """YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between."""
    s, base = rope.scaling, rope.theta
    factor, original = s["factor"], s["original_max_position_embeddings"]
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # the extrapolation's share
    return interpolation * (1 - keep) + extrapolation * keep


def _angles(head_dim: int, max_position: int, rope: RopeParams) -> torch.Tensor:
    """Rotation angles (max_position, rotary_dim / 2) in float32."""
    positions = torch.arange(max_position, dtype=torch.float32)
    if rope.rope_type != "longrope":
        return positions[:, None] * compute_inv_freq(head_dim, rope)[None, :]
    s = rope.scaling
    split = min(s["original_max_position_embeddings"], max_position)
    short = positions[:split, None] * compute_inv_freq(head_dim, rope, s["short_factor"])[None, :]
    long = positions[split:, None] * compute_inv_freq(head_dim, rope, s["long_factor"])[None, :]
    return torch.cat((short, long))


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_position: int, rope: RopeParams, interleaved: bool = False
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rope.rotary_dim(head_dim)
        self.interleaved = interleaved
        freqs = _angles(head_dim, max_position, rope)  # (P, R/2)
        scale = attention_factor(rope)
        # NOTE: float32 regardless of the model dtype (cast per use), as Hugging Face does.
        self.register_buffer("cos_cache", freqs.cos() * scale, persistent=False)
        self.register_buffer("sin_cache", freqs.sin() * scale, persistent=False)
        # M-RoPE (Qwen3.5): which of (temporal, height, width) positions turns each frequency.
        section = rope.scaling.get("mrope_section")
        self.mrope_axis = (
            None
            if section is None
            else mrope_axis(section, freqs.shape[1], rope.scaling.get("mrope_interleaved", True))
        )

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        mrope_positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q (T, H, D) and k (T, Hkv, D) by their tokens' positions (T,), or on an M-RoPE
        model by their (temporal, height, width) positions `mrope_positions` (3, T)."""
        if mrope_positions is not None:
            assert self.mrope_axis is not None, "M-RoPE positions for a rotation without sections"
            cos3, sin3 = self.cos_cache[mrope_positions], self.sin_cache[mrope_positions]
            axis = self.mrope_axis.view(1, 1, -1).expand(1, *cos3.shape[1:])
            cos = cos3.gather(0, axis)[0].unsqueeze(1)  # (T, 1, R/2)
            sin = sin3.gather(0, axis)[0].unsqueeze(1)
            return self._rotate(q, k, cos, sin)
        if elementwise_ops.usable(q, k) and _heads_contiguous(q) and _heads_contiguous(k):
            # NOTE: in place: q and k are this layer's fresh projections (views of its qkv output).
            elementwise_ops.rotary_neox_(
                q, k, positions, self.cos_cache, self.sin_cache, self.interleaved
            )
            return q, k
        cos = self.cos_cache[positions].unsqueeze(1)  # (T, 1, R/2)
        sin = self.sin_cache[positions].unsqueeze(1)
        return self._rotate(q, k, cos, sin)

    def _rotate(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.interleaved:
            cos, sin = (
                cos.repeat_interleave(2, -1).to(q.dtype),
                sin.repeat_interleave(2, -1).to(q.dtype),
            )
            rotate = _rotate_pairs
        else:
            cos, sin = (
                torch.cat((cos, cos), dim=-1).to(q.dtype),
                torch.cat((sin, sin), dim=-1).to(q.dtype),
            )
            rotate = _rotate_halves
        r = self.rotary_dim
        if r == self.head_dim:
            return rotate(q, cos, sin), rotate(k, cos, sin)
        q = torch.cat((rotate(q[..., :r], cos, sin), q[..., r:]), dim=-1)
        k = torch.cat((rotate(k[..., :r], cos, sin), k[..., r:]), dim=-1)
        return q, k


def mrope_axis(section: list[int], num_freqs: int, interleaved: bool = True) -> torch.Tensor:
    """(num_freqs,) int64, the axis (0 temporal, 1 height, 2 width) each frequency turns by.
    Interleaved (Qwen3.5's Qwen3_5TextRotaryEmbedding): frequency j goes to height if j % 3 == 1
    and j < 3 * section[1], to width if j % 3 == 2 and j < 3 * section[2], else to time. In
    sections (Qwen2.5-VL's): the first section[0] frequencies to time, the next section[1] to
    height, the next section[2] to width."""
    axis = torch.zeros(num_freqs, dtype=torch.int64)
    if not interleaved:
        if sum(section) != num_freqs:
            raise ValueError(f"mrope_section {section} does not cover {num_freqs} frequencies")
        return torch.repeat_interleave(torch.arange(3), torch.tensor(section))
    for dim in (1, 2):
        axis[dim : section[dim] * 3 : 3] = dim
    return axis


def _heads_contiguous(x: torch.Tensor) -> bool:
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.size(2)


def _rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return x * cos + torch.stack((-x2, x1), dim=-1).flatten(-2) * sin

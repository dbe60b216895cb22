"""Bindings of the elementwise kernels (csrc/elementwise.c): RMS norm, rotary embedding, the
gated activations and the sigmoid output gate, float32 or bfloat16."""

from __future__ import annotations

import torch

from workers.kernels.kernel_library import load
from workers.kernels.tensor_args import check, check_heads, elementwise_entry, float_dtype, ptr


def usable(*tensors: torch.Tensor | None) -> bool:
    """Whether the kernels are built and these (optional) tensors are CPU tensors of one dtype,
    float32 or bfloat16: what the elementwise kernels take."""
    lib = load()
    dtypes = {t.dtype for t in tensors if t is not None}
    return (
        lib is not None
        and len(dtypes) == 1
        and dtypes <= {torch.float32, torch.bfloat16}
        and all(t is None or t.is_cpu for t in tensors)
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x (T, D) float32 or bfloat16 (weight and residual alike) -> (weight * rmsnorm(x + residual),
    x + residual or None)."""
    lib = load()
    assert lib is not None, "the CPU kernels are not available"
    check(x, float_dtype(x), "x")
    check(weight, x.dtype, "weight")
    t, d = x.shape
    if weight.numel() != d:
        raise ValueError(f"rms norm: weight of {weight.numel()} for rows of {d}")
    out = torch.empty_like(x)
    res_out = None
    if residual is not None:
        check(residual, x.dtype, "residual")
        if residual.shape != x.shape:
            raise ValueError(f"rms norm: residual {tuple(residual.shape)} is not {(t, d)}")
        res_out = torch.empty_like(x)
    elementwise_entry(lib, "tern_rms_norm", x.dtype)(
        ptr(x), ptr(residual) if residual is not None else None,
        ptr(res_out) if res_out is not None else None, ptr(weight), ptr(out), t, d, eps,
    )  # fmt: skip
    return out, res_out


def rotary_neox_(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    interleaved: bool = False,
) -> None:
    """Rotate q (T, H, D) and k (T, Hkv, D), float32 or bfloat16, in place by positions (T,)
    int64: the first 2 * cos_cache.size(1) features of each head (all of them, or a partial
    rotation), neox style (halves) or `interleaved` (pairs)."""
    lib = load()
    assert lib is not None, "the CPU kernels are not available"
    check_heads(q, float_dtype(q), "q")
    check_heads(k, q.dtype, "k")
    check(positions, torch.int64, "positions")
    check(cos_cache, torch.float32, "cos_cache")
    check(sin_cache, torch.float32, "sin_cache")
    t, h, d = q.shape
    r = cos_cache.size(1) * 2
    if k.size(0) != t or k.size(2) != d or positions.numel() != t or r > d:
        raise ValueError("rotary: q, k, positions and the cos/sin tables do not agree")
    rc = elementwise_entry(lib, "tern_rotary_neox", q.dtype)(
        ptr(q), q.stride(0), ptr(k), k.stride(0), ptr(positions), cos_cache.size(0),
        ptr(cos_cache), ptr(sin_cache), t, h, k.size(1), d, r, int(interleaved),
    )  # fmt: skip
    if rc != 0:
        raise ValueError("rotary: a position is past the cos/sin table")


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x (T, 2I) float32 or bfloat16 = [gate | up] -> silu(gate) * up, (T, I)."""
    return _gated(x, "tern_silu_and_mul")


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x (T, 2I) float32 or bfloat16 = [gate | up] -> gelu(gate, tanh approximation) * up."""
    return _gated(x, "tern_gelu_tanh_and_mul")


def sigmoid_gate_(o: torch.Tensor, gate: torch.Tensor) -> None:
    """o (T, n) *= sigmoid(gate (T, n)), in place; float32 or bfloat16, rows with contiguous
    features (any row strides)."""
    lib = load()
    assert lib is not None, "the CPU kernels are not available"
    dtype = float_dtype(o)
    for t, name in ((o, "o"), (gate, "gate")):
        if t.dtype != dtype or not t.is_cpu or t.dim() != 2 or t.stride(1) != 1:
            raise ValueError(f"{name} must be (T, n) CPU {dtype} rows with contiguous features")
    if gate.shape != o.shape:
        raise ValueError(f"sigmoid gate: gate {tuple(gate.shape)} for o {tuple(o.shape)}")
    elementwise_entry(lib, "tern_sigmoid_gate", dtype)(
        ptr(o), o.stride(0), ptr(gate), gate.stride(0), o.size(0), o.size(1)
    )


def _gated(x: torch.Tensor, name: str) -> torch.Tensor:
    lib = load()
    assert lib is not None, "the CPU kernels are not available"
    check(x, float_dtype(x), "x")
    t, two_i = x.shape
    if two_i % 2:
        raise ValueError(f"{name} needs an even width, got {two_i}")
    out = torch.empty(t, two_i // 2, dtype=x.dtype)
    elementwise_entry(lib, name, x.dtype)(ptr(x), ptr(out), t, two_i // 2)
    return out

"""Float weights quantized to GGUF's K-quant types Q4_K, Q5_K and Q6_K (the `gguf` package only
dequantizes those): for weight updates into layers that keep K-quant blocks, and for test files.

The rounding is the plain one (each sub-block's scale and minimum from its own range, the
super-block's float16 scales from the largest of them, 6-bit or int8 sub-block scales rounded
to nearest, values rounded to nearest), not llama.cpp's iterative search for the scales that
minimise the error: the blocks are valid and dequantize as any K-quant does, only a little less
precise than llama-quantize's.
"""

from __future__ import annotations

import numpy as np

QK_K = 256


def _f16(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the float16 bytes, their value as float32)."""
    h = v.astype(np.float16)
    return h.view(np.uint8).reshape(v.shape[0], 2), h.astype(np.float32)


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b > 0, a / np.where(b > 0, b, 1), 0)


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and minimums per super-block -> ggml's 12 packed bytes."""
    lo = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    mid = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    hi = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return np.concatenate([lo, mid, hi], axis=1).astype(np.uint8)


def _quantize_k_min(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Q4_K / Q5_K: x (n, 8, 32) -> (d bytes, dmin bytes, packed scales, q (n, 8, 32) uint8)."""
    lo = np.minimum(x.min(axis=-1), 0)
    scale = (x.max(axis=-1) - lo) / levels
    d_bytes, d = _f16(scale.max(axis=-1) / 63)
    dmin_bytes, dmin = _f16(-lo.min(axis=-1) / 63)
    sc = np.clip(np.rint(_ratio(scale, d[:, None])), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_ratio(-lo, dmin[:, None])), 0, 63).astype(np.uint8)
    dsub = (d[:, None] * sc.astype(np.float32))[..., None]
    msub = (dmin[:, None] * mn.astype(np.float32))[..., None]
    q = np.clip(np.rint(_ratio(x + msub, np.broadcast_to(dsub, x.shape))), 0, levels)
    return d_bytes, dmin_bytes, _pack_scales(sc, mn), q.astype(np.uint8)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """(n, 8, 32) values -> (n, 128) bytes: sub-block 2g in the low nibbles of bytes 32g.., 2g+1
    in their high nibbles."""
    q = q.reshape(q.shape[0], 4, 2, 32) & 0x0F
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(q.shape[0], 128)


def quantize_k(weight: np.ndarray, block_type: str) -> np.ndarray:
    """(N, K) float weight, K a multiple of 256 -> (N, K / 256 * block bytes) uint8 blocks."""
    rows, cols = weight.shape
    if cols % QK_K:
        raise ValueError(f"{cols} values do not split into {block_type} blocks of {QK_K}")
    x = np.ascontiguousarray(weight, dtype=np.float32).reshape(-1, QK_K)
    n = x.shape[0]
    if block_type in ("Q4_K", "Q5_K"):
        levels = 15 if block_type == "Q4_K" else 31
        d, dmin, scales, q = _quantize_k_min(x.reshape(n, 8, 32), levels)
        parts = [d, dmin, scales]
        if block_type == "Q5_K":
            bits = ((q >> 4) & 1) << np.arange(8, dtype=np.uint8)[None, :, None]
            parts.append(bits.sum(axis=1, dtype=np.uint8))
        parts.append(_nibbles(q))
    elif block_type == "Q6_K":
        x16 = x.reshape(n, 16, 16)
        scale = np.abs(x16).max(axis=-1) / 31
        d_bytes, d = _f16(scale.max(axis=-1) / 127)
        sc = np.clip(np.rint(_ratio(scale, d[:, None])), 0, 127).astype(np.int8)
        dsub = (d[:, None] * sc.astype(np.float32))[..., None]
        q = np.clip(np.rint(_ratio(x16, np.broadcast_to(dsub, x16.shape))), -32, 31) + 32
        q = q.astype(np.uint8).reshape(n, 2, 4, 32)  # [half, quarter, value]
        ql = (q[:, :, :2] & 0x0F) | ((q[:, :, 2:] & 0x0F) << 4)
        qh = (((q >> 4) & 3) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(
            axis=2, dtype=np.uint8
        )
        parts = [ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), d_bytes]
    else:
        raise ValueError(f"{block_type} is not a K-quant type")
    return np.concatenate(parts, axis=1).reshape(rows, -1)

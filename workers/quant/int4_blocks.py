"""tern's INT4_ZP blocks: 32 int4 values q with a float32 scale d and a zero point z, each value
d * (q - z). What GPTQ and AWQ checkpoints hold per group of input features (a group of 128 is four
blocks with the same d and z), and what `--quantization int4` makes of a float checkpoint; the
same kernels multiply them as GGUF's blocks (csrc/linear_gguf.c).

A block is 21 bytes: d (float32, little-endian), z (uint8), then 16 bytes of nibbles: values 0-15
in the low nibbles, 16-31 in the high ones (GGUF's Q4_0 order).
"""

from __future__ import annotations

import numpy as np

BLOCK = 32
BYTES = 21


def pack(q: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
    """q (N, K) integers 0-15, scale and zero (N, K / 32) per block -> (N, K / 32 * 21) uint8."""
    n, k = q.shape
    nb = k // BLOCK
    q = q.astype(np.uint8).reshape(n, nb, BLOCK)
    out = np.empty((n, nb, BYTES), dtype=np.uint8)
    out[..., :4] = np.ascontiguousarray(scale, dtype="<f4").reshape(n, nb, 1).view(np.uint8)
    out[..., 4] = zero
    out[..., 5:] = (q[..., :16] & 0x0F) | ((q[..., 16:] & 0x0F) << 4)
    return out.reshape(n, nb * BYTES)


def from_groups(q: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
    """q (N, K), scale and zero (N, K / G) per group of G input features (a multiple of 32) ->
    blocks: each group's scale and zero repeated over its blocks."""
    per_group = q.shape[1] // scale.shape[1] // BLOCK
    if per_group * BLOCK * scale.shape[1] != q.shape[1]:
        raise ValueError(f"groups of {q.shape[1] // scale.shape[1]} do not split into {BLOCK}s")
    return pack(q, np.repeat(scale, per_group, axis=1), np.repeat(zero, per_group, axis=1))


def quantize(weight: np.ndarray) -> np.ndarray:
    """(N, K) float -> blocks, each block's range [min, max] over the 16 levels (asymmetric)."""
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"{k} input features do not split into {BLOCK}-value blocks")
    x = np.asarray(weight, dtype=np.float32).reshape(n, k // BLOCK, BLOCK)
    lo = np.minimum(x.min(axis=-1), 0)
    hi = np.maximum(x.max(axis=-1), 0)
    d = ((hi - lo) / 15).astype(np.float32)
    safe = np.where(d > 0, d, 1)
    zero = np.clip(np.rint(-lo / safe), 0, 15)
    q = np.clip(np.rint(x / safe[..., None]) + zero[..., None], 0, 15)
    return pack(q.reshape(n, k), d, zero.astype(np.uint8))


def dequantize(blocks: np.ndarray, cols: int) -> np.ndarray:
    """(N, K / 32 * 21) uint8 -> the (N, K) float32 weight, d * (q - z) in float32."""
    n = blocks.shape[0]
    b = np.ascontiguousarray(blocks).reshape(n, cols // BLOCK, BYTES)
    d = np.ascontiguousarray(b[..., :4]).view("<f4")  # (n, nb, 1)
    z = b[..., 4:5].astype(np.int16)
    nib = b[..., 5:]
    q = np.concatenate([nib & 0x0F, nib >> 4], axis=-1).astype(np.int16)
    return (d * (q - z).astype(np.float32)).reshape(n, cols)

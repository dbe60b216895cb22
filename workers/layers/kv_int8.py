"""An int8 KV cache (--kv-cache-dtype int8): each token's key (or value) row of one head stored as
its D values in int8 and a float32 scale (the row's largest |value| / 127), one uint8 row of D + 4
bytes: (num_blocks, block_size, Hkv, D + 4), so blocks, slots and the prefix cache work as for a
float cache. Written by every step that computes K and V (prefill chunks and decode), read back
as values * scale in the activations' dtype. About half of bfloat16's bytes per token at D = 128
(132 / 256), a quarter of float32's.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4


def row_bytes(head_dim: int) -> int:
    """Bytes of one head's row in the cache."""
    if head_dim % 4:
        raise ValueError(f"an int8 KV cache needs head_dim a multiple of 4, not {head_dim}")
    return head_dim + SCALE_BYTES


def split(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views (values (..., D) int8, scales (...) float32) of uint8 cache rows (..., D + 4)."""
    values = rows[..., :-SCALE_BYTES].view(torch.int8)
    scales = rows[..., -SCALE_BYTES:].view(torch.float32).squeeze(-1)
    return values, scales


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., D) float -> (int8 values, float32 scales): symmetric, per row."""
    x = x.float()
    scale = x.abs().amax(-1) / 127
    q = torch.round(x / torch.where(scale > 0, scale, 1).unsqueeze(-1)).clamp_(-127, 127)
    return q.to(torch.int8), scale


def write(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Rows x (T, Hkv, D) into cache slots `slots` (T,) of cache (num_blocks, block_size, Hkv,
    D + 4)."""
    values, scales = split(cache.flatten(0, 1))
    q, s = quantize(x)
    values.index_copy_(0, slots, q)
    scales.index_copy_(0, slots, s)


def read(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 cache rows (..., D + 4) -> their values (..., D) in `dtype`."""
    values, scales = split(rows)
    return (values.float() * scales.unsqueeze(-1)).to(dtype)

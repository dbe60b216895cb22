"""Bindings of the sampler's kernels (csrc/elementwise.c): the grammar bitmask and the
exponential-race uniforms. Each returns False / None when the kernels are not built, and the
caller takes its torch path."""

from __future__ import annotations

import torch

from workers.kernels.kernel_library import load
from workers.kernels.tensor_args import check, ptr


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> bool:
    """logits[rows[i]] = -inf where bitmask[i] (xgrammar's packed int32 words) has a clear bit,
    in place. False when the kernels are not available (the caller falls back)."""
    lib = load()
    if lib is None:
        return False
    check(logits, torch.float32, "logits")
    check(bitmask, torch.int32, "bitmask")
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.size(0) != len(rows):
        raise ValueError(f"bitmask {tuple(bitmask.shape)} does not fit {len(rows)} rows of logits")
    if bitmask.size(1) * 32 < logits.size(1) or not all(0 <= r < logits.size(0) for r in rows):
        raise ValueError("the bitmask is narrower than the logits, or a row is out of range")
    index = torch.tensor(rows, dtype=torch.int64)
    lib.tern_apply_token_bitmask(
        ptr(logits), logits.size(1), ptr(bitmask), bitmask.size(1), ptr(index), len(rows),
        logits.size(1),
    )  # fmt: skip
    return True


def exponential_uniforms(row_keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor | None:
    """The sampler's uniforms (N, K) float32 for row keys (N,) and token ids (K,) or (N, K), int64
    below 2^32 (sampler.exponential_noise's hash); None when the kernels are not available."""
    lib = load()
    if lib is None or not row_keys.is_cpu or not token_ids.is_cpu:
        return None
    row_keys, token_ids = row_keys.contiguous(), token_ids.contiguous()
    check(row_keys, torch.int64, "row_keys")
    check(token_ids, torch.int64, "token_ids")
    n, k = row_keys.numel(), token_ids.size(-1)
    per_row = token_ids.dim() == 2
    if token_ids.dim() not in (1, 2) or (per_row and token_ids.size(0) != n):
        raise ValueError(f"token ids {tuple(token_ids.shape)} do not fit {n} row keys")
    out = torch.empty(n, k, dtype=torch.float32)
    lib.tern_exponential_uniforms(ptr(row_keys), n, ptr(token_ids), k, int(per_row), ptr(out))
    return out

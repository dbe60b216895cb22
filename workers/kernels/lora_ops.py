"""Binding of the batched LoRA add (csrc/lora.c): each row's adapter product added in place."""

from __future__ import annotations

import torch

from workers.kernels.kernel_library import load
from workers.kernels.tensor_args import check, float_dtype, ptr


def lora_add_ready() -> bool:
    """Whether `lora_add` can run: the kernels are built and loaded."""
    return load() is not None


def lora_add(
    x: torch.Tensor,
    y: torch.Tensor,
    slots: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    rank: int,
    seg_rows: torch.Tensor,
) -> None:
    """y (M, N) += each row's LoRA adapter's product with x (M, K), in place (lora.py's
    LoraStack): row t on slot s = slots[t] (-1: nothing added) gets, in each projection's block
    of columns, b[s] @ (a[s] @ x[t]) restricted to that projection's rank rows, in float32.

    x and y float32, or bfloat16 (x widened, each y value rounded once), rows with contiguous
    features (any row stride); slots (M,) int32; a (S, nseg * rank, K) and b (S, N, rank) float32
    contiguous; seg_rows (nseg,) int32, the projections' rows, summing to N."""
    lib = load()
    assert lib is not None, "the CPU kernels are not available"
    dtype = float_dtype(x)
    for t, name in ((x, "x"), (y, "y")):
        if t.dtype != dtype or not t.is_cpu or t.dim() != 2 or t.stride(1) != 1:
            raise ValueError(f"{name} must be (M, n) CPU {dtype} rows with contiguous features")
    check(slots, torch.int32, "slots")
    check(a, torch.float32, "a")
    check(b, torch.float32, "b")
    check(seg_rows, torch.int32, "seg_rows")
    (m, k), n, nseg = x.shape, y.size(1), seg_rows.numel()
    if (
        rank < 1
        or y.size(0) != m
        or slots.numel() != m
        or a.dim() != 3
        or a.shape[1:] != (nseg * rank, k)
        or tuple(b.shape) != (a.size(0), n, rank)
    ):
        raise ValueError(
            f"lora add: x {tuple(x.shape)}, y {tuple(y.shape)}, {slots.numel()} slots, "
            f"A {tuple(a.shape)}, B {tuple(b.shape)} of rank {rank} in {nseg} segments disagree"
        )
    rc = lib.tern_lora_add(
        ptr(x), x.stride(0), ptr(y), y.stride(0), ptr(slots), m, k, n, ptr(a), ptr(b),
        a.size(0), rank, nseg, ptr(seg_rows), int(dtype == torch.bfloat16),
    )  # fmt: skip
    if rc == -1:
        raise ValueError(
            f"lora add: a slot outside [-1, {a.size(0)}), segments {seg_rows.tolist()} that do "
            f"not sum to {n} rows, or rows that overlap"
        )
    if rc != 0:
        raise MemoryError("lora add: no memory for the scratch rows")

"""How the kernel bindings (workers/kernels/*_ops.py) check and pass tensors: contiguous CPU
tensors of the expected dtype become raw pointers; anything else raises ValueError rather than
pass the C code a bad pointer."""

from __future__ import annotations

import ctypes
from typing import Any

import torch


def elementwise_entry(lib: ctypes.CDLL, name: str, dtype: torch.dtype) -> Any:
    """The float32 or bfloat16 variant of an elementwise kernel."""
    return getattr(lib, name if dtype == torch.float32 else name + "_bf16")


def ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def check(t: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    # NOTE: is_cpu, not device.type: this runs several times per layer and device.type costs ~1 us.
    if t.dtype != dtype or not t.is_cpu or not t.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous CPU {dtype} tensor, got {t.dtype} {t.device}"
        )


def float_dtype(x: torch.Tensor) -> torch.dtype:
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"expected a float32 or bfloat16 tensor, got {x.dtype}")
    return x.dtype


def check_heads(x: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    if x.dtype != dtype or not x.is_cpu or x.dim() != 3:
        raise ValueError(f"{name} must be a (T, heads, D) CPU {dtype} tensor")
    if x.stride(2) != 1 or x.stride(1) != x.size(2):
        raise ValueError(f"{name} needs contiguous heads")

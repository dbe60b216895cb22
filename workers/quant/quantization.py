"""Weight-only int8 quantization (--quantization int8): int8 weights, one float32 scale per row.

Weights are quantized when they are loaded: the weight loaders receive full-precision checkpoint
tensors exactly as without quantization, keep this rank's shard, and store it here row by row
(`store_rows`), so start-up, tensor-parallel sharding and every weight-update path share one loop.
Scales are symmetric per output row: scale = max|w| / 127, q = round(w / scale).

Storage: one int8 parameter per weight, (S + N, K) for an (N, K) weight, whose first S =
ceil(4N / K) rows hold the N float32 scales' bytes and whose last N rows hold the int8 weight.
NOTE: weight and scales share a parameter on purpose: whatever treats parameters generically
(the rollback snapshot of a weight update, sleep and wake-up) keeps them together.

Matmul backends (`int8_backend`): tern's native kernel (linear_ops.py) on CPUs with it, torch's
`_weight_int8pack_mm` on AVX-512 CPUs without it, else dequantize-then-matmul; batches of at least
`DEQUANT_MIN_ROWS` rows always dequantize and use the float GEMM, which wins at that size.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from workers.kernels import kernel_library, linear_ops

QUANTIZATIONS = ("int8",)
# From scripts/bench_quant.py --kernels on a 2-core AVX2 EPYC: up to 128 rows the native int8
# kernel beats float32 GEMM; from about 256 rows, dequantizing once and calling BLAS wins.
DEQUANT_MIN_ROWS = 256


def check_quantization(name: str | None) -> None:
    if name is not None and name not in QUANTIZATIONS:
        raise ValueError(f"unsupported quantization {name!r} (supported: {QUANTIZATIONS})")


def packed_shape(rows: int, cols: int) -> tuple[int, int]:
    """Shape of the int8 parameter that stores an (rows, cols) weight and its rows' scales."""
    return -(-4 * rows // cols) + rows, cols


def new_packed_weight(rows: int, cols: int) -> nn.Parameter:
    return nn.Parameter(
        torch.zeros(packed_shape(rows, cols), dtype=torch.int8), requires_grad=False
    )


def unpack(packed: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views (weight (rows, K) int8, scale (rows,) float32) of a packed parameter."""
    num_scale_rows = packed.size(0) - rows
    # The scales come first, so their float32 view starts at the (aligned) start of the storage.
    scale = packed[:num_scale_rows].view(-1)[: 4 * rows].view(torch.float32)
    return packed[num_scale_rows:], scale


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> (int8 (N, K), float32 scale (N,)) with symmetric per-row scales."""
    w = w.float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero rows stay zero
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def store_rows(packed: torch.Tensor, rows: int, offset: int, src: torch.Tensor) -> None:
    """Quantize full-precision rows `src` (n, K) into rows [offset, offset + n) of a packed weight."""
    weight, scale = unpack(packed, rows)
    n = src.size(0)
    if src.dim() != 2 or src.size(1) != weight.size(1) or not 0 <= offset <= offset + n <= rows:
        raise ValueError(
            f"weight shape mismatch: rows [{offset}, {offset + n}) of {tuple(src.shape)} do not fit "
            f"a ({rows}, {weight.size(1)}) weight"
        )
    q, s = quantize_rows(src.to(packed.device))
    weight[offset : offset + n].copy_(q)
    scale[offset : offset + n].copy_(s)


def dequantize(packed: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    weight, scale = unpack(packed, rows)
    return (weight.to(torch.float32) * scale[:, None]).to(dtype)


@functools.cache
def _cpu_has_avx512() -> bool:
    try:
        return "avx512f" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def int8_backend(x: torch.Tensor) -> str:
    """ "native", "torch" (aten._weight_int8pack_mm) or "dequant" for small batches of x's device."""
    if not x.is_cpu:
        return "dequant"
    if kernel_library.load() is not None:
        return "native"
    return "torch" if _cpu_has_avx512() else "dequant"


def int8_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    backend: str,
) -> torch.Tensor:
    """x (..., K) @ (weight (N, K) int8 * scale (N,)).T + bias -> (..., N) in x's dtype."""
    if backend == "dequant" or x.numel() >= DEQUANT_MIN_ROWS * x.size(-1):
        if backend == "native":
            w = linear_ops.int8_dequantize(weight, scale).to(x.dtype)
        else:
            w = (weight.to(torch.float32) * scale[:, None]).to(x.dtype)
        return F.linear(x, w, bias)
    is_plain = (
        x.dim() == 2
        and x.dtype in (torch.float32, torch.bfloat16)
        and x.is_contiguous()
        and (bias is None or bias.dtype == x.dtype)
    )
    if backend == "native" and is_plain:
        return linear_ops.int8_linear(x, weight, scale, bias)  # the decode hot path: no copies
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.size(-1))
    if backend == "native":
        b = bias.float().contiguous() if bias is not None else None
        y = linear_ops.int8_linear(x2.float().contiguous(), weight, scale, b)
    elif backend == "torch":
        y = torch.ops.aten._weight_int8pack_mm(x2.float().contiguous(), weight, scale)
        if bias is not None:
            y = y + bias.float()
    else:
        raise ValueError(f"unknown int8 backend {backend!r}")
    return y.to(x.dtype).view(*lead, -1)


class PackedInt8:
    """The (weight, scale) views of a packed parameter, recomputed when its storage changes
    (a wake-up after sleep replaces parameter data)."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self._key: tuple[int, int] | None = None
        self._views: tuple[torch.Tensor, torch.Tensor] | None = None

    def views(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = (packed.data_ptr(), packed.numel())
        if key != self._key or self._views is None:
            self._views, self._key = unpack(packed, self.rows), key
        return self._views

"""RMSNorm as Hugging Face computes it, with the residual add optionally fused in.

Llama's form normalises in float32, casts back, then multiplies by the weight, exactly as
`LlamaRMSNorm`, so fp32 runs match Hugging Face and bf16 runs round the same way. Others multiply in
float32 before the cast (`weight_in_float32`: OLMo 2, Gemma), by (1 + weight) for Gemma (`offset` 1). Float32 rows on
the CPU go to tern's kernel (one call for the add and the norm, same order of operations), which for
float32 is the same arithmetic in both forms. `ShardedRMSNorm` normalises a tensor-parallel shard of
a vector over the whole vector (OLMo 2's q and k norms span every head).
"""

from __future__ import annotations

import torch
from torch import nn

from workers.distributed import ParallelContext
from workers.kernels import elementwise_ops
from workers.layers.linear import copy_checked, default_weight_loader


class RMSNorm(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        offset: float = 0.0,
        weight_in_float32: bool = False,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight_in_float32 = weight_in_float32 or offset != 0.0
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        self._kernel_weight: torch.Tensor | None = None

    @property
    def is_plain(self) -> bool:
        """Llama's form (the weight multiplies after the cast back)."""
        return not self.weight_in_float32

    def kernel_weight(self) -> torch.Tensor:
        """What tern's kernel multiplies by: the weight (Llama's form), else (weight + offset) in
        float32, derived once per change of the weights (`repack_weights`)."""
        if self.is_plain:
            return self.weight
        if self._kernel_weight is None:
            self._kernel_weight = self.weight.float() + self.offset
        return self._kernel_weight

    def repack_weights(self) -> None:
        self._kernel_weight = None

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_in_float32:
            return (x * (self.weight.float() + self.offset)).to(dtype)
        return self.weight * x.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or with a residual: (norm(x + residual), x + residual)."""
        kernel_ok = self.is_plain or x.dtype == torch.float32
        if (
            kernel_ok
            and elementwise_ops.usable(x, residual)
            and x.dim() == 2
            and _contiguous(x, residual)
        ):
            out, summed = elementwise_ops.rms_norm(x, self.kernel_weight(), self.eps, residual)
            return out if residual is None else (out, summed)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a vector of `full_size` of which this rank holds [start, start + size)."""

    def __init__(
        self, full_size: int, shard: tuple[int, int], eps: float, ctx: ParallelContext
    ) -> None:
        super().__init__()
        self.eps, self.full_size, self.shard, self.ctx = eps, full_size, shard, ctx
        self.weight = nn.Parameter(torch.ones(shard[1]), requires_grad=False)
        self.weight.weight_loader = self._load

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is not None or loaded.shape[0] != self.full_size:
            raise ValueError(
                f"expected a norm weight of {self.full_size}, got {tuple(loaded.shape)}"
            )
        copy_checked(param.data, loaded.narrow(0, *self.shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, size) -> (T, size)
        if (
            self.ctx.tp_size == 1
            and x.dtype == torch.float32
            and elementwise_ops.usable(x, None)
            and x.dim() == 2
        ):  # the whole vector here, in float32: RMSNorm's arithmetic, in tern's kernel
            return elementwise_ops.rms_norm(x.contiguous(), self.weight.float(), self.eps)[0]
        dtype = x.dtype
        x = x.to(torch.float32)
        square_sum = x.pow(2).sum(-1, keepdim=True)
        if self.ctx.tp_size > 1:
            square_sum = self.ctx.all_reduce(square_sum)
        x = x * torch.rsqrt(square_sum / self.full_size + self.eps)
        return (self.weight.float() * x).to(dtype)


def _contiguous(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or t.is_contiguous() for t in tensors)

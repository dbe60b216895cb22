"""Tensor-parallel linear layers; each shards its weight when built and loads its own shard.

Column-parallel layers split the output features across ranks (no communication in forward);
row-parallel layers split the input features and all-reduce the partial sums in forward. Every
parameter carries `weight_loader(param, loaded_weight, shard_id=None)`, which takes the full
Hugging Face tensor and copies in this rank's slice, so loading is one loop over checkpoint tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.distributed import ParallelContext, divide


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy a (sliced) checkpoint tensor into a parameter, refusing shape mismatches."""
    if dst.shape != src.shape:
        raise ValueError(
            f"weight shape mismatch: expected {tuple(dst.shape)}, got {tuple(src.shape)}"
        )
    dst.copy_(src)


def default_weight_loader(
    param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
) -> None:
    """Loader of unsharded parameters (norms): the checkpoint tensor is copied whole."""
    if shard_id is not None:
        raise ValueError(f"unexpected shard {shard_id!r} for an unsharded parameter")
    copy_checked(param.data, loaded_weight)


class LinearBase(nn.Module):
    """A linear layer whose weight is (output_size, input_size) on this rank."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        tp_dim: int | None,
        ctx: ParallelContext,
    ) -> None:
        super().__init__()
        self.ctx = ctx
        self.tp_dim = tp_dim
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        raise NotImplementedError

    def _narrow_shard(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full checkpoint tensor along the sharded dimension."""
        size = param.data.size(self.tp_dim)
        if loaded_weight.size(self.tp_dim) != size * self.ctx.tp_size:
            raise ValueError(
                f"weight shape mismatch: {tuple(loaded_weight.shape)} does not shard into "
                f"{tuple(param.shape)} x {self.ctx.tp_size} along dim {self.tp_dim}"
            )
        return loaded_weight.narrow(self.tp_dim, self.ctx.tp_rank * size, size)


class ReplicatedLinear(LinearBase):
    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, *, ctx: ParallelContext
    ) -> None:
        super().__init__(input_size, output_size, bias, None, ctx)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        default_weight_loader(param, loaded_weight, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; forward returns this rank's slice of the output."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, *, ctx: ParallelContext
    ) -> None:
        super().__init__(input_size, divide(output_size, ctx.tp_size), bias, 0, ctx)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if shard_id is not None:
            raise ValueError(f"unexpected shard {shard_id!r} for {type(self).__name__}")
        copy_checked(param.data, self._narrow_shard(param, loaded_weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matrix (gate_up_proj).

    Shard `i` of the checkpoint occupies rows [sum(sizes[:i]), sum(sizes[:i+1])) / tp_size of this
    rank's weight, so each rank holds its slice of every projection, contiguous per projection.
    """

    def __init__(
        self, input_size: int, output_sizes: list[int], bias: bool = False, *, ctx: ParallelContext
    ) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, ctx=ctx)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(
                f"{type(self).__name__} needs a shard id in 0..{len(self.output_sizes)}"
            )
        tp = self.ctx.tp_size
        offset = sum(self.output_sizes[:shard_id]) // tp
        size = self.output_sizes[shard_id] // tp
        dst = param.data.narrow(0, offset, size)
        if loaded_weight.size(0) != size * tp:
            raise ValueError(
                f"weight shape mismatch: shard {shard_id} has {loaded_weight.size(0)} rows, "
                f"expected {size * tp}"
            )
        copy_checked(dst, loaded_weight.narrow(0, self.ctx.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matrix, split by heads across ranks.

    With fewer KV heads than ranks, each KV head is replicated on tp_size / num_kv_heads ranks.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        *,
        ctx: ParallelContext,
    ) -> None:
        tp = ctx.tp_size
        self.head_dim = head_dim
        self.num_heads = divide(total_num_heads, tp)
        if tp >= total_num_kv_heads:
            divide(tp, total_num_kv_heads)
            self.num_kv_heads = 1
            self.kv_head_index = ctx.tp_rank // (tp // total_num_kv_heads)
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp)
            self.kv_head_index = ctx.tp_rank * self.num_kv_heads
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        output_size = (self.q_size + 2 * self.kv_size) * tp  # ColumnParallelLinear divides by tp
        super().__init__(hidden_size, output_size, bias, ctx=ctx)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.ctx.tp_rank * self.q_size
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, start = self.kv_size, self.kv_head_index * self.head_dim
        else:
            raise ValueError(f"QKVParallelLinear needs shard id 'q', 'k' or 'v', not {shard_id!r}")
        if start + size > loaded_weight.size(0):
            raise ValueError(
                f"weight shape mismatch: {shard_id} projection has {loaded_weight.size(0)} rows"
            )
        copy_checked(param.data.narrow(0, offset, size), loaded_weight.narrow(0, start, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; forward all-reduces the partial products."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, *, ctx: ParallelContext
    ) -> None:
        super().__init__(divide(input_size, ctx.tp_size), output_size, bias, 1, ctx)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if shard_id is not None:
            raise ValueError(f"unexpected shard {shard_id!r} for {type(self).__name__}")
        if param.dim() == 1:  # the bias is not sharded: rank 0 adds it once
            copy_checked(param.data, loaded_weight)
        else:
            copy_checked(param.data, self._narrow_shard(param, loaded_weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.ctx.tp_rank == 0 else None
        y = F.linear(x, self.weight, bias)
        return self.ctx.all_reduce(y)

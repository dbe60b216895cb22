"""Tensor-parallel linear layers; each shards its weight when built and loads its own shard.

Column-parallel layers split the output features across ranks (no communication in forward);
row-parallel layers split the input features and all-reduce the partial sums in forward. Every
parameter carries `weight_loader(param, loaded_weight, shard_id=None)`, which takes the full
Hugging Face tensor and copies in this rank's slice, so loading is one loop over checkpoint tensors.
`loaded_weight` may also be a lazy checkpoint slice (weight_loader.LazyWeight): loaders only call
`shape`, `size` and `narrow` on it before `copy_checked`, so a rank reads only its shard from disk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.distributed import ParallelContext, divide, shard_heads


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy a (sliced) checkpoint tensor into a parameter, refusing shape mismatches."""
    if not isinstance(src, torch.Tensor):  # a lazy checkpoint slice: read it now
        src = src.materialize()
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
        # This rank's slice [shard_start, shard_start + local size) of the full tp_dim; subclasses
        # with uneven shards overwrite it.
        local = output_size if tp_dim == 0 else input_size
        self.shard_start = ctx.tp_rank * local
        self.full_size = local * ctx.tp_size
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
        if loaded_weight.size(self.tp_dim) != self.full_size:
            raise ValueError(
                f"weight shape mismatch: {tuple(loaded_weight.shape)} does not shard into "
                f"{tuple(param.shape)} x {self.ctx.tp_size} along dim {self.tp_dim}"
            )
        return loaded_weight.narrow(self.tp_dim, self.shard_start, size)


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
    """q, k and v projections in one matrix, split by heads across ranks (see `shard_heads`).

    Each rank holds whole KV groups, possibly unevenly (9 heads / 3 KV heads at tp 2: 6 + 3); with
    fewer KV heads than ranks, each KV head is replicated on tp_size / num_kv_heads ranks.
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
        shard = shard_heads(total_num_heads, total_num_kv_heads, ctx.tp_size, ctx.tp_rank)
        self.head_dim = head_dim
        self.head_start = shard.head_start
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.kv_head_index = shard.kv_head_start
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        # NOTE: skips ColumnParallelLinear's even split: this rank's rows are q + k + v of its heads.
        LinearBase.__init__(self, hidden_size, self.q_size + 2 * self.kv_size, bias, 0, ctx)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.head_start * self.head_dim
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
    """Input features split across ranks; forward all-reduces the partial products.

    `input_shard` = (start, size) gives this rank's input features when they are not an even split
    (o_proj after uneven attention heads); by default each rank takes input_size / tp_size.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        *,
        ctx: ParallelContext,
        input_shard: tuple[int, int] | None = None,
    ) -> None:
        if input_shard is None:
            input_shard = (ctx.tp_rank * divide(input_size, ctx.tp_size), input_size // ctx.tp_size)
        start, size = input_shard
        if not (0 <= start and size > 0 and start + size <= input_size):
            raise ValueError(f"input shard {input_shard} outside {input_size} input features")
        super().__init__(size, output_size, bias, 1, ctx)
        self.shard_start, self.full_size = start, input_size

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

"""Tensor/pipeline parallel context handed to every layer at construction.

A `ParallelContext` names this rank's place in the tensor-parallel (and, later, pipeline-parallel)
group and wraps the two collectives the layers need. At size 1 both collectives are no-ops, so the
single-process path never touches torch.distributed. This module does not start processes or
create process groups: whoever starts the workers does that and builds the context from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelContext:
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: Any = None  # a torch.distributed ProcessGroup when tp_size > 1
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside tp_size {self.tp_size}")
        if not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"pp_rank {self.pp_rank} outside pp_size {self.pp_size}")
        if self.tp_size > 1 and self.tp_group is None:
            raise ValueError("tp_size > 1 needs a tensor-parallel process group")

    @classmethod
    def single(cls) -> ParallelContext:
        """The context of an unsharded model in one process."""
        return cls()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the tensor-parallel group, in place."""
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim`, in rank order."""
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=dim)


def divide(numerator: int, denominator: int) -> int:
    """Exact integer division; a sharding that does not divide evenly is a configuration error."""
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator

"""The process group an RL trainer and the tern workers share to broadcast new weights.

Both sides call `init_weights_update_group` with the same address, world size and group name: the
trainer as rank 0 (it hosts the TCP store), tern's workers as rank_offset + their rank. The rendezvous
is the one SGLang-style trainers use: a TCP store at master_address:master_port, wrapped in
PrefixStore(group_name), then a new process group built on it. A trainer that instead calls
torch.distributed.init_process_group rendezvouses on other store keys and both sides wait out the
timeout, so trainers must use this function (or the same recipe).

The group is independent of the workers' own TP/PP world (a process may hold both). This module
imports no tern code, so a trainer can import it without starting a server.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    Backend,
    PrefixStore,
    _new_process_group_helper,
    _world,
    rendezvous,
)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(name: str) -> torch.dtype:
    """'bfloat16' or 'torch.bfloat16' -> torch.bfloat16; only floating types carry weights."""
    dtype = _DTYPES.get(name.removeprefix("torch."))
    if dtype is None:
        raise ValueError(f"unsupported weight dtype {name!r}: use one of {sorted(_DTYPES)}")
    return dtype


def init_weights_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str | None = None,
    timeout_s: float = 600.0,
) -> dist.ProcessGroup:
    """Joins (rank 0: creates) the weight-update group; blocks until all world_size ranks joined."""
    if not group_name:
        raise ValueError("group_name must not be empty")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside the group of {world_size}")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    timeout = timedelta(seconds=timeout_s)
    url = f"tcp://{master_address}:{master_port}"
    store, rank, world_size = next(rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=group_name, timeout=timeout
    )
    # Lets torch.distributed's collectives take this group with group ranks == ranks.
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_weights_update_group(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)


def flattened_bucket(tensors: list[torch.Tensor]) -> torch.Tensor:
    """SGLang's "flattened_bucket" layout of a bucket: the tensors flattened and concatenated, in the
    dtype torch.cat promotes them to. The trainer broadcasts this one tensor."""
    return torch.cat([t.reshape(-1) for t in tensors])


def receive_flattened(
    names: list[str],
    dtypes: list[torch.dtype],
    shapes: list[list[int]],
    group: dist.ProcessGroup,
    device: torch.device,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Receives one flattened bucket and yields its tensors, each in its own dtype and shape."""
    numels = [math.prod(shape) for shape in shapes]
    flat = torch.empty(
        sum(numels), dtype=functools.reduce(torch.promote_types, dtypes), device=device
    )
    dist.broadcast(flat, src=0, group=group)
    offset = 0
    for name, dtype, shape, numel in zip(names, dtypes, shapes, numels):
        yield name, flat[offset : offset + numel].view(shape).to(dtype)
        offset += numel

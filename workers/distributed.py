"""Tensor/pipeline parallel context handed to every layer at construction, and the process groups.

A `ParallelContext` names this rank's place in the tensor-parallel group and the pipeline, and wraps
the collectives the layers and the model runner need: all-reduce and all-gather over the TP group,
send/recv of hidden states between neighbouring pipeline stages. At size 1 every collective is a
no-op, so the single-process path never touches torch.distributed.

`init_distributed` joins the torch.distributed world of one server (TCP-store rendezvous) and builds
the TP groups. Ranks are TP-major: rank = pp_rank * tp_size + tp_rank, so the TP ranks of a stage
are contiguous and stage k's TP rank t sends to rank t of stage k + 1. It does not start processes.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from enginecore.config import ParallelConfig
from workers.shm_collectives import ShmCommunicator

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelContext:
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: Any = None  # a torch.distributed ProcessGroup when tp_size > 1
    pp_rank: int = 0
    pp_size: int = 1
    # Same-host TP groups on the CPU: a ShmCommunicator for the collectives that fit its slots.
    tp_shm: Any = None

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

    @property
    def rank(self) -> int:
        """Global rank in the torch.distributed world."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_driver(self) -> bool:
        """The one rank that samples and answers each step (TP rank 0 of the last stage)."""
        return self.is_last_stage and self.tp_rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the tensor-parallel group, in place."""
        if self.tp_size > 1:
            if self.tp_shm is not None and self.tp_shm.fits(x):
                return self.tp_shm.all_reduce(x)
            dist.all_reduce(x, group=self.tp_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim`, in rank order."""
        if self.tp_size == 1:
            return x
        x = x.contiguous()
        if self.tp_shm is not None and self.tp_shm.fits(x):
            return self.tp_shm.all_gather(x, dim)
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x, group=self.tp_group)
        return torch.cat(parts, dim=dim)

    def send_to_next_stage(self, x: torch.Tensor) -> None:
        """Hand this stage's output to the same TP rank of the next stage (blocking)."""
        assert not self.is_last_stage
        dist.send(x.contiguous(), dst=self.rank + self.tp_size)

    def recv_from_prev_stage(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The previous stage's output; the caller knows its shape from the step."""
        assert not self.is_first_stage
        x = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(x, src=self.rank - self.tp_size)
        return x


def divide(numerator: int, denominator: int) -> int:
    """Exact integer division; a sharding that does not divide evenly is a configuration error."""
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator


def shard_range(total: int, num_shards: int, index: int) -> tuple[int, int]:
    """(start, size) of shard `index` when `total` items are split into contiguous shards whose
    sizes differ by at most one (the first `total % num_shards` shards take one more)."""
    base, extra = divmod(total, num_shards)
    return index * base + min(index, extra), base + (index < extra)


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one TP rank computes: query heads [head_start, head_start + num_heads)
    and KV heads [kv_head_start, kv_head_start + num_kv_heads) of the checkpoint."""

    head_start: int
    num_heads: int
    kv_head_start: int
    num_kv_heads: int


def shard_heads(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> HeadShard:
    """Split attention heads over the TP group, or raise a ValueError naming the numbers.

    - tp_size <= KV heads: each rank takes whole KV groups (a KV head and the query heads that
      share it). When the groups do not divide evenly, the first ranks take one group more (9 heads
      / 3 KV heads at tp 2: ranks hold 6 + 3 heads); the ranks' work is then unbalanced.
    - tp_size > KV heads: each KV head is replicated on tp_size / num_kv_heads ranks, which needs
      tp_size to be a multiple of the KV heads and a divisor of the query heads.
    """
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} attention heads do not group over {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    if tp_size <= num_kv_heads:
        kv_start, kv_size = shard_range(num_kv_heads, tp_size, tp_rank)
        return HeadShard(kv_start * group, kv_size * group, kv_start, kv_size)
    if tp_size % num_kv_heads or num_heads % tp_size:
        raise ValueError(
            f"tensor-parallel size {tp_size} cannot split {num_heads} attention heads / "
            f"{num_kv_heads} KV heads: use a size <= {num_kv_heads}, or a multiple of "
            f"{num_kv_heads} that divides {num_heads}"
        )
    per_rank = num_heads // tp_size
    return HeadShard(tp_rank * per_rank, per_rank, tp_rank // (tp_size // num_kv_heads), 1)


def mlp_shard(
    intermediate_size: int, hidden_size: int, head_dim: int, heads: list[HeadShard], tp_rank: int
) -> tuple[int, int]:
    """(start, size) of the MLP's intermediate features TP rank `tp_rank` holds, given every rank's
    attention heads.

    With even heads every rank takes intermediate_size / tp_size. With uneven heads (9 / 3 KV at
    tp 2: 6 + 3) the ranks with fewer heads take more of the MLP, so that every rank holds about
    the same weight (in multiples of 32 features, so that the down projection's inner size stays
    a multiple of 32, as the AMX kernel needs): a decode step reads and multiplies the weights
    once, and the slowest rank sets the pace of every all-reduce.
    """
    tp_size = len(heads)
    attn = [2 * (h.num_heads + h.num_kv_heads) * head_dim * hidden_size for h in heads]
    if len(set(attn)) == 1:
        if intermediate_size % tp_size:
            raise ValueError(
                f"tensor-parallel size {tp_size} does not divide the MLP's intermediate size "
                f"{intermediate_size}"
            )
        return tp_rank * (intermediate_size // tp_size), intermediate_size // tp_size
    per_feature = 3 * hidden_size  # a row of gate, a row of up, a column of down
    target = (sum(attn) + per_feature * intermediate_size) / tp_size
    sizes = [max(32, round((target - a) / per_feature / 32) * 32) for a in attn]
    sizes[-1] = intermediate_size - sum(sizes[:-1])
    if min(sizes) < 1:
        raise ValueError(
            f"the MLP's {intermediate_size} features cannot balance the attention heads' weights "
            f"over {tp_size} ranks"
        )
    return sum(sizes[:tp_rank]), sizes[tp_rank]


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """The contiguous decoder layers of pipeline stage `pp_rank` (earlier stages take the extra)."""
    if pp_size > num_layers:
        raise ValueError(
            f"pipeline-parallel size {pp_size} exceeds the model's {num_layers} decoder layers"
        )
    start, size = shard_range(num_layers, pp_size, pp_rank)
    return range(start, start + size)


def resolve_backend(parallel: ParallelConfig) -> str:
    return parallel.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")


def _interface_towards(host: str) -> str | None:
    """The network interface this host would use to reach `host` (lo for a loopback address)."""
    import psutil

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((socket.gethostbyname(host), 9))  # UDP: picks a route, sends nothing
            local_ip = sock.getsockname()[0]
    except OSError:  # no route: let gloo choose, and the rendezvous report the problem
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == local_ip for a in addrs):
            return name
    return None


def init_distributed(parallel: ParallelConfig, rank: int) -> ParallelContext:
    """Join the server's torch.distributed world as `rank` and build the TP groups.

    Every rank calls this with the same ParallelConfig (dist_init_addr filled in). Collectives fail
    after `distributed_timeout_s` rather than hanging a rank whose peer died.
    """
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    if parallel.world_size == 1:
        return ParallelContext.single()
    assert parallel.dist_init_addr, "the executor fills in dist_init_addr"
    backend = resolve_backend(parallel)
    if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
        # Gloo otherwise uses the address the hostname resolves to, which need not reach the peers.
        interface = _interface_towards(parallel.dist_init_addr.rpartition(":")[0])
        if interface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    timeout = datetime.timedelta(seconds=parallel.distributed_timeout_s)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{parallel.dist_init_addr}",
        rank=rank,
        world_size=parallel.world_size,
        timeout=timeout,
    )
    tp_group = tp_shm = None
    if tp > 1:
        # NOTE: every rank must create every group, in the same order.
        for stage in range(pp):
            group = dist.new_group(list(range(stage * tp, (stage + 1) * tp)), timeout=timeout)
            if stage == rank // tp:
                tp_group = group
        first = rank - rank % tp
        # NOTE: only a group whose ranks all run on this node: ranks of other nodes may map the
        # same /dev/shm (containers, network namespaces), but a dead peer there must surface as a
        # failed collective, not as a wait. The decision is the same on every rank of the group.
        on_one_node = (
            first // parallel.ranks_per_node == (first + tp - 1) // parallel.ranks_per_node
        )
        if backend == "gloo" and parallel.shm_collectives and on_one_node:
            tp_shm = ShmCommunicator.create(
                tp_group, rank % tp, tp, src=rank - rank % tp, timeout_s=timeout.total_seconds()
            )
    logger.info(
        "rank %d of %d joined (%s, tp %d x pp %d%s)", rank, tp * pp, backend, tp, pp,
        ", shared-memory TP collectives" if tp_shm is not None else "",
    )  # fmt: skip
    return ParallelContext(
        tp_rank=rank % tp,
        tp_size=tp,
        tp_group=tp_group,
        pp_rank=rank // tp,
        pp_size=pp,
        tp_shm=tp_shm,
    )


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

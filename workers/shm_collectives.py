"""Shared-memory all-reduce and all-gather for the tensor-parallel ranks of one host (CPU, gloo).

Gloo's TCP round trip costs 1.2-1.7 ms per collective on this 2-core machine even for a few
kilobytes, and a decode step makes two all-reduces per layer: at --tp 2 that was ~100 ms of a
~190 ms step. Through a shared segment (csrc/collectives.c, `tern_shm_*`) a collective is a copy in, a
flag, a wait and a sum: microseconds.

Set-up, once per TP group (`ShmCommunicator.create`): TP rank 0 creates a file under /dev/shm and
sends its path through the process group; every rank maps it and reports whether it could; then
rank 0 unlinks it, so nothing is left behind whatever later happens to the processes. If any rank
cannot map it (ranks on different hosts), the group keeps using the process group. Tensors larger
than a slot (prompt logprobs over long prompts) and dtypes other than float32 / bfloat16 also go
through the process group; the choice depends only on shape and dtype, which agree on every rank,
so every rank takes the same path for every collective.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist

from enginecore.shm_broadcast import shm_space_message
from workers.kernels import kernel_library

logger = logging.getLogger(__name__)

# Covers a prefill all-reduce of 2048 tokens x hidden 1024 in float32 and the LM-head all-gather
# of 64 rows x 32k vocabulary per rank.
SLOT_BYTES = 8 << 20
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class ShmCommunicator:
    def __init__(
        self, segment: mmap.mmap, rank: int, world: int, slot_bytes: int, timeout_s: float
    ) -> None:
        self._lib = kernel_library.load()
        self._segment = segment
        self._view = torch.frombuffer(segment, dtype=torch.uint8)  # holds the mapping's address
        self._base = self._view.data_ptr()
        self.rank, self.world = rank, world
        self.slot_bytes, self.timeout_s = slot_bytes, timeout_s
        self._seq = 0

    @classmethod
    def create(
        cls,
        group: Any,
        tp_rank: int,
        tp_size: int,
        src: int,
        timeout_s: float,
        slot_bytes: int = SLOT_BYTES,
    ) -> ShmCommunicator | None:
        """Collective over `group` (global rank `src` is TP rank 0); None where some rank cannot
        share memory with the others, or the kernels are not built (the same answer on every rank:
        a missing compiler is a per-host fact, so it is agreed on like the mapping)."""
        lib = kernel_library.load()
        size = (lib.tern_shm_header_bytes() if lib else 0) + 2 * tp_size * slot_bytes
        path = [None]
        if tp_rank == 0 and lib is not None:
            shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else None
            fd, path[0] = tempfile.mkstemp(prefix="tern-tp-", dir=shm_dir)
            try:
                # Reserved now: a page a full tmpfs cannot back would be a SIGBUS mid-step.
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                logger.warning(
                    "tensor-parallel collectives: %s (%s)", shm_space_message(size), e.strerror
                )
                os.unlink(path[0])
                path[0] = None
            finally:
                os.close(fd)
        dist.broadcast_object_list(path, src=src, group=group)
        segment = None
        if lib is not None and path[0] is not None:
            with contextlib.suppress(OSError, ValueError):
                fd = os.open(path[0], os.O_RDWR)
                try:
                    segment = mmap.mmap(fd, size)
                finally:
                    os.close(fd)
        mapped = [None] * tp_size
        dist.all_gather_object(mapped, segment is not None, group=group)
        if tp_rank == 0 and path[0] is not None:
            os.unlink(path[0])
        if not all(mapped):
            logger.info("tensor-parallel collectives stay on the process group (no shared memory)")
            if segment is not None:
                segment.close()
            return None
        return cls(segment, tp_rank, tp_size, slot_bytes, timeout_s)

    @property
    def base(self) -> int:
        """Address of the mapped segment, for native code that runs collectives itself."""
        return self._base

    def take_sequence_numbers(self, n: int) -> int:
        """The first of n sequence numbers for collectives run by native code (in order)."""
        first = self._seq + 1
        self._seq += n
        return first

    def fits(self, x: torch.Tensor) -> bool:
        return (
            x.dtype in _DTYPES
            and x.is_cpu
            and x.is_contiguous()
            and x.numel() * x.element_size() <= self.slot_bytes
        )

    def _check(self, rc: int, what: str) -> None:
        if rc == -1:
            raise RuntimeError(
                f"tensor-parallel {what}: a peer rank did not arrive within {self.timeout_s:.0f} s"
            )
        if rc != 0:
            raise ValueError(f"tensor-parallel {what}: the tensor does not fit a slot")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x (fits()) over the ranks, in place, in rank order (bit-identical on every rank)."""
        self._seq += 1
        rc = self._lib.tern_shm_all_reduce(
            self._base, self.rank, self.world, self._seq, self.slot_bytes, x.data_ptr(),
            x.numel(), _DTYPES[x.dtype], self.timeout_s,
        )  # fmt: skip
        self._check(rc, "all-reduce")
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's x (fits()) concatenated along dim, in rank order."""
        out = torch.empty((self.world, *x.shape), dtype=x.dtype)
        self._seq += 1
        rc = self._lib.tern_shm_all_gather(
            self._base, self.rank, self.world, self._seq, self.slot_bytes, x.data_ptr(),
            x.numel() * x.element_size(), out.data_ptr(), self.timeout_s,
        )  # fmt: skip
        self._check(rc, "all-gather")
        return torch.cat(out.unbind(0), dim=dim)

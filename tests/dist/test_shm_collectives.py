"""Shared-memory TP collectives in a gloo world of 2 (the path `--tp N` takes on one CPU host).

All-reduce (float32 and bfloat16) and all-gather equal gloo's and are bit-identical on every rank;
what does not fit a slot goes through gloo; a peer that never arrives fails the collective after
the timeout instead of hanging; no segment is left in /dev/shm.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from gloo_world import run_world

from workers.distributed import ParallelContext
from workers.kernels import kernel_library
from workers.shm_collectives import ShmCommunicator

pytestmark = pytest.mark.skipif(kernel_library.load() is None, reason="no C compiler")
WORLD = 2


def _segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("tern-tp-")}


def _check(rank: int) -> None:
    shm = ShmCommunicator.create(dist.group.WORLD, rank, WORLD, src=0, timeout_s=2.0,
                                 slot_bytes=1 << 16)  # fmt: skip
    assert shm is not None
    ctx = ParallelContext(tp_rank=rank, tp_size=WORLD, tp_group=dist.group.WORLD, tp_shm=shm)
    for step, dtype in enumerate([torch.float32, torch.bfloat16] * 3):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(7, 33, generator=g).to(dtype)
        ref = x.clone()
        dist.all_reduce(ref)
        assert shm.fits(x)
        out = ctx.all_reduce(x.clone())
        torch.testing.assert_close(out, ref, rtol=0, atol=0 if dtype == torch.float32 else 1e-2)
        everyone = [torch.empty_like(out) for _ in range(WORLD)]
        dist.all_gather(everyone, out)
        assert all(torch.equal(e, out) for e in everyone)  # the same bits on every rank

        parts = [torch.empty_like(x) for _ in range(WORLD)]
        dist.all_gather(parts, x)
        assert torch.equal(ctx.all_gather(x, dim=-1), torch.cat(parts, dim=-1))
        assert torch.equal(ctx.all_gather(x, dim=0), torch.cat(parts, dim=0))

    big = torch.full((1 << 15,), float(rank + 1))  # 128 KiB > a 64 KiB slot: gloo
    assert not shm.fits(big)
    assert torch.equal(ctx.all_reduce(big), torch.full((1 << 15,), 3.0))

    dist.barrier()
    if rank == 0:  # rank 1 never joins this one
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="did not arrive"):
            ctx.all_reduce(torch.ones(4))
        assert time.monotonic() - start < 10


def _rank_main(rank: int) -> None:
    _check(rank)


def test_shm_collectives_match_gloo_in_a_world_of_2() -> None:
    before = _segments()
    run_world(_rank_main, world_size=WORLD)
    assert _segments() == before

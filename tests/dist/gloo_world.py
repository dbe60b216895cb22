"""A gloo world of spawned ranks for the tests in tests/dist, set up and torn down one way.

Why the teardown ends in os._exit: a rank that has run gloo collectives and tern's OpenMP kernels
sometimes aborts in interpreter teardown ("terminate called without an active exception", SIGABRT)
after its test passed: static destructors run while gloo's and the OpenMP pool's threads are
still alive. Measured with the int8 layers' check in a world of 2 (30 worlds each): 10 aborted
with a plain exit, 11 with destroy_process_group first, still some with a barrier before it, none
with neither library, none when the rank leaves by os._exit. So each rank meets the others at a
barrier (no peer still talks to it), destroys its group, flushes its output and leaves by
os._exit(0): nothing of the test's is lost, and no destructor runs. A rank whose check fails
raises as before, and mp.spawn reports its traceback.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = datetime.timedelta(seconds=60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(rank_main: Callable[..., None], *args: Any, world_size: int = 2) -> None:
    """Runs rank_main(rank, *args) on every rank of a gloo world (rank_main must be a module-level
    function: it is pickled to spawned processes). Raises if any rank fails."""
    mp.spawn(_rank, args=(rank_main, free_port(), world_size, args), nprocs=world_size, join=True)


def _rank(
    rank: int, rank_main: Callable[..., None], port: int, world_size: int, args: tuple[Any, ...]
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=TIMEOUT,
    )
    rank_main(rank, *args)
    leave_world()


def leave_world() -> None:
    """The end of a rank that succeeded: barrier, destroy, flush, os._exit(0) (see above)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

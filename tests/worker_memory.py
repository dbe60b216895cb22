"""What a server's worker processes hold where the model lives, for the sleep and wake-up tests:
resident memory on the CPU; on a GPU, the device memory nvidia-smi counts for each process (a
level-1 sleep there moves the weights to host memory, which resident memory would count as
growth)."""

from __future__ import annotations

import subprocess

import psutil
import torch


def workers_of(engine_core_pid: int) -> list[psutil.Process]:
    core = psutil.Process(engine_core_pid)
    return [p for p in core.children() if "resource_tracker" not in " ".join(p.cmdline())]


def memory_held(processes: list[psutil.Process]) -> int:
    """Bytes the processes hold: device memory when the workers run on a GPU, else RSS."""
    if not torch.cuda.is_available():
        return sum(p.memory_info().rss for p in processes)
    query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
    lines = subprocess.run(query, capture_output=True, text=True, check=True, timeout=30).stdout
    used = {int(pid): int(mib) << 20 for pid, mib in (ln.split(",") for ln in lines.splitlines())}
    return sum(used.get(p.pid, 0) for p in processes)

"""A worker's torch threads follow the cores its process may run on: a server started under
`taskset` (or in a container's cpuset) splits those cores between its workers, not the
machine's, so two servers pinned to one core each do not each run two threads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from workers.worker_proc import num_threads


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux CPU affinity")
def test_threads_follow_the_process_cpu_affinity() -> None:
    code = "from workers.worker_proc import num_threads; print(num_threads(1), num_threads(2))"
    one_core = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
        preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}),
    )  # fmt: skip
    assert one_core.stdout.split() == ["1", "1"]
    cores = len(os.sched_getaffinity(0))
    assert num_threads(1) == cores and num_threads(2) == max(1, cores // 2)

"""The decode floor: a 1-sequence decode step reads every active weight once, so no step is faster
than the bytes it reads over the memory's streaming-read bandwidth. Both are measured here for the
start-up log line that names the kernel tier (on CPUs: the tier is a CPU's) and for
scripts/bench_step.py, which reports the decode step against it. The start-up line takes the
bandwidth last measured on the same CPU with as many threads, remembered in TERN_HOME: the probe
touches and reads 256 MB, ~0.2 s of every start for one log line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from enginecore.home_cache import read_remembered, remember
from workers.kernels.kernel_library import cpu_model
from workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from workers.layers.moe import SparseMoE

# The probe's buffer: well past any CPU's last-level cache (so it measures memory, not cache), yet
# small enough to read in a few milliseconds.
PROBE_BYTES = 256 << 20
PROBE_PASSES = 4
BANDWIDTH_FILE = "read_bandwidth.json"
# Buffers that are tables looked up a row at a time, not streamed by a decode step.
_LOOKUP_BUFFERS = ("cos_cache", "sin_cache", "inv_freq")


def read_bandwidth(nbytes: int = PROBE_BYTES) -> float:
    """The CPU's streaming-read bandwidth in bytes per second: the best of a few sums over a buffer
    (a sum is a read with next to no arithmetic, run on torch's threads: a decode step's)."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)  # pages touched here
    best = float("inf")
    for _ in range(PROBE_PASSES):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def remembered_read_bandwidth() -> float:
    """read_bandwidth() as first measured on this CPU model with torch's thread count, kept in
    TERN_HOME (enginecore/home_cache.py)."""
    known = read_remembered(BANDWIDTH_FILE)
    key = f"{cpu_model()} | {torch.get_num_threads()} threads | {PROBE_BYTES} bytes"
    if key not in known:
        known[key] = read_bandwidth()
        remember(BANDWIDTH_FILE, known)
    return known[key]


def decode_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step of one sequence reads on this rank: every parameter and
    weight buffer once, except embedding tables looked up a row at a time (the LM head, tied or
    not, is read whole) and the experts a token is not routed to (top_k of num_experts)."""
    total = 0
    seen: set[int] = set()
    moe_experts = {id(m.experts): m for m in model.modules() if isinstance(m, SparseMoE)}
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead):
            continue  # looked up; a tied LM head is counted when its module is reached
        share = 1.0
        if id(module) in moe_experts:
            moe = moe_experts[id(module)]
            share = min(1.0, moe.top_k / moe.gate.weight.shape[0])
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for name, t in tensors:
            if name in _LOOKUP_BUFFERS or t is None or t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            total += int(t.numel() * t.element_size() * share)
    return total


@dataclass(frozen=True)
class DecodeFloor:
    weight_bytes: int  # read by one decode step of one sequence
    read_bandwidth: float  # bytes per second
    threads: int  # torch's threads

    @property
    def seconds(self) -> float:
        return self.weight_bytes / self.read_bandwidth

    def __str__(self) -> str:
        return (
            f"decode floor: {self.weight_bytes / 1e6:.0f} MB of weights per step / "
            f"{self.read_bandwidth / 1e9:.1f} GB/s streaming read on {self.threads} threads = "
            f"{self.seconds * 1e3:.1f} ms per token"
        )


def measure_floor(model: torch.nn.Module, remembered: bool) -> DecodeFloor:
    """The floor of a model on the CPU (its weights in host memory); with `remembered`, over the
    bandwidth measured at an earlier start on this CPU."""
    bandwidth = remembered_read_bandwidth() if remembered else read_bandwidth()
    return DecodeFloor(decode_bytes(model), bandwidth, torch.get_num_threads())

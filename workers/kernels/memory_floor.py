"""The decode floor: a 1-sequence decode step reads every active weight once, so no step is faster
than the bytes it reads over the memory's streaming-read bandwidth. Both are measured here for the
start-up log line that names the kernel tier, and for scripts/probe_floor.py and the benchmarks,
which report TPOT against it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from workers.layers.moe import SparseMoE

# The probe's buffer: well past any CPU's last-level cache (so it measures memory, not cache), yet
# small enough to read in a few milliseconds.
PROBE_BYTES = 256 << 20
PROBE_PASSES = 4
# Buffers that are tables looked up a row at a time, not streamed by a decode step.
_LOOKUP_BUFFERS = ("cos_cache", "sin_cache", "inv_freq")


def read_bandwidth(device: torch.device | str = "cpu", nbytes: int = PROBE_BYTES) -> float:
    """Streaming-read bandwidth in bytes per second: the best of a few sums over a buffer (a sum
    is a read with next to no arithmetic, run on torch's threads: the threads a decode step has)."""
    device = torch.device(device)
    buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)  # pages touched here
    best = float("inf")
    for _ in range(PROBE_PASSES):
        _sync(device)
        start = time.perf_counter()
        buf.sum()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step of one sequence reads on this rank: every parameter and
    weight buffer once, except embedding tables looked up a row at a time (the LM head, tied or
    not, is read whole) and the experts a token is not routed to (top_k of num_experts)."""
    total = 0
    seen: set[int] = set()
    moe_experts = {id(m.experts): m for m in model.modules() if isinstance(m, SparseMoE)}
    for module in model.modules():
        lookup = isinstance(module, VocabParallelEmbedding) and not isinstance(
            module, ParallelLMHead
        )
        share = 1.0
        if id(module) in moe_experts:
            moe = moe_experts[id(module)]
            share = min(1.0, moe.top_k / moe.gate.weight.shape[0])
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for name, t in tensors:
            if name in _LOOKUP_BUFFERS or t is None or t.data_ptr() in seen:
                continue
            if lookup:
                continue  # a tied LM head is counted when its module is reached
            seen.add(t.data_ptr())
            total += int(t.numel() * t.element_size() * share)
    return total


@dataclass(frozen=True)
class DecodeFloor:
    weight_bytes: int  # read by one decode step of one sequence
    read_bandwidth: float  # bytes per second
    threads: int | None  # torch's threads (CPU)

    @property
    def seconds(self) -> float:
        return self.weight_bytes / self.read_bandwidth

    def __str__(self) -> str:
        threads = f" on {self.threads} threads" if self.threads else ""
        return (
            f"decode floor: {self.weight_bytes / 1e6:.0f} MB of weights per step / "
            f"{self.read_bandwidth / 1e9:.1f} GB/s streaming read{threads} = "
            f"{self.seconds * 1e3:.1f} ms per token"
        )


def measure_floor(model: torch.nn.Module, device: torch.device) -> DecodeFloor:
    threads = torch.get_num_threads() if device.type == "cpu" else None
    return DecodeFloor(decode_bytes(model), read_bandwidth(device), threads)

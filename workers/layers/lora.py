"""LoRA adapters inside a linear layer: every loaded adapter in one slot, every row of a step on
its own adapter.

A layer serving LoRA holds a `LoraStack`: for each slot s,
- `a[s]` (segments x rank, input features): each projection's A (lora_A.weight), padded with zero
  rows to the stack's rank, one block of `rank` rows per fused projection (q, k, v of qkv_proj;
  gate, up of gate_up_proj; one for the others);
- `b[s]` (output features, rank): the projections' B (lora_B.weight) times the adapter's scaling
  (lora_alpha / r, or / sqrt(r) with rsLoRA), this rank's rows of each projection;
so y[t] += b[s] @ (a[s] @ x[t]) restricted to each projection's block, with s = slots[t] (-1: the
base model, nothing added). Sharded as the base weight is: a column-parallel layer keeps all of A
and its rows of B; a row-parallel layer keeps its input columns of A and all of B, and adds its
partial product before the all-reduce (the sum over ranks of b (a_r x_r) is b (a x)).

One `LoraBatch` per model says which slot each token of the current step uses; the model runner
sets it before the forward pass, every stack reads it (and the fused decode layer passes it to
the native kernel: the same kernel as here, so fused and unfused agree bit for bit).
"""

from __future__ import annotations

import torch

from workers.kernels import elementwise_ops, lora_ops


class LoraBatch:
    """The step's adapter per token, shared by every LoraStack of a model."""

    def __init__(self) -> None:
        self.slots: torch.Tensor | None = None  # (T,) int32, -1 = the base model; None: no LoRA


class LoraStack:
    def __init__(
        self,
        batch: LoraBatch,
        num_slots: int,
        rank: int,
        input_size: int,
        segment_rows: list[int],
        device: torch.device | str = "cpu",
    ) -> None:
        self.batch = batch
        self.rank = rank
        self.segment_rows = list(segment_rows)
        self.a = torch.zeros(num_slots, len(segment_rows) * rank, input_size, device=device)
        self.b = torch.zeros(num_slots, sum(segment_rows), rank, device=device)
        self.seg_rows = torch.tensor(segment_rows, dtype=torch.int32)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def set_segment(self, slot: int, segment: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Projection `segment`'s A (r, this rank's inputs) and B (this rank's rows, r), scaled."""
        r = a.size(0)
        if r > self.rank or b.size(1) != r:
            raise ValueError(f"rank {r} exceeds --max-lora-rank {self.rank}")
        start = sum(self.segment_rows[:segment])
        rows = self.segment_rows[segment]
        if tuple(a.shape) != (r, self.a.size(2)) or tuple(b.shape) != (rows, r):
            raise ValueError(
                f"LoRA shapes A {tuple(a.shape)} / B {tuple(b.shape)} do not fit a projection "
                f"of {rows} rows x {self.a.size(2)} inputs on this rank"
            )
        block = self.a[slot, segment * self.rank : (segment + 1) * self.rank]
        block.zero_()
        block[:r].copy_(a)
        rows_b = self.b[slot, start : start + rows]
        rows_b.zero_()
        rows_b[:, :r].copy_(b)

    def add_(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y (T, out) += each token's adapter's product with x (T, in), in place."""
        slots = self.batch.slots
        if slots is None:
            return
        if elementwise_ops.usable(x, y) and x.dtype == y.dtype and lora_ops.lora_add_ready():
            lora_ops.lora_add(x, y, slots, self.a, self.b, self.rank, self.seg_rows)
            return
        self._add_torch(x, y, slots)

    def _add_torch(self, x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor) -> None:
        """The same sums in torch, grouped by adapter (GPUs, and CPUs without the kernels)."""
        slots = slots.to(x.device)
        for s in slots.unique().tolist():
            if s < 0:
                continue
            rows = (slots == s).nonzero().squeeze(1)
            shrunk = x.index_select(0, rows).float() @ self.a[s].T  # (m, segments x rank)
            start = 0
            parts = []
            for i, n in enumerate(self.segment_rows):
                block = shrunk[:, i * self.rank : (i + 1) * self.rank]
                parts.append(block @ self.b[s, start : start + n].T)
                start += n
            delta = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
            y.index_copy_(0, rows, (y.index_select(0, rows).float() + delta).to(y.dtype))

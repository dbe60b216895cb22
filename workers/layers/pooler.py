"""Pooling of a prompt's final hidden states into one vector, across its prefill chunks.

A pooling request's prompt may be computed over several steps (chunked prefill), so each request
keeps a `PoolingState` between steps: LAST keeps the last row seen (the last chunk's last row is
the prompt's last token), CLS the row of position 0, MEAN a float32 running sum and count. MEAN and
CLS need every position (0 for CLS) to be computed by this worker: the scheduler never serves them
from the prefix cache; LAST may be (the last prompt token is always computed).

The pooler knows positions and rows only: which requests finish, and the head that follows, are
the model runner's and the model's business.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from enginecore.config import POOLING_TYPES


@dataclass
class PoolingState:
    """One request's pooling so far."""

    total: torch.Tensor | None = None  # (hidden,) float32: the sum (MEAN) or the row (LAST, CLS)
    num_positions: int = 0  # positions pooled so far (MEAN's divisor)


class Pooler:
    def __init__(self, pooling_type: str) -> None:
        if pooling_type not in POOLING_TYPES:
            raise ValueError(f"unknown pooling type {pooling_type!r} (one of {POOLING_TYPES})")
        self.pooling_type = pooling_type

    def add_chunk(self, state: PoolingState, rows: torch.Tensor, start_pos: int) -> None:
        """`rows` (n, hidden): final hidden states of positions start_pos .. start_pos + n - 1."""
        if self.pooling_type == "MEAN":
            # NOTE: a gap (a skipped cached prefix, a lost chunk) would silently bias the mean.
            assert start_pos == state.num_positions, (start_pos, state.num_positions)
            chunk_sum = rows.sum(dim=0, dtype=torch.float32)
            state.total = chunk_sum if state.total is None else state.total + chunk_sum
        elif self.pooling_type == "CLS":
            if start_pos == 0:
                state.total = rows[0].float()
        else:
            state.total = rows[-1].float()
        state.num_positions = start_pos + rows.size(0)

    def pooled(self, state: PoolingState) -> torch.Tensor:
        """(hidden,) float32, once the prompt's last chunk has been added."""
        assert state.total is not None, f"{self.pooling_type} pooling saw no position to pool"
        if self.pooling_type == "MEAN":
            return state.total / state.num_positions
        return state.total

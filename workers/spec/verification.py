"""Verification of drafted tokens (speculative decoding; the engine core drafts them,
enginecore/speculative.py).

A request with k drafts d1..dk computes its last token and the drafts in one step; the LM head runs
on all k + 1 positions, and position j is sampled exactly as plain decoding samples output token
sample_index + j: the same logits processors (penalties over the tokens up to d_j, min_tokens by
that output index, the grammar's state after d_j), the same temperature / top-k / top-p / min-p,
and the same noise, which depends only on (seed, output index, token id) (workers/layers/
sampler.py). The request keeps d1..da, where a is the first j with sample_j != d_{j+1}, and then
sample_a. Each kept token is therefore the token plain decoding would have sampled after the same
prefix: the output is plain decoding's, token for token, for any seed and any sampling parameters,
so the distribution is the target model's exactly (no draft distribution enters it). A draft is
kept with probability p(draft) under the sampled distribution, what rejection sampling accepts a
deterministic draft with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from enginecore.messages import ScheduledRequest
from workers.sample.logits_processors import DraftedHistory, TokenHistory

T = TypeVar("T")


@dataclass
class SampleRows:
    """The rows one step samples: for each sampling request (in batch order) its last
    num_draft_tokens + 1 positions, request-major."""

    ends: list[int]  # each request's last position + 1 in the step's flat batch
    drafts: list[list[int]]  # each request's drafts

    @classmethod
    def of(cls, reqs: Sequence[ScheduledRequest], ends: list[int]) -> SampleRows:
        drafts = [r.token_ids[len(r.token_ids) - r.num_draft_tokens :] for r in reqs]
        return cls(ends, drafts)

    def positions(self, device: torch.device) -> torch.Tensor:
        index = [
            e - len(d) - 1 + j for e, d in zip(self.ends, self.drafts) for j in range(len(d) + 1)
        ]
        return torch.tensor(index, dtype=torch.int64, device=device)

    def per_row(self, values: Sequence[T]) -> list[T]:
        """One value per request -> one per row."""
        return [v for v, d in zip(values, self.drafts) for _ in range(len(d) + 1)]

    def sample_indices(self, first: Sequence[int]) -> list[int]:
        return [i + j for i, d in zip(first, self.drafts) for j in range(len(d) + 1)]

    def histories(
        self, histories: Sequence[TokenHistory | None]
    ) -> list[TokenHistory | DraftedHistory | None]:
        """Row j of a request sees its history followed by its first j drafts."""
        out: list[TokenHistory | DraftedHistory | None] = []
        for history, drafts in zip(histories, self.drafts):
            out.append(history)
            for j in range(1, len(drafts) + 1):
                out.append(None if history is None else DraftedHistory(history, drafts[:j]))
        return out

    def bitmasks(self, masks: Sequence[bytes | None]) -> list[bytes | None]:
        """A constrained request's bitmask bytes hold one bitmask per row (GrammarBitmasks)."""
        out: list[bytes | None] = []
        for mask, drafts in zip(masks, self.drafts):
            n = len(drafts) + 1
            if mask is None:
                out += [None] * n
                continue
            if len(mask) % n:
                raise ValueError(f"a grammar bitmask of {len(mask)} bytes for {n} positions")
            size = len(mask) // n
            out += [mask[j * size : (j + 1) * size] for j in range(n)]
        return out

    def accepted(self, sampled: list[int]) -> list[tuple[int, int]]:
        """Each request's kept rows [lo, hi) of the row-major samples: its drafts up to the
        first that differs from the token sampled before it, then that sample."""
        spans, lo = [], 0
        for drafts in self.drafts:
            a = 0
            while a < len(drafts) and sampled[lo + a] == drafts[a]:
                a += 1
            spans.append((lo, lo + a + 1))
            lo += len(drafts) + 1
        return spans

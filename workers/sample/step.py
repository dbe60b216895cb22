"""One step's draw on the driver: the logits of the rows that sample (each sampling request's last
position, or with drafts its last k + 1: spec/verification.py's SampleRows) to the tokens each
request keeps and their logprobs.

The rows' sampling tensors (sampler.py) come from the requests' parameters, histories (with the
drafts each row follows) and grammar bitmasks; the sampler draws every row; the drafts' rows keep
their tokens up to the first one that differs from its draft (SampleRows.accepted); the logprobs
are the raw distribution's, or with --logprobs-mode processed_logprobs those the sampler drew
from (logprobs.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from enginecore.messages import Logprobs, SamplingParams
from workers.sample.logits_processors import TokenHistory
from workers.sample.logprobs import logprob_rows, sampled_logprobs_rows
from workers.sample.sampler import Sampler, SamplingTensors

if TYPE_CHECKING:
    from workers.spec.verification import SampleRows


@dataclass
class Drawn:
    """Per sampling request (in batch order): the tokens it keeps and their logprobs (only the
    requests that asked)."""

    token_ids: list[list[int]]
    logprobs: dict[str, Logprobs]


def draw_step(
    sampler: Sampler,
    logits: torch.Tensor,
    rows: SampleRows,
    req_ids: list[str],
    params: list[SamplingParams],
    sample_indices: list[int],
    histories: list[TokenHistory | None],
    bitmasks: list[bytes | None],
    processed_logprobs: bool,
) -> Drawn:
    """`logits` (R, V) float32, one row per SampleRows row; the other lists one entry per sampling
    request: its id, parameters, first sample index, token history and grammar bitmask."""
    row_params = rows.per_row(params)
    tensors = SamplingTensors.from_params(
        row_params,
        rows.sample_indices(sample_indices),
        logits.size(-1),
        logits.device,
        rows.histories(histories),
        rows.bitmasks(bitmasks),
    )
    num_tops = [q.logprobs for q in row_params]
    # processed_logprobs: the sampler also returns the distributions it drew the rows from.
    processed_rows = logprob_rows(num_tops) if processed_logprobs else None
    sampled, processed = sampler.sample(logits, tensors, processed_rows)
    sampled_rows = sampled.tolist()
    emitted = rows.accepted(sampled_rows)  # per request: the rows it keeps
    row_logprobs = sampled_logprobs_rows(logits, sampled, num_tops, processed)
    return Drawn(
        [sampled_rows[lo:hi] for lo, hi in emitted],
        {
            req_id: Logprobs.concat(row_logprobs[lo:hi])
            for req_id, (lo, hi) in zip(req_ids, emitted)
            if row_logprobs[lo] is not None
        },
    )

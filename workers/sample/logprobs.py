"""Logprobs for the API, computed only for the requests that ask, for the chosen token (the sampled
one, or the prompt's next token) with its rank, plus the k most likely tokens.

Which distribution they describe is --logprobs-mode's (vLLM's names): "raw_logprobs", the default,
is the log_softmax of the raw logits (before the grammar, logit bias, penalties and temperature);
"processed_logprobs" is the distribution the sampler drew from (workers/sample/sampler.py computes
it), so that a trainer gets log p(token) under the behaviour policy. Prompt logprobs are always raw:
prompt tokens are not sampled (vLLM says the same of its modes).

Prompt logprobs need logits at every prompt position, not just the last: those rows of the hidden
states go through the LM head in slices, so a long prefill chunk never holds (T, vocab) at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from enginecore.messages import Logprobs, PromptLogprobs, SamplingParams, ScheduledRequest
from workers.sample.logits_processors import TokenHistory

# Prompt rows through the LM head at a time: 256 x a 150K vocabulary is ~150 MB of float32.
_PROMPT_ROWS_PER_SLICE = 256


def select_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[list[float], list[int], list[list[int]], list[list[float]]]:
    """Logprobs (N, V) and chosen ids (N,) -> chosen logprobs, 1-based ranks, top-k ids and values."""
    chosen = logprobs.gather(1, token_ids[:, None])  # (N, 1)
    # NOTE: ties count against the chosen token (vLLM's convention): rank = #{logprob >= its}.
    ranks = (logprobs >= chosen).sum(dim=-1)
    if num_top == 0:
        empty: list[list] = [[] for _ in range(len(token_ids))]
        return chosen.squeeze(1).tolist(), ranks.tolist(), empty, empty
    top_lp, top_ids = logprobs.topk(num_top, dim=-1)  # (N, k) each, best first
    return chosen.squeeze(1).tolist(), ranks.tolist(), top_ids.tolist(), top_lp.tolist()


def sampled_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_tops: list[int]
) -> list[Logprobs]:
    """One position per row: logprobs (N, V), sampled ids (N,), each row's k -> N Logprobs."""
    chosen, ranks, top_ids, top_lp = select_logprobs(logprobs, token_ids, max(num_tops))
    return [
        Logprobs([int(t)], [chosen[i]], [ranks[i]], k, top_ids[i][:k], top_lp[i][:k])
        for i, (t, k) in enumerate(zip(token_ids.tolist(), num_tops))
    ]


def logprob_rows(num_tops: list[int | None]) -> list[int]:
    """The rows whose request asked for the sampled tokens' logprobs (num_top not None)."""
    return [i for i, k in enumerate(num_tops) if k is not None]


def sampled_logprobs_rows(
    logits: torch.Tensor,
    sampled: torch.Tensor,
    num_tops: list[int | None],
    processed: torch.Tensor | None = None,
) -> list[Logprobs | None]:
    """Each row's sampled token's logprobs, None for the rows whose request did not ask
    (logprob_rows): raw, from `logits` (N, V), or `processed` (R, V), the sampler's logprobs of
    exactly the asking rows."""
    out: list[Logprobs | None] = [None] * len(num_tops)
    rows = logprob_rows(num_tops)
    if not rows:
        return out
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    if processed is None:
        # NOTE: the asking rows only: the others never pay a full-vocab pass.
        logprobs = logits[index].float().log_softmax(dim=-1)
    else:
        assert processed.size(0) == len(rows), "processed logprobs are the asking rows'"
        logprobs = processed
    chosen = sampled_logprobs(logprobs, sampled[index], [num_tops[i] or 0 for i in rows])
    for i, row in zip(rows, chosen):
        out[i] = row
    return out


@dataclass
class PromptLogprobsJob:
    """One request's prompt positions in this step's batch: rows row_start, row_start + 1, ... of
    the hidden states predict prompt tokens `targets` (token `start`, `start` + 1, ...)."""

    req_id: str
    row_start: int
    start: int
    targets: list[int]
    num_top: int


def prompt_logprobs_jobs(
    reqs: list[ScheduledRequest],
    params: list[SamplingParams],
    histories: list[TokenHistory | None],
) -> list[PromptLogprobsJob]:
    """The prompt positions of this step's batch whose request asked for prompt logprobs.

    The row of position p predicts token p + 1: a chunk covering positions [start, end) gives the
    logprobs of prompt tokens start + 1 .. min(end, num_prompt_tokens - 1).
    """
    jobs = []
    row = 0
    for r, p, history in zip(reqs, params, histories):
        if p.prompt_logprobs is not None:
            assert history is not None, "prompt logprobs need the prompt"
            end = min(r.start_pos + len(r.token_ids), history.num_prompt_tokens - 1)
            if end > r.start_pos:
                targets = history.token_ids[r.start_pos + 1 : end + 1]
                jobs.append(
                    PromptLogprobsJob(r.req_id, row, r.start_pos + 1, targets, p.prompt_logprobs)
                )
        row += len(r.token_ids)
    return jobs


def prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    jobs: list[PromptLogprobsJob],
) -> dict[str, PromptLogprobs]:
    """Runs the LM head over each job's rows (a collective under tensor parallelism: every rank of
    the last stage must call this with the same jobs) and selects the targets' logprobs."""
    out: dict[str, PromptLogprobs] = {}
    for job in jobs:
        parts = []
        for lo in range(0, len(job.targets), _PROMPT_ROWS_PER_SLICE):
            hi = min(lo + _PROMPT_ROWS_PER_SLICE, len(job.targets))
            rows = hidden[job.row_start + lo : job.row_start + hi]
            logprobs = compute_logits(rows).float().log_softmax(dim=-1)  # (rows, V)
            targets = torch.tensor(job.targets[lo:hi], dtype=torch.int64, device=hidden.device)
            chosen, ranks, top_ids, top_lp = select_logprobs(logprobs, targets, job.num_top)
            parts.append(
                Logprobs(
                    job.targets[lo:hi],
                    chosen,
                    ranks,
                    job.num_top,
                    [t for row in top_ids for t in row],
                    [v for row in top_lp for v in row],
                )
            )
        out[job.req_id] = PromptLogprobs(job.start, Logprobs.concat(parts))
    return out

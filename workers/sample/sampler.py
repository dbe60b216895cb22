"""Batched sampling: logits processors first (logit bias, min_tokens, penalties), then greedy rows
take the argmax; the others go through temperature, top-k, top-p and min-p, then an exponential
race whose noise depends only on (seed, sample index, token id).

The noise comes from a counter-based hash (tern's kernel on the CPU, else torch), so a request's
tokens are a function of its seed and its logits alone: the same text whatever batch it shares,
and again after preemption (the resumed request samples output token i with the same noise as
before). Picking argmax(p / E) with E ~ Exp(1) i.i.d. per token samples exactly from p. The masks
cut by value (masked_candidates), so their candidates do not depend on the batch either. Stop
strings, EOS and max_tokens are not the sampler's business.

On request (`Sampler.sample` with `logprob_rows`, for --logprobs-mode processed_logprobs) it also
returns the log-probabilities of the distribution each row was drawn from, as vLLM defines them:
the log_softmax of the very candidate logits it sampled from (processors, temperature, masks;
masked tokens -inf). Greedy rows: at temperature 0, the log_softmax of the processed logits without
temperature or masks (vLLM's all-greedy branch); with top_k 1 at a positive temperature, a point
mass on the argmax (vLLM samples those through a top-1 mask).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch
from torch import nn

from enginecore.messages import SamplingParams
from workers.kernels import sampling_ops
from workers.sample.logits_processors import (
    LogitsProcessorTensors,
    TokenHistory,
    apply_logits_processors,
)

_MASK32 = 0xFFFFFFFF
_Int = TypeVar("_Int", int, torch.Tensor)  # the hash runs on int64 tensors and on plain ints
# SamplingParams.is_greedy's bound (vLLM's _SAMPLING_EPS): a temperature at or below it is greedy.
_ZERO_TEMPERATURE = 1e-5


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of one step, as tensors on the logits' device."""

    temperature: torch.Tensor  # (N,) float32; 1.0 on greedy rows
    top_k: torch.Tensor  # (N,) int64; vocab size when disabled, 1 on greedy rows
    top_p: torch.Tensor  # (N,) float32
    min_p: torch.Tensor  # (N,) float32
    row_keys: torch.Tensor  # (N,) int64 hash of (seed, sample index), below 2^32
    is_greedy: torch.Tensor  # (N,) bool
    all_greedy: bool
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    max_top_k: int  # the largest top_k of the batch (vocab size if some row samples from all)
    # Logit bias, min_tokens, penalties...: applied first, to greedy rows too; None when unused.
    processors: LogitsProcessorTensors | None = None
    # Host copies of the two kinds of greedy rows, which processed logprobs tell apart.
    is_zero_temperature: list[bool] = field(default_factory=list)
    is_top_k_one: list[bool] = field(default_factory=list)  # greedy by top_k 1 alone

    def select(self, rows: torch.Tensor) -> SamplingTensors:
        """The parameters of `rows` (their logits processors left out: applied before masks)."""
        picked = rows.tolist()
        return dataclasses.replace(
            self,
            temperature=self.temperature[rows],
            top_k=self.top_k[rows],
            top_p=self.top_p[rows],
            min_p=self.min_p[rows],
            row_keys=self.row_keys[rows],
            is_greedy=self.is_greedy[rows],
            max_top_k=int(self.top_k[rows].max()),
            processors=None,
            is_zero_temperature=[self.is_zero_temperature[i] for i in picked],
            is_top_k_one=[self.is_top_k_one[i] for i in picked],
        )

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        sample_indices: list[int],
        vocab_size: int,
        device: torch.device,
        histories: list[TokenHistory | None] | None = None,
        bitmasks: list[bytes | None] | None = None,
    ) -> SamplingTensors:
        """`histories`: each row's tokens, needed by the rows with penalties. `bitmasks`: each
        row's grammar bitmask, for structured output."""
        if any(p.seed is None for p in params):
            raise ValueError("every request needs a sampling seed (the engine core assigns one)")
        greedy = [p.is_greedy for p in params]
        # Greedy rows take the argmax anyway: top_k 1 keeps them from forcing a full sort.
        top_k = [
            1 if g else vocab_size if p.top_k <= 0 else min(p.top_k, vocab_size)
            for p, g in zip(params, greedy)
        ]
        seeds = [p.seed & 0xFFFFFFFFFFFFFFFF for p in params]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        row_keys = tensor([row_key(s, i) for s, i in zip(seeds, sample_indices)], torch.int64)
        sampled = [p for p, g in zip(params, greedy) if not g]
        return cls(
            temperature=tensor(
                [1.0 if g else p.temperature for p, g in zip(params, greedy)], torch.float32
            ),
            top_k=tensor(top_k, torch.int64),
            top_p=tensor([p.top_p for p in params], torch.float32),
            min_p=tensor([p.min_p for p in params], torch.float32),
            row_keys=row_keys,
            is_greedy=tensor(greedy, torch.bool),
            all_greedy=all(greedy),
            use_top_k=any(0 < p.top_k < vocab_size for p in sampled),
            use_top_p=any(p.top_p < 1.0 for p in sampled),
            use_min_p=any(p.min_p > 0.0 for p in sampled),
            max_top_k=max(top_k),
            is_zero_temperature=[p.temperature <= _ZERO_TEMPERATURE for p in params],
            is_top_k_one=[g and p.temperature > _ZERO_TEMPERATURE for p, g in zip(params, greedy)],
            processors=LogitsProcessorTensors.build(
                params,
                sample_indices,
                histories or [None] * len(params),
                vocab_size,
                device,
                bitmasks,
            ),
        )


def _mulmod32(x: _Int, c: int) -> _Int:
    """(x * c) mod 2^32 for x < 2^32, with every int64 intermediate below 2^49."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def mix32(x: _Int) -> _Int:
    """MurmurHash3's 32-bit finaliser on int64 tensors, or ints, holding values below 2^32."""
    x = x ^ (x >> 16)
    x = _mulmod32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mulmod32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def row_key(seed: int, sample_index: int) -> int:
    """The 32-bit key of (a 64-bit seed, a sample index): plain ints, a batch's few rows cost
    less than a dozen tensor operations."""
    h = mix32((seed & _MASK32) ^ 0x9E3779B9)
    h = mix32(h ^ (seed >> 32))
    return mix32(h ^ (sample_index & _MASK32))


def exponential_noise(row_keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise (N, K) float32 for token ids (N, K) or (K,): a pure function of (row key, id)."""
    u = sampling_ops.exponential_uniforms(row_keys, token_ids)  # the same bits, ~30x faster
    if u is None:
        h = mix32(row_keys[:, None] ^ mix32(token_ids + 0x632BE5AB))
        # 24 bits fit a float32 exactly; +0.5 keeps u above 0.
        u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    # NOTE: the largest u rounds to 1.0 in float32: the clamp keeps the noise positive, else a
    # masked token (probability 0) would score 0 / 0 = NaN, which argmax picks.
    return (-torch.log(u)).clamp_min(2.0**-25)


# Candidates taken first when top-p or min-p apply over (nearly) the whole vocabulary: sorting all
# of it is 17 ms for 32 rows of 49152 tokens here, the largest TRUNCATED_CANDIDATES + 1 3.5 ms.
# A row whose masks keep tokens past them is sorted whole, with the same result.
TRUNCATED_CANDIDATES = 1024
# The largest top-k torch.topk selects; past it numpy's partition does (CPU float32 logits).
SMALL_TOP_K = 256


def masked_candidates(
    logits: torch.Tensor, t: SamplingTensors
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens that may be sampled: (N, K) logits, -inf where a mask drops them, and their ids:
    (N, K) sorted descending, or (K,), the vocabulary in order (no mask applies, or some row's
    masks keep past the first candidates).

    Top-k keeps the row's top_k largest logits (and any tied with the last), renormalised; top-p
    then the smallest prefix whose mass reaches top_p (and any tied with its last); min-p the
    tokens of at least min_p times the largest probability. Every cut is by value, so tokens of
    equal logits are kept or dropped together whichever order a sort leaves them in: a row's
    candidates are the same from the truncated and the whole sort, so from any batch.
    """
    vocab_size = logits.size(-1)
    if not (t.use_top_k or t.use_top_p or t.use_min_p):
        return logits, torch.arange(vocab_size, device=logits.device)
    if not (t.use_top_p or t.use_min_p) or t.max_top_k <= TRUNCATED_CANDIDATES + 1:
        values, ids = _largest(logits, t.max_top_k)
        return values.masked_fill(~_keep(values, logits, t), float("-inf")), ids
    values, ids = _largest(logits, TRUNCATED_CANDIDATES + 1)
    keep = _keep(values, logits, t)
    whole = keep[:, -1] | ((t.top_k > TRUNCATED_CANDIDATES) & (t.top_k < vocab_size))
    if not bool(whole.any()):
        return values[:, :-1].masked_fill(~keep[:, :-1], float("-inf")), ids[:, :-1]
    # Some row's masks keep past the first candidates (or its top-k cut lies past them): each
    # row's cut value, those rows' from all their logits sorted, applied to the whole rows.
    rows = whole.nonzero().flatten()
    sorted_rows = _sorted(logits[rows])
    cut = _last_kept(values, keep)
    cut[rows] = _last_kept(sorted_rows, _keep(sorted_rows, logits[rows], t.select(rows)))
    return logits.masked_fill(logits < cut, float("-inf")), torch.arange(
        vocab_size, device=logits.device
    )


def _last_kept(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """(N, 1): each row's smallest kept value (the kept values are a prefix of the sorted)."""
    return values.gather(1, (keep.sum(dim=-1, keepdim=True) - 1).clamp(min=0))


def _sorted(logits: torch.Tensor) -> torch.Tensor:
    """The rows' logits sorted descending (numpy's sort on the CPU: 32 rows of 49152 here 3 ms,
    torch.sort 47)."""
    if not logits.is_cpu or logits.dtype != torch.float32:
        return logits.sort(dim=-1, descending=True).values
    return torch.from_numpy(-np.sort(-logits.detach().numpy(), axis=-1))


def _largest(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k largest logits, sorted descending, and their ids (ties in any order)."""
    if not logits.is_cpu or logits.dtype != torch.float32 or k <= SMALL_TOP_K:
        return logits.topk(k, dim=-1) if k < logits.size(-1) else logits.sort(-1, descending=True)
    # numpy's partition and sort: 32 rows of 49152 here 3.5 ms for the largest 1025 (torch.topk
    # 6.7), 17 ms for all (torch.sort 47)
    neg = -logits.detach().numpy()
    if k < neg.shape[-1]:
        part = np.argpartition(neg, k - 1, axis=-1)[:, :k]
        order = np.take_along_axis(part, np.argsort(np.take_along_axis(neg, part, -1), -1), -1)
    else:
        order = np.argsort(neg, axis=-1)
    ids = torch.from_numpy(order)
    return logits.gather(1, ids), ids


def _keep(values: torch.Tensor, logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Which of the largest logits `values` (N, K, sorted descending) the masks keep, each row's
    answer taken from its values and its whole row alone."""
    vocab_size, k = logits.size(-1), values.size(-1)
    every = t.top_k >= vocab_size  # rows without a top-k
    # The top_k cut, the row's top_k-th value (-inf without one): ties with it stay.
    cut = values.gather(1, (t.top_k.clamp(max=k) - 1)[:, None])
    keep = values >= cut.masked_fill(every[:, None], float("-inf"))
    if not (t.use_top_p or t.use_min_p):
        return keep
    # Each row's normaliser, over its whole row without a top-k, else over the values top-k
    # keeps: those among the first TRUNCATED_CANDIDATES + 1 when they all lie there (the sum
    # then the same whether the caller sorted more or not).
    masked = values.masked_fill(~keep, float("-inf"))
    head = min(k, TRUNCATED_CANDIDATES + 1)
    log_norm = masked[:, :head].logsumexp(dim=-1)
    if k > head:
        past_head = keep[:, head:].any(dim=-1) & ~every
        if bool(past_head.any()):
            log_norm = torch.where(past_head, masked.logsumexp(dim=-1), log_norm)
    if bool(every.any()):
        log_norm = torch.where(every, logits.logsumexp(dim=-1), log_norm)
    probs = (values - log_norm[:, None]).exp().masked_fill(~keep, 0.0)
    if t.use_top_p:
        # The smallest prefix whose mass reaches top_p (a token goes when the mass before it
        # already does; the top token always stays), then the values tied with its last.
        mass_before = probs.cumsum(dim=-1) - probs
        kept_prefix = keep & (mass_before < t.top_p[:, None])
        kept_prefix[:, 0] = True
        last = values.gather(1, kept_prefix.sum(dim=-1, keepdim=True) - 1)
        keep &= values >= last
    if t.use_min_p:
        keep &= probs >= t.min_p[:, None] * probs[:, :1]
    return keep


@dataclass
class _Draw:
    """What the sampled rows were drawn from: candidates (N, K) and their ids (N, K), or (K,)."""

    cand_logits: torch.Tensor  # temperature applied, masked candidates -inf
    cand_ids: torch.Tensor


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        """Logits (N, V) float32 -> sampled token ids (N,) int64."""
        return self.sample(logits, t)[0]

    def sample(
        self, logits: torch.Tensor, t: SamplingTensors, logprob_rows: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (N, V) float32 -> sampled token ids (N,) int64, and for `logprob_rows` (if any)
        the processed logprobs (R, V) float32: log p under the distribution each row was drawn
        from (see the module docstring)."""
        if t.processors is not None:
            logits = apply_logits_processors(logits, t.processors)
        # NOTE: max().indices, not argmax(): the same first index of the maximum, 2.5-5x faster
        # on the CPU (32 x 49152 bfloat16 logits: 0.5 against 2.5 ms).
        greedy_tokens = logits.max(dim=-1).indices
        sampled, draw = greedy_tokens, None
        if not t.all_greedy:
            draw = _draw_candidates(logits, t)
            probs = draw.cand_logits.softmax(dim=-1)
            noise = exponential_noise(t.row_keys, draw.cand_ids)
            pick = (probs / noise).argmax(dim=-1, keepdim=True)
            drawn = draw.cand_ids.expand_as(probs).gather(-1, pick).squeeze(-1)
            sampled = torch.where(t.is_greedy, greedy_tokens, drawn)
        if not logprob_rows:
            return sampled, None
        return sampled, processed_logprobs(logits, greedy_tokens, draw, t, logprob_rows)


def _draw_candidates(logits: torch.Tensor, t: SamplingTensors) -> _Draw:
    """Temperature, then the candidates and their top-k / top-p / min-p masks."""
    return _Draw(*masked_candidates(logits / t.temperature[:, None], t))


def processed_logprobs(
    logits: torch.Tensor,
    greedy_tokens: torch.Tensor,
    draw: _Draw | None,
    t: SamplingTensors,
    rows: list[int],
) -> torch.Tensor:
    """(R, V) float32 log-probabilities of the distributions rows `rows` were drawn from.

    `logits` (N, V): after the processors, before temperature. `draw`: None when all are greedy.
    """
    vocab_size = logits.size(-1)
    device = logits.device
    parts: list[tuple[list[int], torch.Tensor]] = []  # (positions in `rows`, their logprobs)
    zero_t = [j for j, i in enumerate(rows) if t.is_zero_temperature[i]]
    if zero_t:
        parts.append((zero_t, logits[_index([rows[j] for j in zero_t], device)].log_softmax(-1)))
    top_one = [j for j, i in enumerate(rows) if t.is_top_k_one[i]]
    if top_one:
        point = logits.new_full((len(top_one), vocab_size), float("-inf"))
        point.scatter_(1, greedy_tokens[_index([rows[j] for j in top_one], device)][:, None], 0.0)
        parts.append((top_one, point))
    drawn = [j for j, i in enumerate(rows) if not (t.is_zero_temperature[i] or t.is_top_k_one[i])]
    if drawn:
        assert draw is not None, "a row that samples needs the candidates it was drawn from"
        index = _index([rows[j] for j in drawn], device)
        cand_lp = draw.cand_logits[index].log_softmax(dim=-1)  # (D, K)
        if draw.cand_ids.dim() == 1:  # every token a candidate, in vocabulary order
            parts.append((drawn, cand_lp))
        else:
            full = logits.new_full((len(drawn), vocab_size), float("-inf"))
            parts.append((drawn, full.scatter_(1, draw.cand_ids[index], cand_lp)))
    if len(parts) == 1:
        return parts[0][1]
    out = logits.new_empty(len(rows), vocab_size)
    for positions, values in parts:
        out[_index(positions, device)] = values
    return out


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)

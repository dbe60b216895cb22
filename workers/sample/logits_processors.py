"""What changes the logits before sampling, batched: allowed tokens, logit bias, min_tokens, and the
repetition, frequency and presence penalties.

Order and meaning follow vLLM, whose definitions are Hugging Face's and OpenAI's:
0. the grammar's token bitmask (structured output, computed by the engine core): tokens whose bit
   is clear get -inf;
1. allowed_token_ids: every other token gets -inf;
2. logit_bias: logits[t] += bias[t];
3. suppressed tokens (Hugging Face's SuppressTokens / SuppressTokensAtBegin: always, or at the
   first output token) get -inf, and so do EOS and stop_token_ids while fewer than min_tokens
   tokens were sampled; then Whisper's timestamp rule (messages.TimestampRule), as Hugging
   Face's WhisperTimeStampLogitsProcessor, which follows the suppression there too;
4. repetition penalty, as Hugging Face's RepetitionPenaltyLogitsProcessor, over every token of the
   prompt and of the output so far: a positive logit is divided by the penalty, another multiplied;
5. frequency and presence penalties, as OpenAI's, over output tokens only:
   logits[t] -= frequency * count[t] + presence * (count[t] > 0).
Logprobs see all of this only with --logprobs-mode processed_logprobs; by default they are
taken from the raw logits (workers/sample/logprobs.py).

The penalties need each request's tokens. The worker computes all of them except those the prefix
cache served, which the engine core sends with the request's state (ScheduledRequest.
history_token_ids). A `TokenHistory` keeps them with dense per-vocab counters updated as tokens
arrive, so a step costs O(rows x vocab) whatever the length of the histories.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from enginecore.messages import SamplingParams
from workers.kernels import sampling_ops


class TokenHistory:
    """One request's tokens (prompt, then outputs) and per-vocab counters over those computed."""

    def __init__(self, token_ids: list[int], num_prompt_tokens: int) -> None:
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = num_prompt_tokens
        self.num_computed = 0  # tokens in the KV cache (or served by the prefix cache)
        self._prompt_mask: torch.Tensor | None = None  # (V,) bool: occurs in the prompt
        self._output_counts: torch.Tensor | None = None  # (V,) float32: occurrences in the output
        self._num_counted = 0
        self._drafts: list[int] = []  # the last step's drafts, of which a prefix was accepted

    def extend(self, start_pos: int, token_ids: list[int], drafts: list[int] | None = None) -> None:
        """Records the tokens computed this step, at positions start_pos, start_pos + 1, ...;
        `drafts` (speculative decoding) follow them: those accepted show up as the gap before
        the next step's start_pos."""
        num_known = len(self.token_ids)
        gap = start_pos - num_known
        if 0 < gap <= len(self._drafts):
            self.token_ids.extend(self._drafts[:gap])
            num_known = start_pos
        self._drafts = list(drafts or [])
        if start_pos > num_known:
            raise ValueError(f"tokens at {start_pos} arrive before those from {num_known}")
        end = start_pos + len(token_ids)
        if end > num_known:
            self.token_ids.extend(token_ids[num_known - start_pos :])
        self.num_computed = end

    def set_drafts(self, drafts: list[int]) -> None:
        """The drafts that follow this step's tokens, when they are known only after extend()
        (a draft model proposes them on the workers)."""
        self._drafts = list(drafts)

    def counters(self, vocab_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt mask (V,) bool, output counts (V,) float32) over the tokens computed so far."""
        if self._prompt_mask is None or self._output_counts is None:
            self._prompt_mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self._output_counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        start, end = self._num_counted, self.num_computed
        if end > start:
            split = min(max(self.num_prompt_tokens, start), end)
            prompt = self.token_ids[start:split]
            if prompt:
                self._prompt_mask[torch.tensor(prompt, device=device)] = True
            output = self.token_ids[split:end]
            if output:
                ids = torch.tensor(output, device=device)
                self._output_counts.index_put_((ids,), torch.ones_like(ids, dtype=torch.float32),
                                               accumulate=True)  # fmt: skip
            self._num_counted = end
        return self._prompt_mask, self._output_counts


class DraftedHistory:
    """A request's history followed by drafts it has not computed: what the penalties of the
    position after them see (speculative decoding samples every drafted position)."""

    def __init__(self, base: TokenHistory, drafts: list[int]) -> None:
        self.base = base
        self.drafts = drafts

    def counters(self, vocab_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        prompt_mask, output_counts = self.base.counters(vocab_size, device)
        if not self.drafts:
            return prompt_mask, output_counts
        ids = torch.tensor(self.drafts, device=device)
        ones = torch.ones_like(ids, dtype=torch.float32)
        return prompt_mask, output_counts.clone().index_put_((ids,), ones, accumulate=True)


@dataclass
class LogitsProcessorTensors:
    """One step's logits processing, for the rows (of the sampling batch) it applies to."""

    grammar_rows: list[int] | None = None  # rows constrained by a grammar
    grammar_bitmask: torch.Tensor | None = None  # (G, ceil(V / 32)) int32, xgrammar's packing
    allowed_rows: torch.Tensor | None = None  # (A,) rows restricted to allowed_mask
    allowed_mask: torch.Tensor | None = None  # (A, V) bool
    bias_index: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids), (B,) each
    bias_values: torch.Tensor | None = None  # (B,) float32
    suppress_index: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) set to -inf
    # Whisper's timestamp rule (messages.TimestampRule): its rows, what each forbids, and the
    # rows whose timestamps' summed probability is compared with the best text token's.
    timestamp_rows: torch.Tensor | None = None  # (W,)
    timestamp_forbidden: torch.Tensor | None = None  # (W, V) bool
    timestamp_begin: torch.Tensor | None = None  # (W, 1) each row's first timestamp token
    penalty_rows: torch.Tensor | None = None  # (P,) rows with a penalty
    seen_mask: torch.Tensor | None = None  # (P, V) bool: in the prompt or the output so far
    output_counts: torch.Tensor | None = None  # (P, V) float32
    repetition: torch.Tensor | None = None  # (P, 1)
    frequency: torch.Tensor | None = None  # (P, 1)
    presence: torch.Tensor | None = None  # (P, 1)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        sample_indices: list[int],
        histories: list[TokenHistory | None],
        vocab_size: int,
        device: torch.device,
        bitmasks: list[bytes | None] | None = None,
    ) -> LogitsProcessorTensors | None:
        """None when no row needs any processing (the common case costs nothing).

        `bitmasks`: each row's grammar bitmask (messages.GrammarBitmasks), or None."""
        constrained = [i for i, b in enumerate(bitmasks or []) if b is not None]
        allowed = [i for i, p in enumerate(params) if p.allowed_token_ids]
        bias = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias.items()]
        suppress = [
            (i, t)
            for i, (p, n) in enumerate(zip(params, sample_indices))
            for t in _suppressed(p, n)
        ]
        penalized = [i for i, p in enumerate(params) if p.has_penalties]
        timed = [i for i, p in enumerate(params) if p.timestamps is not None]
        if not (constrained or allowed or bias or suppress or penalized or timed):
            return None
        t = cls()
        if constrained:
            assert bitmasks is not None
            t.grammar_rows = constrained
            t.grammar_bitmask = packed_bitmask(
                [bitmasks[i] for i in constrained], vocab_size, device
            )
        if allowed:
            t.allowed_rows = _ints(allowed, device)
            t.allowed_mask = torch.zeros(len(allowed), vocab_size, dtype=torch.bool, device=device)
            rows = [j for j, i in enumerate(allowed) for _ in params[i].allowed_token_ids]
            cols = [tok for i in allowed for tok in params[i].allowed_token_ids]
            t.allowed_mask[_ints(rows, device), _ints(cols, device)] = True
        if bias:
            t.bias_index = (
                _ints([i for i, _, _ in bias], device),
                _ints([k for _, k, _ in bias], device),
            )
            t.bias_values = _floats([b for _, _, b in bias], device)
        if suppress:
            t.suppress_index = (
                _ints([i for i, _ in suppress], device),
                _ints([k for _, k in suppress], device),
            )
        if timed:
            t._set_timestamps([params[i] for i in timed], [histories[i] for i in timed],
                              vocab_size, device)  # fmt: skip
            t.timestamp_rows = _ints(timed, device)
        if penalized:
            t._set_penalties([params[i] for i in penalized], [histories[i] for i in penalized],
                             vocab_size, device)  # fmt: skip
            t.penalty_rows = _ints(penalized, device)
        return t

    def _set_timestamps(
        self,
        params: list[SamplingParams],
        histories: list[TokenHistory | None],
        vocab_size: int,
        device: torch.device,
    ) -> None:
        """Each row's tokens the timestamp rule forbids, from its output so far."""
        forbidden = torch.zeros(len(params), vocab_size, dtype=torch.bool)
        begins = []
        for row, (p, history) in enumerate(zip(params, histories)):
            rule = p.timestamps
            assert rule is not None
            if history is None:
                raise ValueError("a request with Whisper timestamps needs its token history")
            begin = rule.timestamp_begin
            begins.append(begin)
            forbidden[row, rule.no_timestamps_token_id] = True
            out = history.token_ids[history.num_prompt_tokens :]
            last_was = len(out) >= 1 and out[-1] >= begin
            penultimate_was = len(out) < 2 or out[-2] >= begin
            if last_was:
                if penultimate_was:  # a pair just closed: text (or EOS) next
                    forbidden[row, begin:] = True
                else:  # a pair is open: its closing timestamp (or EOS)
                    forbidden[row, : rule.eos_token_id] = True
            stamps = [tok for tok in out if tok >= begin]
            if stamps:  # never decreasing; a closed pair's end may not open the next one
                last = stamps[-1] if last_was and not penultimate_was else stamps[-1] + 1
                forbidden[row, begin:last] = True
            if not out:  # the first token is a timestamp, no later than max_initial_index
                forbidden[row, :begin] = True
                if rule.max_initial_index is not None:
                    forbidden[row, begin + rule.max_initial_index + 1 :] = True
        self.timestamp_forbidden = forbidden.to(device)
        self.timestamp_begin = _ints(begins, device)[:, None]

    def _set_penalties(
        self,
        params: list[SamplingParams],
        histories: list[TokenHistory | None],
        vocab_size: int,
        device: torch.device,
    ) -> None:
        masks, counts = [], []
        for history in histories:
            if history is None:
                raise ValueError("a request with penalties needs its token history")
            prompt_mask, output_counts = history.counters(vocab_size, device)
            masks.append(prompt_mask | (output_counts > 0))
            counts.append(output_counts)
        self.seen_mask = torch.stack(masks)
        self.output_counts = torch.stack(counts)
        self.repetition = _floats([p.repetition_penalty for p in params], device)[:, None]
        self.frequency = _floats([p.frequency_penalty for p in params], device)[:, None]
        self.presence = _floats([p.presence_penalty for p in params], device)[:, None]


def _suppressed(p: SamplingParams, n: int) -> list[int]:
    """The tokens output token n of a request may not be."""
    tokens = list(p.suppress_token_ids)
    if n == 0:
        tokens += p.begin_suppress_token_ids
    if n < p.min_tokens:
        tokens += p.eos_token_ids + p.stop_token_ids
    return list(dict.fromkeys(tokens))


def packed_bitmask(rows: list[bytes], vocab_size: int, device: torch.device) -> torch.Tensor:
    """xgrammar's packed bitmasks (bit j of int32 word w: token 32 w + j) as a (R, W) tensor."""
    num_words = (vocab_size + 31) // 32
    if any(len(row) != 4 * num_words for row in rows):
        raise ValueError(f"a token bitmask for {vocab_size} ids has {4 * num_words} bytes")
    words = torch.frombuffer(bytearray(b"".join(rows)), dtype=torch.int32)
    return words.view(len(rows), num_words).to(device)


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """-inf, in place, for the tokens the grammar forbids: bitmask[i] is logits[rows[i]]'s."""
    if logits.is_cpu and sampling_ops.apply_token_bitmask(logits, bitmask, rows):
        return  # NOTE: 10x faster than a (rows, vocab) bool mask: whole words at a time
    words = bitmask.to(logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, : logits.size(1)]
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    logits[index] = logits[index].masked_fill(allowed == 0, float("-inf"))


def _apply_timestamp_rule(logits: torch.Tensor, t: LogitsProcessorTensors) -> None:
    """Whisper's rule on its rows, in place: the forbidden tokens, then text tokens too where the
    timestamps' summed probability beats every text token's (as Hugging Face, after the
    suppressed tokens)."""
    assert t.timestamp_rows is not None and t.timestamp_forbidden is not None
    assert t.timestamp_begin is not None
    rows = logits[t.timestamp_rows].masked_fill(t.timestamp_forbidden, float("-inf"))
    logprobs = torch.log_softmax(rows, dim=-1)
    is_stamp = torch.arange(rows.size(1), device=rows.device)[None, :] >= t.timestamp_begin
    stamp_mass = logprobs.masked_fill(~is_stamp, float("-inf")).logsumexp(dim=-1)
    best_text = logprobs.masked_fill(is_stamp, float("-inf")).max(dim=-1).values
    rows = rows.masked_fill((stamp_mass > best_text)[:, None] & ~is_stamp, float("-inf"))
    logits[t.timestamp_rows] = rows


def _ints(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _floats(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def apply_logits_processors(logits: torch.Tensor, t: LogitsProcessorTensors) -> torch.Tensor:
    """Logits (N, V) float32 -> processed logits (a new tensor; the input stays the raw logits)."""
    logits = logits.clone()
    if t.grammar_rows is not None:
        assert t.grammar_bitmask is not None
        apply_grammar_bitmask(logits, t.grammar_bitmask, t.grammar_rows)
    if t.allowed_rows is not None:
        assert t.allowed_mask is not None
        rows = logits[t.allowed_rows]
        logits[t.allowed_rows] = rows.masked_fill(~t.allowed_mask, float("-inf"))
    if t.bias_index is not None:
        assert t.bias_values is not None
        logits.index_put_(t.bias_index, t.bias_values, accumulate=True)
    if t.suppress_index is not None:
        logits[t.suppress_index] = float("-inf")
    if t.timestamp_rows is not None:
        _apply_timestamp_rule(logits, t)
    if t.penalty_rows is not None:
        assert t.seen_mask is not None and t.output_counts is not None
        assert t.repetition is not None and t.frequency is not None and t.presence is not None
        # Only the tokens a row has seen change (unseen ones have no output count either): the
        # (row, token) pairs of its mask, not (P, V) (32 rows of 49152: 6.4 -> ~1 ms).
        pair_rows, tokens = t.seen_mask.nonzero(as_tuple=True)
        rows = t.penalty_rows[pair_rows]
        values, repetition = logits[rows, tokens], t.repetition[pair_rows, 0]
        values = torch.where(values > 0, values / repetition, values * repetition)
        counts = t.output_counts[pair_rows, tokens]
        values = (
            values - t.frequency[pair_rows, 0] * counts - t.presence[pair_rows, 0] * (counts > 0)
        )
        logits[rows, tokens] = values
    return logits

"""Draft tokens for speculative decoding, proposed in the engine core from token ids alone.

A decoding sequence's step computes its last token plus k drafted ones; the workers sample every
one of those k + 1 positions as plain decoding would have, and keep the drafts up to the first that
differs from the token sampled before it (workers/spec/verification.py). The drafters here:

- `ngram` (prompt lookup): the latest earlier occurrence of the sequence's last n tokens
  (prompt_lookup_max down to prompt_lookup_min) in its prompt and output, and what followed it; a
  match that runs into the end of the sequence repeats with its period.
- `draft_model` and `mtp`: a small model (workers/spec/draft_model.py) or the served checkpoint's own
  multi-token-prediction head (workers/spec/head_drafter.py) drafts on the workers; here only how many
  drafts each sequence gets is decided.
- `suffix` (suffix decoding, arXiv 2411.04975): suffix tries of bounded depth, one over the
  sequence's own prompt and output and one over the outputs of recently finished requests. The
  longest suffix of the sequence found in a trie is extended by the most frequent continuation, as
  long as the estimated probability of the whole draft (the product of each step's count ratio)
  stays above suffix_decoding_min_token_prob. The trie whose draft scores higher is used.

How many of its drafts a sequence verifies is planned per step (`Drafter.plan`): each sequence
keeps an estimate of the chance that its next draft is accepted (accepted drafts and first
rejections, decayed, starting from the recent sequences'), so draft j is worth p^j expected
tokens; a step's time by its tokens is learnt from the decode steps' measured times, as a shape
by size times the machine's pace now, which every step updates (`StepCost`: a loaded machine
prices all sizes at its own pace, not the ones measured before the load came);
the drafts, most valuable first, are taken as far as maximises the step's expected tokens per
second. Copy-heavy sequences then verify long drafts, sequences whose drafts fail verify none (one
probe at a sequence's first proposal and then every PROBE_EVERY steps keeps their estimate
current), and a large batch, whose extra rows cost more, drafts less.
No drafts at all in a step running more sequences than disable_by_batch_size.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from enginecore.config import MODEL_DRAFT_METHODS, SpeculativeConfig

# Sequences in a step above which drafts stop paying on a CPU (scripts/bench_spec.py measures it):
# the verification rows of a batch this large cost as much as the decode steps they save.
SPEC_MAX_BATCH_DEFAULT = 8
# Per verification, what an acceptance estimate keeps of its past (a few steps' memory).
ACCEPTANCE_DECAY = 0.9
# The same over every sequence's verifications: where a new sequence's estimate starts.
GLOBAL_DECAY = 0.98
# A sequence none of whose drafts were worth verifying gets one every this many steps.
PROBE_EVERY = 16
# Suffix decoding's tries hold up to depth nodes per token (Python objects, ~0.2 KB each): a
# sequence's own trie indexes its first SUFFIX_SEQUENCE_TOKENS tokens, the shared trie at most
# SUFFIX_CACHE_TOKENS tokens of finished outputs (the oldest outputs go first).
SUFFIX_SEQUENCE_TOKENS = 8192
SUFFIX_CACHE_TOKENS = 65536
# Before the first measured steps: one more token in a step costs this share of a 1-token step
# (2-core CPUs, the default model: 0.06-0.09).
PRIOR_TOKEN_COST = 0.08
# How far one step moves StepCost's estimate of the machine's pace (a few steps to follow a load).
PACE_RATE = 0.3
SHAPE_STEPS = 32.0


@dataclass
class SpecDecodeStats:
    """Totals since start (Prometheus counters, vLLM's spec_decode_* names)."""

    num_drafts: int = 0  # sequence-steps that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # accepted at draft position i


class NgramIndex:
    """Where each n-gram (prompt_lookup_min <= n <= prompt_lookup_max) of a sequence last ended,
    excluding the sequence's current suffix itself; updated as tokens arrive."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.sizes = range(max_n, min_n - 1, -1)  # longest first
        self._ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self._num_indexed = 0  # n-grams ending before this position are indexed

    def _sync(self, tokens: list[int]) -> None:
        # NOTE: the n-grams ending at len(tokens) stay out: they are the pattern looked up.
        for end in range(max(self._num_indexed, 1), len(tokens)):
            for n in self.sizes:
                if end >= n:
                    self._ends[n][tuple(tokens[end - n : end])] = end
        self._num_indexed = max(self._num_indexed, len(tokens))

    def propose(self, tokens: list[int], k: int) -> list[int]:
        self._sync(tokens)
        length = len(tokens)
        for n in self.sizes:
            if length <= n:
                continue
            start = self._ends[n].get(tuple(tokens[length - n :]))
            if start is None:
                continue
            draft: list[int] = []
            for i in range(k):
                pos = start + i
                draft.append(tokens[pos] if pos < length else draft[pos - length])
            return draft
        return []


class SuffixTrie:
    """Counts of every substring of at most `depth` tokens of the sequences added to it. A node
    is [count, children]; count: occurrences of the substring the path from the root spells."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root: list = [0, {}]

    def extend(self, active: list[list], token: int) -> list[list]:
        """Adds the substrings ending with a new token; `active`: the nodes of the substrings
        ending just before it (from the last call, [] at a sequence's start)."""
        nodes = []
        for node in [self.root, *active[: self.depth - 1]]:
            child = node[1].get(token)
            if child is None:
                child = node[1][token] = [0, {}]
            child[0] += 1
            nodes.append(child)
        return nodes

    def add(self, tokens: list[int]) -> None:
        active: list[list] = []
        for t in tokens:
            active = self.extend(active, t)

    def remove(self, tokens: list[int]) -> None:
        """Takes back a sequence add() put in (its substrings' counts; empty nodes go)."""
        for start in range(len(tokens)):
            node = self.root
            for t in tokens[start : start + self.depth]:
                child = node[1][t]
                child[0] -= 1
                if child[0] == 0:
                    del node[1][t]
                    break
                node = child

    def propose(
        self, context: list[int], k: int, factor: float, min_prob: float
    ) -> tuple[list[int], float]:
        """The draft after the longest suffix of `context` that occurred followed by something,
        and its expected accepted length (the sum of the running probability estimates)."""
        longest = min(len(context), self.depth - 1)
        for m in range(longest, 0, -1):
            node = self.root
            for t in context[len(context) - m :]:
                node = node[1].get(t)
                if node is None:
                    break
            if node is None or not node[1]:
                continue
            draft: list[int] = []
            prob, score = 1.0, 0.0
            limit = min(k, max(1, int(factor * m)), self.depth - m)
            while node[1] and len(draft) < limit:
                token, child = max(node[1].items(), key=lambda item: item[1][0])
                prob *= child[0] / node[0]
                if prob < min_prob:
                    break
                draft.append(token)
                score += prob
                node = child
            return draft, score
        return [], 0.0


class StepCost:
    """A step's time by its number of tokens, as the machine runs now: a shape (each size's
    recent mean time, in units of the machine's pace when it was measured) times the pace (how
    slow the machine runs now, updated by every step).

    The shape is no line (the kernels' paths change with the rows: on some CPUs 2 rows cost what
    1 does and 3 half as much again): sizes measured are interpolated, and past the largest each
    token adds PRIOR_TOKEN_COST of a 1-token step (optimistic, so that longer drafts get tried and
    measured). The pace is what keeps sizes seen long ago current: when another process takes the
    cores, the steps of the sizes now run say so within a few steps, and every size is priced at
    the new pace, not at the quiet machine's times it was last measured at."""

    def __init__(self) -> None:
        self._shape: dict[int, tuple[float, float]] = {}  # tokens -> (weight, mean at pace 1)
        self.pace = 1.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        known = self._shape.get(num_tokens)
        if known is not None:  # the machine's pace now, from a size whose shape is known
            self.pace += PACE_RATE * (seconds / known[1] - self.pace)
        weight, mean = known or (0.0, 0.0)
        # The shape learns slowly (the mean of about the last SHAPE_STEPS steps of this size) and
        # the pace fast, so that a load shows in the pace, not in the shape of the sizes it hits.
        weight = min(weight + 1, SHAPE_STEPS)
        self._shape[num_tokens] = (weight, mean + (seconds / self.pace - mean) / weight)

    def seconds(self, num_tokens: int) -> float:
        """The time of a step of `num_tokens` now (relative units before any was measured)."""
        return self.pace * self._shape_at(num_tokens)

    def _shape_at(self, num_tokens: int) -> float:
        known = self._shape
        if num_tokens in known:
            return known[num_tokens][1]
        if not known:
            return 1 + PRIOR_TOKEN_COST * (num_tokens - 1)
        below = max((n for n in known if n < num_tokens), default=None)
        above = min((n for n in known if n > num_tokens), default=None)
        if below is not None and above is not None:
            lo, hi = known[below][1], known[above][1]
            return lo + (hi - lo) * (num_tokens - below) / (above - below)
        per_token = (
            PRIOR_TOKEN_COST * known[min(known)][1] / (1 + PRIOR_TOKEN_COST * (min(known) - 1))
        )
        if below is not None:
            return known[below][1] + per_token * (num_tokens - below)
        assert above is not None
        return max(known[above][1] - per_token * (above - num_tokens), per_token)


class _Sequence:
    """A request's drafting state."""

    def __init__(self) -> None:
        self.hits = 0.0  # accepted drafts, decayed
        self.misses = 0.0  # verifications that ended on a rejected draft, decayed
        # A new sequence's first proposal is probed: its own record starts at once, even when the
        # recent sequences' record says drafts do not pay (they may have drafted from elsewhere).
        self.steps_without_drafts = PROBE_EVERY - 1
        self.ngrams: NgramIndex | None = None
        self.trie: SuffixTrie | None = None
        self.trie_nodes: list[list] = []
        self.num_in_trie = 0


class Drafter:
    def __init__(self, config: SpeculativeConfig) -> None:
        assert config.enabled
        self.config = config
        self.max_k = config.num_speculative_tokens
        self.on_workers = config.method in MODEL_DRAFT_METHODS  # the workers draft with a model
        self.max_batch = config.disable_by_batch_size or SPEC_MAX_BATCH_DEFAULT
        self.cost = StepCost()
        self._hits = self._misses = 0.0  # over all sequences, decayed (new sequences' prior)
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * self.max_k)
        self._sequences: dict[str, _Sequence] = {}
        depth = config.suffix_decoding_max_tree_depth
        self._global = SuffixTrie(depth) if config.method == "suffix" else None
        self._cached: OrderedDict[str, list[int]] = OrderedDict()  # outputs in the global trie
        self._num_cached_tokens = 0

    def draft(self, request_id: str, tokens: list[int], limit: int) -> list[int]:
        """Up to min(limit, num_speculative_tokens) drafts to follow `tokens` (prompt + outputs)."""
        seq = self._sequences.get(request_id)
        if seq is None:
            seq = self._sequences[request_id] = _Sequence()
        k = min(limit, self.max_k)
        if k <= 0:
            return []
        c = self.config
        if self.on_workers:  # the workers draft: only how many is decided here
            return [0] * k
        if c.method == "ngram":
            if seq.ngrams is None:
                seq.ngrams = NgramIndex(c.prompt_lookup_min, c.prompt_lookup_max)
            return seq.ngrams.propose(tokens, k)
        if seq.trie is None:
            seq.trie = SuffixTrie(c.suffix_decoding_max_tree_depth)
        # NOTE: past SUFFIX_SEQUENCE_TOKENS a long sequence stops growing its trie; its latest
        # tokens still make the pattern looked up.
        for t in tokens[seq.num_in_trie : SUFFIX_SEQUENCE_TOKENS]:
            seq.trie_nodes = seq.trie.extend(seq.trie_nodes, t)
        seq.num_in_trie = len(tokens)
        context = tokens[-(c.suffix_decoding_max_tree_depth - 1) :]
        args = (k, c.suffix_decoding_max_spec_factor, c.suffix_decoding_min_token_prob)
        own, own_score = seq.trie.propose(context, *args)
        assert self._global is not None
        shared, shared_score = self._global.propose(context, *args)
        return own if own_score >= shared_score else shared

    def acceptance(self, request_id: str) -> float:
        """The estimated chance that the sequence's next draft is accepted: its own record on
        top of the recent sequences' (what a new one starts from)."""
        prior = (self._hits + 1) / (self._hits + self._misses + 2)
        seq = self._sequences.get(request_id)
        if seq is None:
            return prior
        return (seq.hits + 2 * prior) / (seq.hits + seq.misses + 2)

    def plan(self, proposals: dict[str, list[int]], num_sequences: int) -> dict[str, int]:
        """How many of its proposed drafts each sequence verifies this step, `num_sequences`
        decoding in it: the drafts in order of their expected worth (p^j for a sequence's j-th),
        as many of them as maximise the step's expected tokens per second."""
        worth: list[tuple[float, str]] = []
        for request_id, drafts in proposals.items():
            p = self.acceptance(request_id)
            worth += [(p**j, request_id) for j in range(1, len(drafts) + 1)]
        worth.sort(key=lambda item: -item[0])
        tokens = float(num_sequences)
        best, best_rate = 0, tokens / self.cost.seconds(num_sequences)
        for n, (value, _) in enumerate(worth, 1):
            tokens += value
            rate = tokens / self.cost.seconds(num_sequences + n)
            if rate > best_rate:
                best, best_rate = n, rate
        counts = dict.fromkeys(proposals, 0)
        for _, request_id in worth[:best]:
            counts[request_id] += 1
        for request_id, n in counts.items():
            seq = self._sequences.setdefault(request_id, _Sequence())
            if n:
                seq.steps_without_drafts = 0
                continue
            seq.steps_without_drafts += 1
            if seq.steps_without_drafts >= PROBE_EVERY:  # keep the estimate current
                counts[request_id], seq.steps_without_drafts = 1, 0
        return counts

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verified step: counts it and updates the sequence's acceptance estimate."""
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            s.accepted_per_pos[i] += 1
        missed = num_accepted < num_drafts
        self._hits = GLOBAL_DECAY * self._hits + num_accepted
        self._misses = GLOBAL_DECAY * self._misses + missed
        seq = self._sequences.setdefault(request_id, _Sequence())
        seq.steps_without_drafts = 0
        seq.hits = ACCEPTANCE_DECAY * seq.hits + num_accepted
        seq.misses = ACCEPTANCE_DECAY * seq.misses + missed

    def finish(self, request_id: str, output_token_ids: list[int]) -> None:
        """The request ended: its state goes; suffix decoding keeps its output for later ones."""
        self._sequences.pop(request_id, None)
        if self._global is None or not output_token_ids:
            return
        limit = self.config.suffix_decoding_max_cached_requests
        if limit == 0:
            return
        output = list(output_token_ids[-SUFFIX_CACHE_TOKENS:])
        self._global.add(output)
        self._cached[request_id] = output
        self._num_cached_tokens += len(output)
        while len(self._cached) > limit or self._num_cached_tokens > SUFFIX_CACHE_TOKENS:
            _, old = self._cached.popitem(last=False)
            self._global.remove(old)
            self._num_cached_tokens -= len(old)

"""Draft tokens for speculative decoding, proposed in the engine core from token ids alone.

A decoding sequence's step computes its last token plus k drafted ones; the workers sample every
one of those k + 1 positions as plain decoding would have, and keep the drafts up to the first that
differs from the token sampled before it (workers/speculative.py). The drafters here:

- `ngram` (prompt lookup): the latest earlier occurrence of the sequence's last n tokens
  (prompt_lookup_max down to prompt_lookup_min) in its prompt and output, and what followed it; a
  match that runs into the end of the sequence repeats with its period.
- `suffix` (suffix decoding, arXiv 2411.04975): suffix tries of bounded depth, one over the
  sequence's own prompt and output and one over the outputs of recently finished requests. The
  longest suffix of the sequence found in a trie is extended by the most frequent continuation, as
  long as the estimated probability of the whole draft (the product of each step's count ratio)
  stays above suffix_decoding_min_token_prob. The trie whose draft scores higher is used.

Each sequence adapts its k to what it gets accepted (`_adapt`), and no drafts are proposed in a
step running more sequences than disable_by_batch_size: there verification costs more than it saves.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from enginecore.config import SpeculativeConfig

# Sequences in a step above which drafts stop paying on a CPU (scripts/bench_spec.py measures it):
# the verification rows of a batch this large cost as much as the decode steps they save.
SPEC_MAX_BATCH_DEFAULT = 8


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


class _Sequence:
    """A request's drafting state."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.ngrams: NgramIndex | None = None
        self.trie: SuffixTrie | None = None
        self.trie_nodes: list[list] = []
        self.num_in_trie = 0


class Drafter:
    def __init__(self, config: SpeculativeConfig) -> None:
        assert config.enabled
        self.config = config
        self.max_k = config.num_speculative_tokens
        self.max_batch = config.disable_by_batch_size or SPEC_MAX_BATCH_DEFAULT
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * self.max_k)
        self._sequences: dict[str, _Sequence] = {}
        depth = config.suffix_decoding_max_tree_depth
        self._global = SuffixTrie(depth) if config.method == "suffix" else None
        self._cached: OrderedDict[str, list[int]] = OrderedDict()  # outputs in the global trie

    def draft(self, request_id: str, tokens: list[int], limit: int) -> list[int]:
        """Up to min(limit, the sequence's k) drafts to follow `tokens` (prompt + outputs)."""
        seq = self._sequences.get(request_id)
        if seq is None:
            seq = self._sequences[request_id] = _Sequence(self.max_k)
        k = min(limit, seq.k)
        if k <= 0:
            return []
        c = self.config
        if c.method == "ngram":
            if seq.ngrams is None:
                seq.ngrams = NgramIndex(c.prompt_lookup_min, c.prompt_lookup_max)
            return seq.ngrams.propose(tokens, k)
        if seq.trie is None:
            seq.trie = SuffixTrie(c.suffix_decoding_max_tree_depth)
        for t in tokens[seq.num_in_trie :]:
            seq.trie_nodes = seq.trie.extend(seq.trie_nodes, t)
        seq.num_in_trie = len(tokens)
        context = tokens[-(c.suffix_decoding_max_tree_depth - 1) :]
        args = (k, c.suffix_decoding_max_spec_factor, c.suffix_decoding_min_token_prob)
        own, own_score = seq.trie.propose(context, *args)
        assert self._global is not None
        shared, shared_score = self._global.propose(context, *args)
        return own if own_score >= shared_score else shared

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verified step: counts it and adapts the sequence's k."""
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            s.accepted_per_pos[i] += 1
        seq = self._sequences.get(request_id)
        if seq is not None:
            seq.k = self._adapt(seq.k, num_drafts, num_accepted)

    def _adapt(self, k: int, num_drafts: int, num_accepted: int) -> int:
        """Doubles k after a fully accepted draft, else follows what was accepted (at least 1,
        so a sequence keeps probing)."""
        if num_accepted == num_drafts:
            return min(self.max_k, max(2 * k, num_drafts + 1))
        return max(1, num_accepted + 1)

    def finish(self, request_id: str, output_token_ids: list[int]) -> None:
        """The request ended: its state goes; suffix decoding keeps its output for later ones."""
        self._sequences.pop(request_id, None)
        if self._global is None or not output_token_ids:
            return
        limit = self.config.suffix_decoding_max_cached_requests
        if limit == 0:
            return
        self._global.add(output_token_ids)
        self._cached[request_id] = list(output_token_ids)
        while len(self._cached) > limit:
            _, old = self._cached.popitem(last=False)
            self._global.remove(old)

"""Causal attention with grouped KV heads over the paged KV cache.

Each step the model runner builds one `AttentionMetadata` for the whole batch (prefill chunks and
decodes mixed) and passes it into `forward`. Every attention layer then
1. writes this step's K/V into its cache at `slot_mapping` (slot = block * block_size + offset), and
2. attends each sequence's queries over that sequence's whole context in the cache.
Step 2 serves two kinds of sequences, with no Python loop over sequences:
- single-token decodes (`DecodeGroup`): on the CPU a native kernel (linear_ops.py) reads each sequence's
  K/V straight from its cache blocks; elsewhere they take the padded path below with max_q = 1.
- the rest (`AttentionGroup`), in up to two groups of one `scaled_dot_product_attention` call each:
  prompts computed from their first token (no cached context) attend this step's own K/V, padded to
  (G, max_q), with `is_causal` (no mask, and the flash kernel skips the blocks above the diagonal);
  the others (later chunks, prefix-cache hits, prompts with bidirectional spans) gather whole
  cache blocks into a padded (G, max_blocks * block_size) context under a boolean mask.
Indices and masks are computed once per step and shared by all layers. The cache layout of one
layer is (2, num_blocks, block_size, num_kv_heads, head_dim).

A sliding-window layer (Mistral, Gemma's local layers) lets query position q see keys
q - window < k <= q, as Hugging Face's sliding mask; its masks are derived from the step's once per
window size and shared too; the decode kernel starts each sequence at its window. Layers with
logit softcapping (Gemma 2: tanh(s / cap) * cap on the scores, which SDPA cannot apply) compute
their prefill scores explicitly; the decode kernel caps its scores itself. So do layers with
attention sinks (gpt-oss: one learned logit per head that joins each query's softmax with no value,
so a query may attend to "nothing"): an extra score column in prefill, the kernel's starting point
in decode.

Some prompt spans attend bidirectionally (Gemma 3's image tokens, as Hugging Face's
`blockwise_overlay`): a query inside a span also sees the span's later keys, so its mask ends at the
span's end instead of at itself, while a sliding window still counts back from the query's own
position (HF: AND(window, OR(causal, span))). Their sequences take the masked group, never
`is_causal` nor decode rows; a step without spans builds exactly the tensors it did before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workers.kernels import attention_ops, kernel_library
from workers.quant import kv_int8


@dataclass
class AttentionGroup:
    """Sequences attended by one padded SDPA call."""

    q_gather: torch.Tensor  # (G * max_q,) flat token index of each padded query row (pads -> 0)
    q_rows: torch.Tensor  # (N,) padded rows that hold real queries ...
    q_tokens: torch.Tensor  # (N,) ... and the flat token each of them is
    # Context from the cache: (G, max_blocks) block of each sequence's context (pads -> 0) and
    # (G, 1, max_q, max_blocks * block_size) True where the query may attend. Both None for
    # sequences whose context is exactly their queries (causal over this step's own K/V).
    kv_blocks: torch.Tensor | None
    mask: torch.Tensor | None
    max_q: int
    # Causal groups whose G x max_q query rows are one contiguous run of the flat batch (no
    # padding): the run's first token, so that they are viewed rather than gathered.
    first_token: int | None = None
    # (G, max_q, 1) position of each query row, for sliding-window masks (None: fresh groups,
    # whose query rows are positions 0..max_q - 1).
    q_pos: torch.Tensor | None = None
    _window_masks: dict[int, torch.Tensor | None] = field(default_factory=dict)

    def window_mask(self, window: int) -> torch.Tensor | None:
        """The group's mask narrowed to keys within `window` of each query; None where a fresh
        group's queries all fit in the window (plain causal attention is then the same)."""
        if window not in self._window_masks:
            self._window_masks[window] = self._build_window_mask(window)
        return self._window_masks[window]

    def _build_window_mask(self, window: int) -> torch.Tensor | None:
        device = self.q_gather.device
        if self.mask is None:
            if self.max_q <= window:
                return None
            pos = torch.arange(self.max_q, device=device)
            diff = pos[:, None] - pos[None, :]
            return ((diff >= 0) & (diff < window))[None, None]  # (1, 1, max_q, max_q)
        kv_pos = torch.arange(self.mask.size(-1), device=device)
        mask = self.mask & (kv_pos[None, None, None, :] > self.q_pos[:, None] - window)
        # Padded query rows (discarded) must not be fully masked: SDPA would give NaN.
        return mask | ~mask.any(-1, keepdim=True)


@dataclass
class DecodeGroup:
    """Queries that each attend to their sequence's whole context up to themselves: the tokens
    of sequences that compute one token this step, and every token of those that verify drafts
    (a row per token, its context ending at it)."""

    q_tokens: torch.Tensor  # (G,) flat token index of each query
    block_tables: torch.Tensor  # (G, max_blocks) int32, its sequence's, padded with 0
    context_lens: torch.Tensor  # (G,) int32, its sequence's tokens up to and including it
    block_size: int
    is_whole_batch: bool  # the step's tokens are exactly these queries, in order

    @cached_property
    def padded(self) -> AttentionGroup:
        """The same queries for the padded SDPA path (built on first use, shared by layers)."""
        num, max_blocks = self.block_tables.shape
        kv_pos = torch.arange(max_blocks * self.block_size, device=self.q_tokens.device)
        mask = kv_pos[None, :] < self.context_lens[:, None].long()  # (G, max_ctx)
        return AttentionGroup(
            q_gather=self.q_tokens,
            q_rows=torch.arange(num, device=self.q_tokens.device),
            q_tokens=self.q_tokens,
            kv_blocks=self.block_tables.long(),
            mask=mask[:, None, None, :],
            max_q=1,
            q_pos=(self.context_lens.long() - 1)[:, None, None],
        )


@dataclass
class PrefillGroup:
    """Prompt chunks attended causally by the prefill kernel, straight from the cache: every
    sequence with several query tokens except those with bidirectional spans."""

    block_tables: torch.Tensor  # (P, max_blocks) int32
    q_start: torch.Tensor  # (P,) int32 flat index of each chunk's first token
    q_len: torch.Tensor  # (P,) int32 its tokens
    ctx_start: torch.Tensor  # (P,) int32 the position of its first token
    seqs: torch.Tensor  # (P,) int64 the sequences, for other KV-cache groups' tables
    max_context: int  # the longest context of them


@dataclass
class CrossAttentionCapture:
    """An encoder-decoder's cross-attention probabilities at chosen (layer, head) pairs, for the
    sequences of a step that ask (SamplingParams.cross_attention). `rows[i]`: sequence i's
    (tokens, pairs, encoder frames) float32; a rank fills the pairs of its own heads (zeros
    elsewhere: the runner sums them over the tensor-parallel group)."""

    heads: dict[int, list[tuple[int, int]]]  # sequence index -> its (layer, head) pairs
    rows: dict[int, torch.Tensor]


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step's batch; built by the model runner."""

    positions: torch.Tensor  # (T,) position of each token in its sequence
    slot_mapping: torch.Tensor  # (T,) cache slot where each token's K/V is written
    query_start_loc: torch.Tensor  # (B + 1,) offsets of each sequence's tokens in the flat batch
    context_lens: torch.Tensor  # (B,) tokens in the cache after this step, per sequence
    block_tables: torch.Tensor  # (B, max_blocks) int32, padded with 0
    groups: list[AttentionGroup]  # the sequences with several query tokens
    decode: DecodeGroup | None = None  # the sequences with one
    # The sequences of `groups` as the prefill kernel takes them (layers that run it), and the
    # groups it leaves to SDPA (those with bidirectional spans).
    prefill: PrefillGroup | None = None
    span_groups: list[AttentionGroup] = field(default_factory=list)
    native_step: Any = None  # fused_decode.StepBuffers, built by the first fused layer of the step
    # Per sequence, as Python ints (for layers that loop over sequences: linear attention).
    start_pos_list: list[int] = field(default_factory=list)
    query_len_list: list[int] = field(default_factory=list)
    # (B,) each sequence's row in the recurrent-state pools; set by the model runner (hybrid models).
    state_slots: torch.Tensor | None = None
    # (sequence index, tokens into its chunk, state-pool row): where the linear-attention layers
    # copy a sequence's states into a prefix-cache checkpoint (enginecore/state_checkpoints.py).
    state_saves: list[tuple[int, int, int]] = field(default_factory=list)
    # The sequences verifying drafts (their tokens after the first); set by the model runner
    # (hybrid models: their linear-attention states are kept per token, to take back rejections).
    draft_seqs: list[int] = field(default_factory=list)
    # The same step through each further KV-cache group's block tables (workers/models/kv_cache_groups.py).
    other_kv_groups: list[AttentionMetadata] = field(default_factory=list)
    # (3, T) each token's (temporal, height, width) rotary positions on models that rotate by
    # multimodal positions (M-RoPE), in a step with images; None otherwise (rotation by
    # `positions`). The KV-cache slot of a token is still that of its `positions`.
    mrope_positions: torch.Tensor | None = None
    # Encoder-decoder models (Whisper): per sequence, each decoder layer's cross-attention keys
    # and values over its audio, (H, S, D) each; set by the model runner (workers/runner/audio.py).
    cross_kv: list[list[tuple[torch.Tensor, torch.Tensor]]] | None = None
    # The sequences whose cross-attention probabilities are kept (word timestamps), set by the
    # model runner; the decoder layers fill it.
    cross_attention: CrossAttentionCapture | None = None

    def set_mrope_positions(self, mrope_positions: torch.Tensor | None) -> None:
        for meta in (self, *self.other_kv_groups):
            meta.mrope_positions = mrope_positions

    def for_kv_group(self, group: int) -> AttentionMetadata:
        """This step as the layers of KV-cache group `group` see it (their block tables)."""
        return self if group == 0 else self.other_kv_groups[group - 1]

    @cached_property
    def query_start_list(self) -> list[int]:
        """Each sequence's first token in the flat batch; derived once, on first use (hybrids)."""
        return self.query_start_loc[:-1].tolist()

    @cached_property
    def fresh_seqs(self) -> torch.Tensor:
        """(B,) uint8, 1 for the sequences computed from their first token (whose linear-attention
        states start from zeros); derived once, on first use (hybrids)."""
        return torch.tensor([s == 0 for s in self.start_pos_list], dtype=torch.uint8)


def build_attention_metadata(
    start_pos: list[int],
    query_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    other_group_tables: list[list[list[int]]] | None = None,
    decode_rows: list[bool] | None = None,
    bidirectional_spans: list[list[tuple[int, int]]] | None = None,
) -> AttentionMetadata:
    """Positions, slots, and per-group gather indices and masks for one step; with
    `other_group_tables` (each further KV-cache group's tables, per sequence) also the step as
    those groups' layers see it (`for_kv_group`). `decode_rows`: the sequences whose tokens are
    computed as decode queries, one row each (a few tokens verifying drafts: the decode kernels
    take them, not the prefill path). `bidirectional_spans`: per sequence, its prompt's spans
    (start position, length) whose tokens attend to each other both ways (`_spans_in_step`)."""
    spans = _spans_in_step(bidirectional_spans, start_pos, query_lens)
    if not other_group_tables and all(n == 1 for n in query_lens):
        return _decode_only_metadata(start_pos, block_tables, block_size, device)
    return _general_metadata(
        start_pos,
        query_lens,
        block_tables,
        block_size,
        device,
        other_group_tables,
        decode_rows,
        spans,
    )


def _spans_in_step(
    spans: list[list[tuple[int, int]]] | None, start_pos: list[int], query_lens: list[int]
) -> dict[int, list[tuple[int, int]]]:
    """{sequence: [(first, end) positions]} of the spans that change this step's attention. As HF
    groups runs of image tokens, touching spans are one span; a one-token span is plain causal,
    and a span outside the step's chunk changes none of its queries, so both are dropped."""
    found: dict[int, list[tuple[int, int]]] = {}
    for seq, seq_spans in enumerate(spans or []):
        merged: list[list[int]] = []
        for first, length in sorted(seq_spans):
            if merged and first <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], first + length)
            else:
                merged.append([first, first + length])
        chunk_first, chunk_end = start_pos[seq], start_pos[seq] + query_lens[seq]
        for first, end in merged:
            if end - first < 2 or end <= chunk_first or first >= chunk_end:
                continue
            if first < chunk_first or end > chunk_end:
                # NOTE: its queries in another step could not see all of its keys.
                raise ValueError(
                    f"sequence {seq}: bidirectional span [{first}, {end}) is split by the step's "
                    f"chunk [{chunk_first}, {chunk_end})"
                )
            found.setdefault(seq, []).append((first, end))
    return found


def _general_metadata(
    start_pos: list[int],
    query_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    other_group_tables: list[list[list[int]]] | None,
    decode_rows: list[bool] | None,
    spans: dict[int, list[tuple[int, int]]] | None = None,
) -> AttentionMetadata:
    step = _StepLayout.of(start_pos, query_lens, block_tables, block_size, spans or {}, device)
    num_seqs = len(query_lens)
    qsl = step.query_start_loc
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), step.q_lens)  # (T,)
    positions = step.starts[seq_of_token] + torch.arange(int(qsl[-1])) - qsl[seq_of_token]

    def slots_through(tables: torch.Tensor) -> torch.Tensor:
        return _slots(tables[seq_of_token], positions.unsqueeze(-1), block_size).squeeze(-1)

    # A decode row's context ends at itself: a sequence with spans never takes that path.
    as_rows = [r and i not in step.spans for i, r in enumerate(decode_rows or [False] * num_seqs)]
    decode_seqs = [i for i, n in enumerate(query_lens) if n == 1 or as_rows[i]]
    other_seqs = [i for i, n in enumerate(query_lens) if not (n == 1 or as_rows[i])]
    decode = decode_idx = None
    if decode_seqs:
        decode, decode_idx = step.decode_group(decode_seqs, is_whole_batch=not other_seqs)
    groups, cached_idx = step.masked_groups(other_seqs)
    prefill, span_groups, span_idx = step.kernel_groups(other_seqs)
    meta = AttentionMetadata(
        positions=positions.to(device),
        slot_mapping=slots_through(step.tables).to(device),
        query_start_loc=qsl.to(device),
        context_lens=torch.tensor(step.context_lens, dtype=torch.int64, device=device),
        block_tables=step.tables.to(device=device, dtype=torch.int32),
        groups=groups,
        decode=decode,
        prefill=prefill,
        span_groups=span_groups,
        start_pos_list=list(start_pos),
        query_len_list=list(query_lens),
    )
    # Further KV-cache groups: the same queries and masks, read through other block tables.
    for group_tables in other_group_tables or []:
        meta.other_kv_groups.append(
            _through_other_tables(
                meta, _padded_tables(group_tables), slots_through, decode_idx, cached_idx,
                span_idx, device,
            )
        )  # fmt: skip
    return meta


@dataclass
class _StepLayout:
    """A step's sequences as the general path's groups read them: where each starts and how many
    queries it has, its block table (padded), and the spans its attention is bidirectional in."""

    start_pos: list[int]
    query_lens: list[int]
    context_lens: list[int]
    tables: torch.Tensor  # (B, max_blocks)
    q_lens: torch.Tensor
    starts: torch.Tensor
    query_start_loc: torch.Tensor  # (B + 1,)
    block_size: int
    spans: dict[int, list[tuple[int, int]]]
    device: torch.device

    @classmethod
    def of(
        cls,
        start_pos: list[int],
        query_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        spans: dict[int, list[tuple[int, int]]],
        device: torch.device,
    ) -> _StepLayout:
        q_lens = torch.tensor(query_lens, dtype=torch.int64)
        query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int64)
        torch.cumsum(q_lens, 0, out=query_start_loc[1:])
        return cls(
            start_pos, query_lens, [s + q for s, q in zip(start_pos, query_lens)],
            _padded_tables(block_tables), q_lens, torch.tensor(start_pos, dtype=torch.int64),
            query_start_loc, block_size, spans, device,
        )  # fmt: skip

    def decode_group(
        self, decode_seqs: list[int], is_whole_batch: bool
    ) -> tuple[DecodeGroup, torch.Tensor]:
        """The rows the decode kernel computes (each query row of `decode_seqs` sees its context
        up to itself), and which sequence each row reads the block table of."""
        query_lens, start_pos = self.query_lens, self.start_pos
        row_seqs = [i for i in decode_seqs for _ in range(query_lens[i])]
        row_ctx = [start_pos[i] + j + 1 for i in decode_seqs for j in range(query_lens[i])]
        decode_idx = torch.tensor(row_seqs, dtype=torch.int64)
        decode_blocks = -(-max(row_ctx) // self.block_size)
        firsts = self.query_start_loc[torch.tensor(decode_seqs, dtype=torch.int64)].tolist()
        row_tokens = [f + j for f, i in zip(firsts, decode_seqs) for j in range(query_lens[i])]
        decode = DecodeGroup(
            q_tokens=torch.tensor(row_tokens, dtype=torch.int64, device=self.device),
            block_tables=self.tables[decode_idx, :decode_blocks].to(
                device=self.device, dtype=torch.int32
            ),
            context_lens=torch.tensor(row_ctx, dtype=torch.int32, device=self.device),
            block_size=self.block_size,
            is_whole_batch=is_whole_batch,
        )
        return decode, decode_idx

    def masked_groups(self, seqs: list[int]) -> tuple[list[AttentionGroup], torch.Tensor | None]:
        """The masked path's groups of the sequences `seqs`: the fresh prompts (no context in the
        cache, no spans) and the others (a context in the cache, or spans that plain causal
        attention cannot express), and which sequences the latter are."""
        groups, cached_idx = [], None
        fresh = [i for i in seqs if self.start_pos[i] == 0 and i not in self.spans]
        cached = [i for i in seqs if self.start_pos[i] != 0 or i in self.spans]
        if fresh:
            group = _build_fresh_group(fresh, self.query_lens, self.query_start_loc)
            groups.append(_to_device(group, self.device))
        if cached:
            groups.append(_to_device(self._cached_group(cached), self.device))
            cached_idx = torch.tensor(cached, dtype=torch.int64)
        return groups, cached_idx

    def kernel_groups(
        self, seqs: list[int]
    ) -> tuple[PrefillGroup | None, list[AttentionGroup], torch.Tensor | None]:
        """The prefill kernel's view of the sequences `seqs` without spans, on a CPU only (it
        reads caches in host memory); those with spans beside it as masked groups, and which
        sequences they are."""
        kernel_seqs = [i for i in seqs if i not in self.spans] if self.device.type == "cpu" else []
        if not kernel_seqs:
            return None, [], None
        prefill = _prefill_group(
            kernel_seqs, self.query_lens, self.context_lens, self.tables, self.start_pos,
            self.query_start_loc, self.block_size,
        )  # fmt: skip
        prefill = replace(
            prefill, **{f: getattr(prefill, f).to(self.device) for f in _PREFILL_FIELDS}
        )
        if not self.spans:
            return prefill, [], None
        span_seqs = [i for i in seqs if i in self.spans]
        span_group = _to_device(self._cached_group(span_seqs), self.device)
        return prefill, [span_group], torch.tensor(span_seqs, dtype=torch.int64)

    def _cached_group(self, seqs: list[int]) -> AttentionGroup:
        return _build_group(
            seqs, self.query_lens, self.context_lens, self.tables, self.starts,
            self.query_start_loc, self.block_size, self.spans,
        )  # fmt: skip


def _through_other_tables(
    meta: AttentionMetadata,
    t: torch.Tensor,
    slots_through: Callable[[torch.Tensor], torch.Tensor],
    decode_idx: torch.Tensor | None,
    cached_idx: torch.Tensor | None,
    span_idx: torch.Tensor | None,
    device: torch.device,
) -> AttentionMetadata:
    """`meta` for another KV-cache group: its padded block tables `t` in every place a table is
    read (the rows of each group are the sequences `*_idx` name)."""

    def rows(idx: torch.Tensor, width: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return t[idx, :width].to(device=device, dtype=dtype)

    decode, prefill = meta.decode, meta.prefill
    return replace(
        meta,
        slot_mapping=slots_through(t).to(device),
        block_tables=t.to(device=device, dtype=torch.int32),
        decode=None
        if decode is None
        else replace(
            decode, block_tables=rows(decode_idx, decode.block_tables.size(1), torch.int32)
        ),
        groups=[
            g
            if g.kv_blocks is None
            else replace(g, kv_blocks=rows(cached_idx, g.kv_blocks.size(1)))
            for g in meta.groups
        ],
        prefill=None
        if prefill is None
        else replace(
            prefill,
            block_tables=rows(prefill.seqs.cpu(), prefill.block_tables.size(1), torch.int32),
        ),
        span_groups=[
            replace(g, kv_blocks=rows(span_idx, g.kv_blocks.size(1))) for g in meta.span_groups
        ],
        other_kv_groups=[],
    )


def _decode_only_metadata(
    start_pos: list[int], block_tables: list[list[int]], block_size: int, device: torch.device
) -> AttentionMetadata:
    """build_attention_metadata of a step where every sequence computes one token (decode steps,
    one KV-cache group): the same tensors from Python ints, without the general path's dozens of
    small tensor operations."""
    num_seqs = len(start_pos)
    context_lens = [s + 1 for s in start_pos]
    slots = [
        t[s // block_size] * block_size + s % block_size for t, s in zip(block_tables, start_pos)
    ]
    tables = _padded_tables(block_tables).to(torch.int32)
    decode_blocks = -(-max(context_lens) // block_size)
    rows = torch.arange(num_seqs + 1, dtype=torch.int64)
    return AttentionMetadata(
        positions=torch.tensor(start_pos, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=rows.to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int64, device=device),
        block_tables=tables.to(device),
        groups=[],
        decode=DecodeGroup(
            q_tokens=rows[:-1].to(device),
            block_tables=tables[:, :decode_blocks].contiguous().to(device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
            block_size=block_size,
            is_whole_batch=True,
        ),
        start_pos_list=list(start_pos),
        query_len_list=[1] * num_seqs,
    )


def _padded_tables(block_tables: list[list[int]]) -> torch.Tensor:
    max_blocks = max(len(bt) for bt in block_tables)
    return torch.tensor(
        [bt + [0] * (max_blocks - len(bt)) for bt in block_tables], dtype=torch.int64
    )


def _slots(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots (R, n) of positions (R, n), each row read through block table row (R, blocks)."""
    blocks = tables.gather(-1, positions // block_size)
    return blocks * block_size + positions % block_size


def _padded_queries(
    seqs: list[int], query_lens: list[int], query_start_loc: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(q_gather, q_valid (G, max_q), q_rows, max_q) of the sequences' queries padded to max_q."""
    idx = torch.tensor(seqs, dtype=torch.int64)
    max_q = max(query_lens[i] for i in seqs)
    q_len = torch.tensor([query_lens[i] for i in seqs], dtype=torch.int64)  # (G,)
    q_off = torch.arange(max_q)  # (max_q,)
    q_valid = q_off[None, :] < q_len[:, None]  # (G, max_q)
    q_tok = query_start_loc[idx][:, None] + q_off[None, :]
    q_gather = torch.where(q_valid, q_tok, 0).flatten()
    q_rows = q_valid.flatten().nonzero().squeeze(-1)
    return q_gather, q_valid, q_rows, max_q


def _build_fresh_group(
    seqs: list[int], query_lens: list[int], query_start_loc: torch.Tensor
) -> AttentionGroup:
    """Sequences whose context is exactly this step's tokens: query i sees queries 0..i. Right
    padding keeps that causal mask right for every real row (pad keys come after them)."""
    q_gather, _, q_rows, max_q = _padded_queries(seqs, query_lens, query_start_loc)
    starts = [int(query_start_loc[i]) for i in seqs]
    contiguous = all(query_lens[i] == max_q for i in seqs) and all(
        b - a == max_q for a, b in zip(starts, starts[1:])
    )
    return AttentionGroup(
        q_gather=q_gather,
        q_rows=q_rows,
        q_tokens=q_gather[q_rows],
        kv_blocks=None,
        mask=None,
        max_q=max_q,
        first_token=starts[0] if contiguous else None,
    )


_PREFILL_FIELDS = ("block_tables", "q_start", "q_len", "ctx_start", "seqs")


def _prefill_group(
    seqs: list[int],
    query_lens: list[int],
    context_lens: list[int],
    tables: torch.Tensor,
    start_pos: list[int],
    query_start_loc: torch.Tensor,
    block_size: int,
) -> PrefillGroup:
    idx = torch.tensor(seqs, dtype=torch.int64)
    num_blocks = max(-(-context_lens[i] // block_size) for i in seqs)
    return PrefillGroup(
        block_tables=tables[idx, :num_blocks].to(torch.int32).contiguous(),
        q_start=query_start_loc[idx].to(torch.int32),
        q_len=torch.tensor([query_lens[i] for i in seqs], dtype=torch.int32),
        ctx_start=torch.tensor([start_pos[i] for i in seqs], dtype=torch.int32),
        seqs=idx,
        max_context=max(context_lens[i] for i in seqs),
    )


def _build_group(
    seqs: list[int],
    query_lens: list[int],
    context_lens: list[int],
    tables: torch.Tensor,
    starts: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_size: int,
    spans: dict[int, list[tuple[int, int]]],
) -> AttentionGroup:
    idx = torch.tensor(seqs, dtype=torch.int64)
    q_gather, q_valid, q_rows, max_q = _padded_queries(seqs, query_lens, query_start_loc)
    num_blocks = max(-(-context_lens[i] // block_size) for i in seqs)
    max_ctx = num_blocks * block_size  # whole blocks are gathered
    ctx_len = torch.tensor([context_lens[i] for i in seqs], dtype=torch.int64)
    q_off = torch.arange(max_q)  # (max_q,)

    kv_pos = torch.arange(max_ctx)  # (max_ctx,)
    kv_valid = kv_pos[None, :] < ctx_len[:, None]  # (G, max_ctx)
    # Query i of a sequence sits at position start + i and sees keys 0..start + i (causal), or
    # up to the end of the bidirectional span it is in.
    q_pos = starts[idx][:, None] + q_off[None, :]  # (G, max_q)
    last_key = _last_keys(q_pos, seqs, starts, spans)  # (G, max_q)
    mask = kv_pos[None, None, :] <= last_key[:, :, None]  # (G, max_q, max_ctx)
    mask &= kv_valid[:, None, :]
    # Padded query rows must not be fully masked (SDPA would produce NaN); they are discarded.
    mask[:, :, 0] |= ~q_valid
    return AttentionGroup(
        q_gather=q_gather,
        q_rows=q_rows,
        q_tokens=q_gather[q_rows],
        kv_blocks=tables[idx, :num_blocks],
        mask=mask.unsqueeze(1),
        max_q=max_q,
        q_pos=q_pos[:, :, None],
    )


def _last_keys(
    q_pos: torch.Tensor,
    seqs: list[int],
    starts: torch.Tensor,
    spans: dict[int, list[tuple[int, int]]],
) -> torch.Tensor:
    """(G, max_q) the last key position each query row sees: itself, or the end of its span."""
    if not any(i in spans for i in seqs):
        return q_pos
    last = q_pos.clone()
    for row, seq in enumerate(seqs):
        for first, end in spans.get(seq, ()):
            start = int(starts[seq])
            last[row, first - start : end - start] = end - 1
    return last


def _to_device(g: AttentionGroup, device: torch.device) -> AttentionGroup:
    return AttentionGroup(
        q_gather=g.q_gather.to(device),
        q_rows=g.q_rows.to(device),
        q_tokens=g.q_tokens.to(device),
        kv_blocks=None if g.kv_blocks is None else g.kv_blocks.to(device),
        mask=None if g.mask is None else g.mask.to(device),
        max_q=g.max_q,
        first_token=g.first_token,
        q_pos=None if g.q_pos is None else g.q_pos.to(device),
    )


class Attention(nn.Module):
    """Paged causal attention of one layer; `kv_cache` is assigned by the model runner."""

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: bool = False,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.softcap = softcap
        # This rank's heads' sinks, float32 (the decode kernel's), loaded by the model's attention.
        self.sinks: nn.Parameter | None = None
        if sinks:
            self.sinks = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32), False)
        # Built (or loaded) now, while the model is built, rather than in the first request.
        self.has_decode_kernel = (
            torch.get_default_device().type == "cpu" and kernel_library.load() is not None
        )
        self.kv_cache = torch.empty(0)  # (2, num_blocks, block_size, Hkv, D) once allocated
        self.kv_slot = 0  # its slot in the model runner's cache (workers/models/kv_cache_groups.py)

    @property
    def kv_cache(self) -> torch.Tensor:
        return self._kv_cache

    @kv_cache.setter
    def kv_cache(self, cache: torch.Tensor) -> None:
        # NOTE: what each step would otherwise re-derive from the cache is derived once, here.
        self._kv_cache = cache
        self._k_cache, self._v_cache = (cache[0], cache[1]) if cache.numel() else (cache, cache)
        self._kv_int8 = cache.dtype == torch.uint8  # kv_int8.py's rows: values and a scale
        self._uses_decode_kernel = (
            self.has_decode_kernel
            and cache.numel() > 0
            and cache.is_cpu
            and cache.dtype in (torch.float32, torch.bfloat16, torch.uint8)
            and attention_ops.supports_decode(
                self.num_heads, self.num_kv_heads, self.head_dim, cache.size(2)
            )
        )
        # Prompt chunks through the prefill kernel: causal attention, no capping or sinks.
        self._prefill_max_context = attention_ops.prefill_max_context()
        self._uses_prefill_kernel = (
            self._uses_decode_kernel
            and self.softcap is None
            and self.sinks is None
            and attention_ops.supports_prefill(
                cache.dtype, self.num_heads, self.num_kv_heads, self.head_dim
            )
        )

    @property
    def k_cache(self) -> torch.Tensor:
        """(num_blocks, block_size, Hkv, D): the keys of kv_cache."""
        return self._k_cache

    @property
    def v_cache(self) -> torch.Tensor:
        return self._v_cache

    @property
    def uses_decode_kernel(self) -> bool:
        """Whether decode steps attend through tern's paged decode kernel."""
        return self._uses_decode_kernel

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q (T, H, D), k and v (T, Hkv, D) -> (T, H, D)."""
        if self._kv_cache.numel() == 0:
            raise RuntimeError("the KV cache is not allocated: call init_kv_cache first")
        k_cache, v_cache = self._k_cache, self._v_cache  # (num_blocks, block_size, Hkv, D)
        d = meta.decode
        use_kernel = d is not None and self._uses_decode_kernel
        if use_kernel and d.is_whole_batch and (k.dtype == k_cache.dtype or self._kv_int8):
            # One call writes this step's K/V and attends: the common decode step.
            return attention_ops.paged_decode_attention(
                q.contiguous(), k_cache, v_cache, d.block_tables, d.context_lens, self.scale,
                new_kv=(k, v, meta.slot_mapping), window=self.sliding_window, softcap=self.softcap,
                sinks=self.sinks,
            )  # fmt: skip
        if self._kv_int8:
            kv_int8.write(k_cache, meta.slot_mapping, k)
            kv_int8.write(v_cache, meta.slot_mapping, v)
        else:
            k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, k)
            v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, v)

        prefill = meta.prefill if self._uses_prefill_kernel else None
        if prefill is not None and (
            q.dtype != k_cache.dtype
            or (self._prefill_max_context or prefill.max_context) < prefill.max_context
        ):
            prefill = None
        groups = meta.groups if prefill is None else meta.span_groups
        if use_kernel:
            q_dec = q if d.is_whole_batch else q[d.q_tokens]  # the cache's dtype, as q's
            o_dec = attention_ops.paged_decode_attention(
                q_dec.contiguous(),
                k_cache,
                v_cache,
                d.block_tables,
                d.context_lens,
                self.scale,
                window=self.sliding_window,
                softcap=self.softcap,
                sinks=self.sinks,
            )
            if d.is_whole_batch:
                return o_dec
            out = torch.empty_like(q)
            out[d.q_tokens] = o_dec
        else:
            out = torch.empty_like(q)
            if d is not None:
                groups = [d.padded, *groups]
        if prefill is not None:
            if q.stride(-1) != 1 or q.stride(1) != self.head_dim:
                q = q.contiguous()
            attention_ops.prefill_attention(
                q, k_cache, v_cache, prefill.block_tables, prefill.q_start, prefill.q_len,
                prefill.ctx_start, self.scale, self.sliding_window, out,
            )  # fmt: skip
        for g in groups:
            if g.kv_blocks is None:
                self._attend_fresh(q, k, v, g, out)
            else:
                self._attend_padded(q, k_cache, v_cache, g, out)
        return out

    def _attend_fresh(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: AttentionGroup,
        out: torch.Tensor,
    ) -> None:
        num = g.q_gather.numel() // g.max_q
        if g.first_token is not None:
            rows = slice(g.first_token, g.first_token + num * g.max_q)
            qg, kg, vg = q[rows], k[rows], v[rows]
        else:
            qg, kg, vg = q[g.q_gather], k[g.q_gather], v[g.q_gather]
        qg = qg.view(num, g.max_q, self.num_heads, self.head_dim)
        kg = kg.view(num, g.max_q, self.num_kv_heads, self.head_dim)
        vg = vg.view(num, g.max_q, self.num_kv_heads, self.head_dim)
        mask = None if self.sliding_window is None else g.window_mask(self.sliding_window)
        og = self._sdpa(qg.transpose(1, 2), kg.transpose(1, 2), vg.transpose(1, 2), mask)
        og = og.transpose(1, 2).reshape(num * g.max_q, self.num_heads, self.head_dim)
        if g.first_token is not None:
            out[rows] = og
        else:
            out[g.q_tokens] = og[g.q_rows]

    def _attend_padded(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        g: AttentionGroup,
        out: torch.Tensor,
    ) -> None:
        num, num_blocks = g.kv_blocks.shape
        qg = q[g.q_gather].view(num, g.max_q, self.num_heads, self.head_dim).transpose(1, 2)
        # (G, num_blocks, block_size, Hkv, D) -> (G, Hkv, max_ctx, D)
        kg, vg = k_cache[g.kv_blocks], v_cache[g.kv_blocks]
        if self._kv_int8:
            kg, vg = kv_int8.read(kg, q.dtype), kv_int8.read(vg, q.dtype)
        kg = kg.flatten(1, 2).transpose(1, 2)
        vg = vg.flatten(1, 2).transpose(1, 2)
        mask = g.mask if self.sliding_window is None else g.window_mask(self.sliding_window)
        og = self._sdpa(qg, kg, vg, mask, is_causal=False)  # (G, H, max_q, D)
        og = og.transpose(1, 2).reshape(num * g.max_q, self.num_heads, self.head_dim)
        out[g.q_tokens] = og[g.q_rows]

    def _sdpa(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        is_causal: bool = True,
    ) -> torch.Tensor:
        """q (G, H, Q, D), k and v (G, Hkv, K, D) -> (G, H, Q, D); causal when `is_causal` and no
        mask is given."""
        causal = is_causal and mask is None
        if self.softcap is None and self.sinks is None:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=True
            )
        group = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if causal:
            mask = torch.ones(q.size(2), k.size(2), dtype=torch.bool, device=q.device).tril()
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        if self.sinks is not None:  # one more column per head: its sink, dropped after
            sink = self.sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
            probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1, dtype=torch.float32)
            return torch.matmul(probs[..., :-1].to(q.dtype), v)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v)

"""Speculative decoding with a draft head fed the served model's own hidden states: the
checkpoint's multi-token-prediction layer (`mtp`, workers/models/mtp.py: the final hidden states)
or an EAGLE-3 head (`eagle3`, workers/models/eagle3.py: the residual stream at three depths).

The head at position i needs the served model's features there and the token after it, t_{i+1},
which is known only once the next step starts (the sampled token, or the next chunk's first). So
after each forward the drafter keeps every scheduled request's feature rows (`record`), and at
the next step, before the served model runs (`propose`):
1. where the request resumes says how many of last step's tokens were kept (all of a prompt
   chunk; the last token and the accepted drafts of a verification); the head runs on those
   positions with their next tokens, which writes its KV cache there (over what drafting wrote);
2. its output at the last of them guesses the token after the one this step computes: the first
   draft. Each further draft feeds the previous draft with the head's own output in place of the
   served model's features, one position on.
Drafts are sampled as the served model samples (workers/spec/verification.py `sample_drafts`); every
rank of a tensor-parallel group runs the same head steps on the same all-reduced features and so
drafts the same tokens. A request whose prefix came from the cache finds the head's KV there as
the prefix's first request left it (the position before a block boundary may hold another
continuation's): that costs acceptance, never correctness, as verification keeps only plain
decoding's tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from enginecore.messages import SamplingParams, ScheduledRequest
from workers.layers.attention import Attention
from workers.layers.request_state import KVOnlyStates
from workers.sample.sampler import Sampler
from workers.spec.drafter import draft_step_inputs, sample_drafts


@dataclass
class _Computed:
    """A request's last step: its first position, its tokens and their features."""

    start: int
    token_ids: list[int]
    features: torch.Tensor  # (len(token_ids), features)


class HeadDrafter(KVOnlyStates):
    def __init__(
        self,
        head: nn.Module,
        embed: nn.Module,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        own_kv: Attention | None = None,
    ) -> None:
        """`head(embeddings, features, meta)` -> (rows for `compute_logits`, rows that stand in
        for the features one position on); `embed`: token ids -> embeddings; `own_kv`: the
        head's attention when its KV lives apart from the served model's cache (EAGLE-3's)."""
        self.head = head
        self.embed = embed
        self.compute_logits = compute_logits
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.own_kv = own_kv
        self.sampler = Sampler()
        self._computed: dict[str, _Computed] = {}

    def bytes_per_block(self) -> int:
        """The head's own KV per block (0: its KV is a slot of the served model's cache)."""
        if self.own_kv is None:
            return 0
        a = self.own_kv
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * a.num_kv_heads * a.head_dim * elem

    def kv_layout(self) -> str:
        """ "": a head writes its KV at a position one step after the served model computed it
        (it needs the next token), so a producer whose request ends with the prompt never wrote
        the prompt's; a consumer's head starts from what its cache holds there (costing
        acceptance, never correctness)."""
        return ""

    def kv_blocks(self) -> torch.Tensor | None:
        return None

    def allocate_states(self, num_rows: int, num_blocks: int) -> None:
        """Its own KV of `num_blocks` blocks (request_state.RequestStateHolder)."""
        self._computed.clear()
        if self.own_kv is not None:
            a = self.own_kv
            shape = (2, num_blocks, self.block_size, a.num_kv_heads, a.head_dim)
            a.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def free_states(self) -> None:
        self._computed.clear()
        if self.own_kv is not None:
            self.own_kv.kv_cache = torch.empty(0)

    def own_weights(self) -> torch.nn.Module | None:
        return self.head if self.own_kv is not None else None

    def forget(self, request_id: str) -> None:
        self._computed.pop(request_id, None)

    def record(
        self, reqs: list[ScheduledRequest], features: torch.Tensor | None, starts: list[int]
    ) -> None:
        """The served model's features (T, features) of the step; `starts`: each request's first
        row in them (query_start_loc)."""
        assert features is not None, "a head drafts from the served model's features"
        for i, r in enumerate(reqs):
            rows = features[starts[i] : starts[i + 1]]
            self._computed[r.req_id] = _Computed(r.start_pos, r.token_ids, rows)

    @torch.inference_mode()
    def propose(
        self,
        reqs: list[ScheduledRequest],
        tables: list[list[int]],
        params: list[SamplingParams],
    ) -> dict[str, list[int]]:
        """Drafts for the requests with num_model_drafts, by request id (see the module
        docstring): none for a request whose last step the drafter did not see."""
        fed, starts, chunks, rows = [], [], [], []
        for i, r in enumerate(reqs):
            last = self._computed.pop(r.req_id, None)
            if last is None or r.sampling_params is not None:  # new, or resumed from its start
                continue
            kept = r.start_pos - last.start
            if not 0 < kept <= len(last.token_ids):
                raise ValueError(
                    f"request {r.req_id!r} resumes at {r.start_pos} after computing "
                    f"{len(last.token_ids)} tokens from {last.start}"
                )
            fed.append(i)
            starts.append(last.start)
            chunks.append([*last.token_ids[1:kept], r.token_ids[0]])
            rows.append(last.features[:kept])
        if not fed:
            return {}
        out, stream = self._forward(starts, chunks, torch.cat(rows), [tables[i] for i in fed])
        ends = torch.tensor([len(c) for c in chunks]).cumsum(0) - 1
        drafting = [n for n, i in enumerate(fed) if reqs[i].num_model_drafts > 0]
        if not drafting:
            return {}
        out, stream = out[ends[drafting]], stream[ends[drafting]]
        drafting = [fed[n] for n in drafting]
        drafts: dict[str, list[int]] = {reqs[i].req_id: [] for i in drafting}
        for j in range(max(reqs[i].num_model_drafts for i in drafting)):
            logits = self.compute_logits(out).float()
            tokens = sample_drafts(
                self.sampler, logits, [reqs[i] for i in drafting], [params[i] for i in drafting], j
            )
            for i, t in zip(drafting, tokens):
                drafts[reqs[i].req_id].append(t)
            more = [n for n, i in enumerate(drafting) if reqs[i].num_model_drafts > j + 1]
            if not more:
                break
            drafting = [drafting[n] for n in more]
            out, stream = self._forward(
                [reqs[i].start_pos + j for i in drafting],
                [[drafts[reqs[i].req_id][-1]] for i in drafting],
                stream[more],
                [tables[i] for i in drafting],
            )
        return drafts

    def _forward(
        self,
        starts: list[int],
        chunks: list[list[int]],
        features: torch.Tensor,
        tables: list[list[int]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over `chunks` (each t_{i+1} at positions start, start + 1, ...) with the
        features at i in the same order -> (rows for the LM head, rows for the next draft)."""
        ids, meta = draft_step_inputs(starts, chunks, tables, self.block_size, self.device)
        return self.head(self.embed(ids), features, meta)

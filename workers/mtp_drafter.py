"""Speculative decoding's `mtp` method: the served checkpoint's multi-token-prediction head
(workers/models/mtp.py) drafts, fed the served model's own final hidden states.

The head at position i needs h_i and the token after it, t_{i+1}, which is known only once the
next step starts (the sampled token, or the next chunk's first). So after each forward the
drafter keeps every scheduled request's hidden rows (`record`), and at the next step, before the
served model runs (`propose`):
1. where the request resumes says how many of last step's tokens were kept (all of a prompt
   chunk; the last token and the accepted drafts of a verification); the head runs on those
   positions with their next tokens, which writes its KV cache there (over what drafting wrote);
2. its output at the last of them guesses the token after the one this step computes: the first
   draft. Each further draft feeds the previous draft with the head's own output in place of the
   served model's hidden state, one position on.
Drafts are sampled as the served model samples (workers/speculative.py `sample_drafts`); every
rank of a tensor-parallel group runs the same head steps on the same all-reduced hidden states
and so drafts the same tokens. A request whose prefix came from the cache finds the head's KV
there as the prefix's first request left it (the position before a block boundary may hold
another continuation's): that costs acceptance, never correctness, as verification keeps only
plain decoding's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from enginecore.messages import SamplingParams, ScheduledRequest
from workers.layers.attention import build_attention_metadata
from workers.layers.sampler import Sampler
from workers.speculative import sample_drafts


@dataclass
class _Computed:
    """A request's last step: its first position, its tokens and their hidden states."""

    start: int
    token_ids: list[int]
    hidden: torch.Tensor  # (len(token_ids), hidden)


class MtpDrafter:
    def __init__(self, model: torch.nn.Module, block_size: int, device: torch.device) -> None:
        if model.mtp is None:
            raise ValueError("the served model has no multi-token-prediction head attached")
        self.model = model
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        self._computed: dict[str, _Computed] = {}

    def bytes_per_block(self) -> int:
        return 0  # the head's KV is a slot of the served model's cache

    def init_kv_cache(self, num_blocks: int) -> None:
        self._computed.clear()

    def release_kv_cache(self) -> None:
        self._computed.clear()

    def forget(self, request_id: str) -> None:
        self._computed.pop(request_id, None)

    def record(self, reqs: list[ScheduledRequest], hidden: torch.Tensor, starts: list[int]) -> None:
        """The served model's final hidden states (T, hidden) of the step; `starts`: each
        request's first row in them (query_start_loc)."""
        for i, r in enumerate(reqs):
            rows = hidden[starts[i] : starts[i + 1]]
            self._computed[r.req_id] = _Computed(r.start_pos, list(r.token_ids), rows)

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
            rows.append(last.hidden[:kept])
        if not fed:
            return {}
        out = self._forward(starts, chunks, torch.cat(rows), [tables[i] for i in fed])
        ends = torch.tensor([len(c) for c in chunks]).cumsum(0) - 1
        drafting = [n for n, i in enumerate(fed) if reqs[i].num_model_drafts > 0]
        if not drafting:
            return {}
        hidden = out[ends[drafting]]
        drafting = [fed[n] for n in drafting]
        drafts: dict[str, list[int]] = {reqs[i].req_id: [] for i in drafting}
        for j in range(max(reqs[i].num_model_drafts for i in drafting)):
            logits = self.model.compute_logits(hidden).float()
            tokens = sample_drafts(
                self.sampler, logits, [reqs[i] for i in drafting], [params[i] for i in drafting], j
            )
            for i, t in zip(drafting, tokens):
                drafts[reqs[i].req_id].append(t)
            more = [n for n, i in enumerate(drafting) if reqs[i].num_model_drafts > j + 1]
            if not more:
                break
            drafting = [drafting[n] for n in more]
            hidden = self._forward(
                [reqs[i].start_pos + j for i in drafting],
                [[drafts[reqs[i].req_id][-1]] for i in drafting],
                hidden[more],
                [tables[i] for i in drafting],
            )
        return drafts

    def _forward(
        self,
        starts: list[int],
        chunks: list[list[int]],
        hidden: torch.Tensor,
        tables: list[list[int]],
    ) -> torch.Tensor:
        """The head over `chunks` (each t_{i+1} at positions start, start + 1, ...) with the
        hidden states h_i in the same order -> its output rows."""
        meta = build_attention_metadata(
            starts, [len(c) for c in chunks], tables, self.block_size, self.device,
            decode_rows=[len(c) <= 16 for c in chunks],
        )  # fmt: skip
        ids = torch.tensor([t for c in chunks for t in c], dtype=torch.int64, device=self.device)
        return self.model.mtp(self.model.model.embed_tokens(ids), hidden, meta)

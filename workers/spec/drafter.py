"""What a drafter on the workers is (speculative decoding's `draft_model`, `mtp` and `eagle3`
methods; the engine core drafts `ngram` and `suffix` from token ids, enginecore/speculative.py),
and the helpers the drafters share.

A drafter proposes each step's drafts for the requests that ask (ScheduledRequest.
num_model_drafts), records what the served model computed in the step (a head drafts from its
features; a draft model catches up from the tokens themselves and records nothing), and forgets a
request once it finishes. Its own KV, if it has one, is a request_state.RequestStateHolder the
runner allocates and frees with the served model's cache. Verification, which keeps only what
plain decoding would have produced, is the served model's step (verification.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import msgspec
import torch

from enginecore.messages import SamplingParams, ScheduledRequest
from workers.layers.attention import AttentionMetadata, build_attention_metadata
from workers.layers.request_state import RequestStateHolder
from workers.sample.sampler import Sampler, SamplingTensors


class Drafter(RequestStateHolder, Protocol):
    def propose(
        self,
        reqs: list[ScheduledRequest],
        tables: list[list[int]],
        params: list[SamplingParams],
    ) -> dict[str, list[int]]:
        """Drafts for the requests with num_model_drafts, by request id. `tables`: each
        request's block table; `params`: its sampling parameters."""

    def record(
        self, reqs: list[ScheduledRequest], features: torch.Tensor | None, starts: list[int]
    ) -> None:
        """The served model's features (T, features) of the step (None: the model keeps none);
        `starts`: each request's first row in them (query_start_loc)."""

    def forget(self, request_id: str) -> None:
        """A finished request: whatever the drafter keeps for it goes."""

    def bytes_per_block(self) -> int:
        """Its own KV per block of the served model's cache (0: none of its own)."""

    def kv_layout(self) -> str:
        """What its own KV blocks are, when they can travel with the served model's to a
        consumer (prefill/decode disaggregation, KVLayout.draft); "": they cannot."""

    def kv_blocks(self) -> torch.Tensor | None:
        """Its own KV cache as kv_layout() describes it (blocks on dimension 2), once allocated."""

    def own_weights(self) -> torch.nn.Module | None:
        """Its weights where they live apart from the served model's (weight updates name them
        draft.*): a draft model's, an EAGLE-3 head's; None for an MTP head (`mtp.*`)."""


def sample_drafts(
    sampler: Sampler,
    logits: torch.Tensor,
    reqs: Sequence[ScheduledRequest],
    params: Sequence[SamplingParams],
    j: int,
) -> list[int]:
    """A model draft (workers/spec/draft_model.py, workers/spec/head_drafter.py) for output index
    sample_index + j of each request, from the draft's logits (N, vocab) float32: sampled as the
    served model will sample that position (its seed's noise, temperature, top-k/p, min-p, logit
    bias, min_tokens; penalties left out), so that where the two agree the same token is drawn
    and the draft is kept; greedy requests take the argmax."""
    plain = [
        msgspec.structs.replace(p, repetition_penalty=1.0, frequency_penalty=0.0,
                                presence_penalty=0.0)
        for p in params
    ]  # fmt: skip
    tensors = SamplingTensors.from_params(
        plain, [r.sample_index + j for r in reqs], logits.size(-1), logits.device
    )
    return sampler(logits, tensors).tolist()


def draft_step_inputs(
    starts: list[int],
    chunks: list[list[int]],
    tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, AttentionMetadata]:
    """A drafter's forward over `chunks` (token ids from positions `starts`, through the served
    model's block tables) -> (ids, attention metadata); short chunks attend as decode rows."""
    meta = build_attention_metadata(
        starts, [len(c) for c in chunks], tables, block_size, device,
        decode_rows=[len(c) <= 16 for c in chunks],
    )  # fmt: skip
    ids = torch.tensor([t for c in chunks for t in c], dtype=torch.int64, device=device)
    return ids, meta

"""A request as the engine core sees it: token ids in, token ids out, and how far the KV cache has got.

There is no prefill or decode phase: `num_computed_tokens` catches up to `num_tokens` (prompt plus
outputs so far). A request whose computed tokens reach the end samples one new token per step.
A pooling request (`pooling_type` set) only has the prompt: it finishes when its last prompt chunk
is computed, with the model's output on the pooled hidden states instead of a token.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from enginecore.messages import (
    FinishReason,
    KVPulled,
    Logprobs,
    MultiModalItem,
    PromptLogprobs,
    SamplingParams,
    StructuredOutputSpec,
)

if TYPE_CHECKING:
    from enginecore.lora import Adapter
    from enginecore.routing import RequestRouting
    from enginecore.structured_output import RequestGrammar


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED = enum.auto()


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        structured_output: StructuredOutputSpec | None = None,
        pooling_type: str | None = None,
        mm_items: list[MultiModalItem] | None = None,
    ) -> None:
        """`pooling_type`: LAST, MEAN or CLS for a pooling request (sampling_params unused).
        `mm_items`: the prompt's images, in prompt order."""
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens found in the prefix cache at first schedule
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_preemptions = 0
        # Wall-clock times for the frontend's queue-time metric, sent with the first output.
        self.queued_time = time.time()
        self.first_scheduled_time: float | None = None
        # Set when the worker must (re)start this request's state from scratch: first schedule, or resume
        # after preemption.
        self.needs_new_state = True
        # Hybrid models: its row in the workers' linear-attention state pools while it runs.
        self.state_slot = -1
        # Block hashes of the full blocks of all_token_ids, extended as tokens arrive (prefix caching).
        self.block_hashes: list[int] = []
        # Logprobs of prompt tokens 1, 2, ... received so far (when the request asked for them).
        self._prompt_logprobs: list[Logprobs] = []
        self.num_prompt_logprobs = 0
        # Structured output: its matcher once the grammar has compiled (the request waits for it).
        self.structured_output = structured_output
        self.grammar: RequestGrammar | None = None
        self.pooling_type = pooling_type
        # --enable-return-routed-experts: the experts of each computed position (set by the scheduler).
        self.routing: RequestRouting | None = None
        # The LoRA adapter version it runs on (enginecore/lora.py), set by the engine core.
        self.lora: Adapter | None = None
        self.mm_items = mm_items or []
        # Prefill/decode disaggregation (enginecore/kv_transfer/): the lease a producing request
        # lends its blocks under once it finishes, and a consumer's blocks pulled from a
        # producer (one file per rank) that its first step loads as its computed prefix.
        self.kv_lease_id: str | None = None
        self.kv_pulled: KVPulled | None = None
        # A lent hybrid prompt's pinned state checkpoint (its prefix hash, its slot).
        self.kv_lease_checkpoint: tuple[bytes, int] | None = None
        # SamplingParams.cross_attention: output positions whose rows went to the frontend.
        self.num_cross_attention_rows = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def is_waiting_for_grammar(self) -> bool:
        return self.structured_output is not None and self.grammar is None

    @property
    def is_pooling(self) -> bool:
        return self.pooling_type is not None

    @property
    def skips_prefix_cache(self) -> bool:
        """Prompt logprobs need logits at every prompt position, MEAN and CLS pooling the hidden
        states of every position (of position 0): nothing may come from the cache. LAST pooling
        needs the last position only, which is always computed."""
        if self.pooling_type in ("MEAN", "CLS"):
            return True
        return self.sampling_params.prompt_logprobs is not None

    def take_cross_attention(self, start: int, rows: bytes) -> bytes:
        """The rows a step computed from position `start` that the frontend has not had: those
        of output positions read with the tokens the request kept (not a rejected draft's), each
        once (a position recomputed after a preemption keeps the row it was generated with)."""
        params = self.sampling_params.cross_attention
        assert params is not None
        row_bytes = params.row_floats * 4
        first = self.num_prompt_tokens + self.num_cross_attention_rows
        end = min(start + len(rows) // row_bytes, self.num_tokens - 1)  # the last is unread
        if end <= first or start > first:
            return b""
        self.num_cross_attention_rows += end - first
        return rows[(first - start) * row_bytes : (end - start) * row_bytes]

    def image_span_at(self, pos: int) -> tuple[int, int] | None:
        """The run of image placeholders position `pos` falls strictly inside (after its first
        token), as (start, end); None when a chunk may start or end at `pos`."""
        for item in self.mm_items:
            for start, length in item.spans:
                if start < pos < start + length:
                    return start, start + length
        return None

    def mm_hashes_in(self, start: int, end: int) -> list[str]:
        """The content hashes of the images with placeholders in positions [start, end), and of
        the items without placeholders (an encoder-decoder's audio: every position depends on it,
        so no block is another audio's)."""
        return [
            item.content_hash
            for item in self.mm_items
            if not item.spans or any(s < end and start < s + n for s, n in item.spans)
        ]

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def add_prompt_logprobs(self, chunk: PromptLogprobs) -> None:
        """Keeps the positions not received yet (a preempted request computes its prompt again)."""
        expected = 1 + self.num_prompt_logprobs
        assert chunk.start <= expected, f"prompt logprobs from {chunk.start}, expected {expected}"
        n = chunk.logprobs.num_positions
        skip = expected - chunk.start
        if skip < n:
            self._prompt_logprobs.append(chunk.logprobs.slice(skip, n) if skip else chunk.logprobs)
            self.num_prompt_logprobs += n - skip

    def take_prompt_logprobs(self) -> Logprobs:
        """All prompt logprobs (tokens 1..n-1), once: the first output carries them."""
        assert self.num_prompt_logprobs == self.num_prompt_tokens - 1, "prompt logprobs incomplete"
        parts, self._prompt_logprobs = self._prompt_logprobs, []
        return Logprobs.concat(parts)

"""The requests the workers know and one step's inputs: each running request's block tables,
sampling parameters, token history, pooling, state and LoRA slots, kept from the step that
scheduled it until the one that finishes it; and from a step's scheduled requests the flat batch
of token ids and its attention metadata (positions, cache slots, block tables, state rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import torch

from enginecore.config import Config
from enginecore.messages import SamplingParams, ScheduledRequest, SchedulerOutput
from workers.layers.attention import AttentionMetadata, build_attention_metadata
from workers.layers.lora import LoraBatch
from workers.layers.pooler import PoolingState
from workers.layers.request_state import RequestStateHolder, state_holders
from workers.models.kv_cache_groups import KVCacheGroup
from workers.sample.logits_processors import TokenHistory
from workers.spec.drafter import Drafter


@dataclass
class RequestState:
    block_tables: list[list[int]]  # one per KV-cache group
    sampling_params: SamplingParams
    history: TokenHistory | None = None  # every token, when sampling reads them (penalties...)
    pooling: PoolingState | None = None  # pooling models: the prompt's pooling so far
    state_slot: int = -1  # hybrid models: its row in the linear-attention state pools
    lora_slot: int = -1  # the LoRA adapter it runs on (workers/lora_adapters.py), -1: none
    # Hybrid models, after a step that verified drafts: its first position and token count, and
    # each linear-attention layer's states after each of its tokens (GatedDeltaNet._verify).
    drafted: tuple[int, int, list[tuple[torch.Tensor, torch.Tensor]]] | None = None


class StepInputs:
    """The running requests' states, and each step's batch built from them."""

    def __init__(self, config: Config, device: torch.device, is_pooling: bool) -> None:
        self.config = config
        self.device = device
        self.block_size = config.cache.block_size
        self.is_pooling = is_pooling
        self.requests: dict[str, RequestState] = {}
        # Set once the model is loaded (bind).
        self.kv_cache_groups: list[KVCacheGroup] = []
        # The model's layers that keep per-request state (request_state.RequestStateHolder).
        self.holders: list[RequestStateHolder] = []
        self.lora_batch: LoraBatch | None = None
        self.draft: Drafter | None = None
        self.num_kv_blocks = 0
        self.num_state_checkpoints = 0
        self.max_model_len = 0

    def bind(
        self,
        model: torch.nn.Module,
        lora_batch: LoraBatch | None,
        draft: Drafter | None,
        max_model_len: int,
    ) -> None:
        self.kv_cache_groups = model.model.kv_cache_groups
        self.holders = state_holders(model)
        self.lora_batch = lora_batch
        self.draft = draft
        self.max_model_len = max_model_len

    def cache_allocated(self, num_blocks: int, num_state_checkpoints: int) -> None:
        """A new (or no) cache: every request the workers knew is gone with it."""
        self.num_kv_blocks = num_blocks
        self.num_state_checkpoints = num_state_checkpoints
        self.requests.clear()

    # ------------------------------------------------------------------ request states

    def update(self, step: SchedulerOutput) -> None:
        """Forgets the finished requests; starts or extends the scheduled ones' states."""
        for req_id in step.finished_req_ids:
            self.requests.pop(req_id, None)
            if self.draft is not None:
                self.draft.forget(req_id)
        for r in step.requests:
            if r.sampling_params is not None:  # first schedule, or resumed after preemption
                self.requests.pop(r.req_id, None)
                self.requests[r.req_id] = RequestState(
                    [list(r.new_block_ids), *map(list, r.other_group_block_ids)],
                    r.sampling_params,
                    _new_history(r),
                    PoolingState() if self.is_pooling else None,
                    self._state_slot(r),
                    self._lora_slot(r),
                )
                if r.restore_checkpoint >= 0:
                    self._restore_checkpoint(r)
            elif r.req_id in self.requests:
                self._take_back_drafts(r)
                tables = self.requests[r.req_id].block_tables
                for table, new in zip(tables, [r.new_block_ids, *r.other_group_block_ids]):
                    table.extend(new)
            else:
                raise ValueError(
                    f"request {r.req_id!r} scheduled without sampling params, "
                    "but the worker has no state for it"
                )
            history = self.requests[r.req_id].history
            if history is not None:
                num_computed = len(r.token_ids) - r.num_draft_tokens
                history.extend(r.start_pos, r.token_ids[:num_computed], r.token_ids[num_computed:])

    def _take_back_drafts(self, r: ScheduledRequest) -> None:
        """A hybrid model's request whose last step verified drafts: where this step starts says
        how many of its tokens were kept; the linear-attention states return to theirs (a
        rejected draft's KV is simply written over). Every pipeline stage reads it the same way."""
        state = self.requests[r.req_id]
        if state.drafted is None:
            return
        start, num_tokens, layer_states = state.drafted
        state.drafted = None
        kept = r.start_pos - start
        if not 0 < kept <= num_tokens:
            raise ValueError(
                f"request {r.req_id!r} resumes at {r.start_pos} after verifying {num_tokens} "
                f"tokens from {start}"
            )
        if kept < num_tokens:
            for holder, states in zip(self.holders, layer_states):
                holder.take_back(state.state_slot, states, kept)

    def keep_drafted_states(self, reqs: list[ScheduledRequest], draft_seqs: list[int]) -> None:
        """After a forward that verified drafts on a hybrid model: each such request keeps its
        layers' states after each of its tokens until the next step says how many it kept."""
        for i in draft_seqs:
            r, state = reqs[i], self.requests[reqs[i].req_id]
            states = [h.drafted(state.state_slot) for h in self.holders]
            state.drafted = (r.start_pos, len(r.token_ids), states)

    def _lora_slot(self, r: ScheduledRequest) -> int:
        slots = self.config.lora.num_slots if self.lora_batch is not None else 0
        if r.lora_slot != -1 and not 0 <= r.lora_slot < slots:
            raise ValueError(f"request {r.req_id!r} scheduled with LoRA slot {r.lora_slot}")
        return r.lora_slot

    def _state_slot(self, r: ScheduledRequest) -> int:
        if not self.holders:
            return -1
        if not 0 <= r.state_slot < self.config.scheduler.max_num_seqs:
            raise ValueError(
                f"request {r.req_id!r} scheduled with linear-attention state {r.state_slot}, "
                f"outside the pool of {self.config.scheduler.max_num_seqs}"
            )
        return r.state_slot

    def _checkpoint_row(self, r: ScheduledRequest, checkpoint: int) -> int:
        if not 0 <= checkpoint < self.num_state_checkpoints:
            raise ValueError(
                f"request {r.req_id!r} names state checkpoint {checkpoint}, outside the "
                f"{self.num_state_checkpoints} kept"
            )
        return self.config.scheduler.max_num_seqs + checkpoint

    def checkpoint_states(self, checkpoint: int) -> list[torch.Tensor]:
        """A state checkpoint's states, holder by holder (a producer lends them)."""
        if not 0 <= checkpoint < self.num_state_checkpoints:
            raise ValueError(
                f"state checkpoint {checkpoint} is outside the {self.num_state_checkpoints} kept"
            )
        return self._row_states(self.config.scheduler.max_num_seqs + checkpoint)

    def request_states(self, req_id: str) -> list[torch.Tensor]:
        """A running request's states, holder by holder (a consumer loads them)."""
        return self._row_states(self.requests[req_id].state_slot)

    def _row_states(self, row: int) -> list[torch.Tensor]:
        return [t for holder in self.holders for t in holder.row_states(row)]

    def _restore_checkpoint(self, r: ScheduledRequest) -> None:
        """A prefix-cache hit on a hybrid model: the request starts from the states after it."""
        row = self._checkpoint_row(r, r.restore_checkpoint)
        for holder in self.holders:
            holder.copy_states([row], [r.state_slot])

    # ------------------------------------------------------------------ the step's batch

    def validate(self, reqs: list[ScheduledRequest]) -> None:
        for r in reqs:
            tables = self.requests[r.req_id].block_tables
            end = r.start_pos + len(r.token_ids) + r.num_model_drafts
            if not r.token_ids:
                raise ValueError(f"request {r.req_id!r} scheduled with no tokens")
            if r.num_model_drafts and self.draft is None:
                raise ValueError(f"request {r.req_id!r} asks for drafts; no draft model is loaded")
            if end > self.max_model_len:
                raise ValueError(
                    f"request {r.req_id!r} reaches {end} tokens, beyond "
                    f"max_model_len {self.max_model_len}"
                )
            if len(tables) != len(self.kv_cache_groups):
                raise ValueError(
                    f"request {r.req_id!r} has {len(tables)} block tables for "
                    f"{len(self.kv_cache_groups)} KV-cache groups"
                )
            if any(end > len(table) * self.block_size for table in tables):
                raise ValueError(
                    f"request {r.req_id!r} needs {end} slots, its block table has "
                    f"{min(map(len, tables))} blocks of {self.block_size}"
                )
            new_ids = [r.new_block_ids, *r.other_group_block_ids]
            if any(not 0 <= b < self.num_kv_blocks for ids in new_ids for b in ids):
                raise ValueError(f"request {r.req_id!r} has a block id outside the KV cache")

    def add_model_drafts(self, reqs: list[ScheduledRequest]) -> list[ScheduledRequest]:
        """The step's requests with the draft model's drafts appended to those that asked for
        them (ScheduledRequest.num_model_drafts), as the engine core sends model-free drafts."""
        assert self.draft is not None
        states = [self.requests[r.req_id] for r in reqs]
        drafts = self.draft.propose(
            reqs, [s.block_tables[0] for s in states], [s.sampling_params for s in states]
        )
        out = []
        for r, state in zip(reqs, states):
            d = drafts.get(r.req_id)
            if d:
                r = msgspec.structs.replace(
                    r, token_ids=[*r.token_ids, *d], num_draft_tokens=len(d), num_model_drafts=0
                )
                if state.history is not None:
                    state.history.set_drafts(d)
            out.append(r)
        return out

    def build(
        self,
        reqs: list[ScheduledRequest],
        bidirectional_spans: list[list[tuple[int, int]]] | None = None,
    ) -> tuple[torch.Tensor, AttentionMetadata]:
        """The step's token ids (T,) and attention metadata; sets the step's LoRA slots.
        `bidirectional_spans`: per request, the prompt runs its attention sees both ways."""
        input_ids = torch.tensor(
            [t for r in reqs for t in r.token_ids], dtype=torch.int64, device=self.device
        )
        tables = [self.requests[r.req_id].block_tables for r in reqs]
        meta = build_attention_metadata(
            [r.start_pos for r in reqs],
            [len(r.token_ids) for r in reqs],
            [t[0] for t in tables],
            self.block_size,
            self.device,
            [[t[g] for t in tables] for g in range(1, len(self.kv_cache_groups))],
            [self.config.model.batch_invariant or r.num_draft_tokens > 0 for r in reqs],
            bidirectional_spans,
        )
        if self.lora_batch is not None:
            self.lora_batch.slots = self._token_lora_slots(reqs)
        if self.holders:
            meta.state_slots = torch.tensor(
                [self.requests[r.req_id].state_slot for r in reqs], device=self.device
            )
            meta.state_saves = [
                (i, offset, self._checkpoint_row(r, checkpoint))
                for i, r in enumerate(reqs)
                for offset, checkpoint in r.save_checkpoints
            ]
            meta.draft_seqs = [i for i, r in enumerate(reqs) if r.num_draft_tokens]
        return input_ids, meta

    def _token_lora_slots(self, reqs: list[ScheduledRequest]) -> torch.Tensor | None:
        """Each token's adapter slot this step, or None when no request runs on one."""
        slots = [self.requests[r.req_id].lora_slot for r in reqs]
        if all(s < 0 for s in slots):
            return None
        counts = torch.tensor([len(r.token_ids) for r in reqs])
        return torch.tensor(slots, dtype=torch.int32).repeat_interleave(counts).to(self.device)


def _new_history(r: ScheduledRequest) -> TokenHistory | None:
    assert r.sampling_params is not None
    if not r.sampling_params.needs_history:
        return None
    if r.history_token_ids is None:
        raise ValueError(
            f"request {r.req_id!r} needs its token history (penalties or prompt logprobs), "
            "but none was sent"
        )
    return TokenHistory(r.history_token_ids, r.num_prompt_tokens)

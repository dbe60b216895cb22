"""Continuous batching with chunked prefill, prefix caching and preemption by recomputation.

Each step: running requests first (decodes and unfinished prefill chunks, oldest first), then waiting
requests in arrival order (preempted ones at the front), within --max-num-batched-tokens tokens and
--max-num-seqs sequences. When the pool runs out of blocks, the newest running request is preempted:
its blocks are freed and it later recomputes prompt + outputs (mostly from the prefix cache), so its
output is the same as if it had never been interrupted.

Pooling requests (embeddings, classification, rewards) are scheduled the same way, prompt only: the
step that computes a pooling request's last prompt chunk returns its pooled output, and it finishes.

The scheduler knows token ids and blocks only; it never sees text or tensors.
"""

from __future__ import annotations

import operator
import time
from collections import deque
from collections.abc import Sequence

from enginecore.config import Config
from enginecore.kv_cache_manager import KVCacheManager
from enginecore.kv_transfer.files import remove
from enginecore.kv_transfer.leases import KVLeases
from enginecore.lora import Adapter
from enginecore.messages import (
    EngineCoreOutput,
    FinishReason,
    KVLoad,
    ModelRunnerOutput,
    MultiModalItem,
    RoutingShape,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
)
from enginecore.request import Request, RequestStatus
from enginecore.routing import RequestRouting, RoutingCache
from enginecore.speculative import Drafter
from enginecore.state_checkpoints import StateCheckpoints


class Scheduler:
    def __init__(
        self,
        config: Config,
        num_kv_blocks: int,
        max_model_len: int,
        kv_cache_windows: Sequence[int | None] = (None,),
        num_state_slots: int = 0,
        num_state_checkpoints: int = 0,
        state_checkpoint_interval: int = 0,
        routing_shape: RoutingShape | None = None,
        num_experts: int = 0,
        whole_image_spans: bool = False,
        image_layout_tensors: tuple[str, ...] = (),
    ) -> None:
        """num_state_slots: hybrid models' per-sequence linear-attention states (one per
        sequence that can run): a request takes one when it starts running and gives it back
        when it finishes, is aborted or is preempted. With prefix caching, their checkpoints
        (enginecore/state_checkpoints.py) are what a cached prefix resumes from.

        routing_shape: record every request's routing (--enable-return-routed-experts,
        enginecore/routing.py). num_experts: per MoE layer (the tokens each takes are counted).

        whole_image_spans: each image's placeholders are computed in one step (models that attend
        inside them in both directions): a chunk ends before an image it cannot hold whole.
        image_layout_tensors: on models whose tokens after an image are placed by its layout
        (M-RoPE), the images a request's first chunk starts after are sent too, with only these
        of their tensors (the encoder never runs on them)."""
        self.whole_image_spans = whole_image_spans
        self.image_layout_tensors = image_layout_tensors
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.max_loras = config.lora.max_loras if config.lora.enabled else 0
        self.max_num_batched_tokens = config.scheduler.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.block_size = config.cache.block_size
        self.routing_shape = routing_shape
        self.num_experts = num_experts
        self.expert_tokens_total: list[int] = []  # layers x experts, layer-major
        self.kv = self._kv_cache_manager(
            config, num_kv_blocks, kv_cache_windows, num_state_slots, num_state_checkpoints,
            state_checkpoint_interval,
        )  # fmt: skip
        self.requests: dict[str, Request] = {}
        self.num_state_slots = num_state_slots
        self.free_state_slots = list(reversed(range(num_state_slots)))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_req_ids: list[str] = []  # to tell the workers at the next step
        self._step_id = 0
        self.num_preempted_total = 0
        self.num_prefill_tokens_total = 0  # tokens computed by prefill chunks (recompute included)
        self.num_generated_tokens_total = 0
        # Speculative decoding: drafts for decoding sequences (enginecore/speculative.py).
        self.drafter = Drafter(config.speculative) if config.speculative.enabled else None
        # Prefill/decode disaggregation: a producer's lent blocks; a consumer's external prefix
        # cache (prompt tokens it looked up at producers, and those it pulled).
        kv_transfer = config.kv_transfer
        self.leases = (
            KVLeases(kv_transfer.lease_s, self._free_lent) if kv_transfer.produces else None
        )
        self.external_prefix_cache_queries = 0
        self.external_prefix_cache_hits = 0

    def _kv_cache_manager(
        self,
        config: Config,
        num_kv_blocks: int,
        kv_cache_windows: Sequence[int | None],
        num_state_slots: int,
        num_state_checkpoints: int,
        state_checkpoint_interval: int,
    ) -> KVCacheManager:
        caching, checkpoints = config.cache.enable_prefix_caching, None
        if num_state_slots and caching:
            if num_state_checkpoints:
                checkpoints = StateCheckpoints(num_state_checkpoints, state_checkpoint_interval)
            else:
                caching = False  # a hit could not restore the linear-attention states
        routing = None
        if self.routing_shape is not None and caching:
            routing = RoutingCache(num_kv_blocks, self.block_size, self.routing_shape.row_bytes)
        return KVCacheManager(
            num_kv_blocks, self.block_size, caching, kv_cache_windows, checkpoints, routing,
            self.whole_image_spans,
        )  # fmt: skip

    # ----------------------------------------------------------------------------- requests in and out

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        outputs = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue  # already finished: its output is on its way
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, FinishReason.ABORT)
            outputs.append(EngineCoreOutput(request_id, [], FinishReason.ABORT))
        return outputs

    def fail_request(self, request_id: str, error: str) -> EngineCoreOutput | None:
        """Ends one waiting request with an error (its grammar did not compile)."""
        request = self.requests.get(request_id)
        if request is None or request.status == RequestStatus.RUNNING:
            return None
        self.waiting.remove(request)
        self._finish(request, FinishReason.ERROR)
        return EngineCoreOutput(request_id, [], FinishReason.ERROR, error=error)

    def fail_all(self, error: str) -> list[EngineCoreOutput]:
        """Ends every request with an error (the workers can no longer serve)."""
        outputs = []
        for request in list(self.requests.values()):
            self._finish(request, FinishReason.ERROR)
            outputs.append(
                EngineCoreOutput(request.request_id, [], FinishReason.ERROR, error=error)
            )
        self.running.clear()
        self.waiting.clear()
        return outputs

    @property
    def has_requests(self) -> bool:
        return bool(self.requests)

    @property
    def has_started_requests(self) -> bool:
        """Some request has computed tokens: it runs, or waits to resume after preemption."""
        # NOTE: preempted requests lead the waiting queue (_preempt puts them in front).
        return bool(self.running) or (
            bool(self.waiting) and self.waiting[0].status == RequestStatus.PREEMPTED
        )

    # ----------------------------------------------------------------------------- one step

    def schedule(self, admit_waiting: bool = True) -> SchedulerOutput:
        """The next step. admit_waiting=False (a pause that drains): running and preempted
        requests only, so that every started request finishes under the weights it began with."""
        self._step_id += 1
        scheduled: list[ScheduledRequest] = []
        budget, preempted = self._schedule_running(scheduled)
        # A step that had to preempt admits nobody new: the pool is the bottleneck.
        if not preempted:
            self._admit_waiting(scheduled, budget, admit_waiting)
        finished, self._finished_req_ids = self._finished_req_ids, []
        return SchedulerOutput(self._step_id, scheduled, finished)

    def _schedule_running(self, scheduled: list[ScheduledRequest]) -> tuple[int, bool]:
        """Running requests' next chunks (and drafts), in order, preempting from the back when
        the pool is full; returns the token budget left and whether anybody was preempted."""
        budget = self.max_num_batched_tokens
        preempted = False
        drafts_of = self._plan_drafts(budget)
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._chunk_len(request, request.num_computed_tokens, budget)
            if num_new == 0:  # its next image does not fit in what is left of the step
                i += 1
                continue
            drafts = drafts_of.get(request.request_id, [])[: max(budget - num_new, 0)]
            # Drafts never preempt anybody: without room for them the sequence decodes plainly.
            new_block_ids = None
            if drafts:
                new_block_ids = self.kv.allocate_slots(request, num_new + len(drafts))
            if new_block_ids is None:
                drafts = []
                while (new_block_ids := self.kv.allocate_slots(request, num_new)) is None:
                    victim = self.running[-1]
                    self._preempt(victim)
                    preempted = True
                    if victim is request:
                        break
            if new_block_ids is None:
                break  # request preempted itself: everything after it is gone too
            scheduled.append(self._schedule_chunk(request, num_new, new_block_ids, drafts))
            budget -= num_new + len(drafts)
            i += 1
        return budget, preempted

    def _admit_waiting(
        self, scheduled: list[ScheduledRequest], budget: int, admit_waiting: bool
    ) -> None:
        """Starts waiting requests (preempted ones lead the queue) while the budget, the
        sequence limit and the pool allow."""
        not_ready: list[Request] = []  # grammars compiling, adapters not in: they keep their place
        adapters = self.running_adapters() if self.max_loras else set()
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if not admit_waiting and request.status != RequestStatus.PREEMPTED:
                break  # a pause resumes only started requests (preempted ones lead the queue)
            if request.is_waiting_for_grammar or not self._adapter_fits(request, adapters):
                not_ready.append(self.waiting.popleft())
                continue
            cached_blocks, num_cached = None, 0
            if not request.skips_prefix_cache:
                cached_blocks, num_cached = self.kv.find_cached_prefix(request)
            num_pulled = self._pulled_tokens(request, num_cached)
            num_new = self._chunk_len(request, num_cached + num_pulled, budget)
            if num_new == 0:
                break  # its first image does not fit in what is left of the step
            new_block_ids = self.kv.allocate_slots(request, num_pulled + num_new, cached_blocks)
            if new_block_ids is None:
                break
            if not request.skips_prefix_cache:
                self.kv.record_prefix_lookup(request.num_tokens, num_cached)
            self.waiting.popleft()
            self._start_running(request, num_cached)
            request.num_computed_tokens += num_pulled
            if request.lora is not None:
                adapters.add(request.lora)
            # NOTE: before the chunk reserves checkpoints of its own, which may evict this one.
            restore = self.kv.restore_checkpoint(request, num_cached)
            chunk = self._schedule_chunk(request, num_new, new_block_ids)
            chunk.restore_checkpoint = restore
            if request.kv_pulled is not None:
                chunk.kv_load = self._kv_load(request, num_cached, num_pulled, new_block_ids)
                if chunk.kv_load is not None and chunk.kv_load.state_paths:
                    chunk.restore_checkpoint = -1  # the pulled states are after the pulled blocks
            scheduled.append(chunk)
            budget -= num_new
        self.waiting.extendleft(reversed(not_ready))

    def _pulled_tokens(self, request: Request, num_cached: int) -> int:
        """The prompt tokens past its cached prefix that a consumer's pulled blocks hold (whole
        blocks, leaving at least one token to compute: its logits give the first output)."""
        pulled = request.kv_pulled
        if pulled is None:
            return 0
        num_blocks = min(pulled.num_blocks, (request.num_tokens - 1) // self.block_size)
        return max(num_blocks * self.block_size - num_cached, 0)

    def _kv_load(
        self, request: Request, num_cached: int, num_pulled: int, block_ids: list[list[int]]
    ) -> KVLoad | None:
        """The pulled blocks the request's first chunk loads (those past its cached prefix, into
        the blocks `block_ids` the chunk took, by group and position), and the external prefix
        cache's count; files with nothing to load go at once."""
        pulled = request.kv_pulled
        assert pulled is not None
        request.kv_pulled = None
        self.record_external_lookup(request.num_prompt_tokens - num_cached, num_pulled)
        if num_pulled == 0:
            remove([*pulled.paths, *pulled.state_paths])
            return None
        skip = num_cached // self.block_size
        end = skip + num_pulled // self.block_size
        if request.routing is not None:  # the pulled positions' rows, after the cached ones'
            row_bytes = request.routing.shape.row_bytes
            rows = pulled.routing[num_cached * row_bytes : (num_cached + num_pulled) * row_bytes]
            request.routing.add(num_cached, rows)
        src, dst = [], []
        for g, ids in enumerate(block_ids):  # the file: pulled.num_blocks of each group
            src += range(g * pulled.num_blocks + skip, g * pulled.num_blocks + end)
            dst += ids[skip:end]
        # The draft model reads the first group's tables: its blocks are those pairs (first).
        num_draft = end - skip if pulled.with_draft else 0
        return KVLoad(pulled.paths, src, dst, pulled.state_paths, num_draft)

    def end_kv_leases(self) -> None:
        """Every lent block goes back to the pool (their consumers' pulls fail)."""
        if self.leases is not None:
            self.leases.release_all()

    def record_external_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.external_prefix_cache_queries += num_tokens
        self.external_prefix_cache_hits += num_hit_tokens

    def _chunk_len(self, request: Request, start: int, budget: int) -> int:
        """The tokens a request computes this step from `start` within `budget`: all it has left
        that fit, ending before an image's placeholders when they must be computed whole and do
        not fit (0: none this step)."""
        num_new = min(request.num_tokens - start, budget)
        assert num_new > 0, request.request_id
        if self.whole_image_spans and request.mm_items:
            span = request.image_span_at(start + num_new)
            if span is not None:
                num_new = span[0] - start
        return num_new

    def _start_running(self, request: Request, num_cached: int) -> None:
        """A request taken from the waiting queue runs from its cached prefix on."""
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_cached
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.time()
        request.status = RequestStatus.RUNNING
        if self.num_state_slots:
            # NOTE: never empty: at most max_num_seqs run, and there are as many slots.
            request.state_slot = self.free_state_slots.pop()
        request.num_computed_tokens = num_cached
        if self.routing_shape is not None:
            self._start_routing(request, num_cached)
        self.running.append(request)

    def record_step_time(self, step: SchedulerOutput, seconds: float) -> None:
        """The time the workers took for `step`: a step of decodes only (each request one
        token after its outputs so far, and its drafts) feeds the drafter's model of step times."""
        if self.drafter is None:
            return
        if all(
            r.sample_index > 0 and len(r.token_ids) == 1 + r.num_draft_tokens for r in step.requests
        ):
            num_tokens = step.num_tokens + sum(r.num_model_drafts for r in step.requests)
            self.drafter.cost.observe(num_tokens, seconds)

    def _plan_drafts(self, budget: int) -> dict[str, list[int]]:
        """The drafts each decoding sequence verifies this step (Drafter.plan)."""
        if self.drafter is None or len(self.running) > self.drafter.max_batch:
            return {}
        proposals = {r.request_id: self._drafts(r, budget) for r in self.running}
        proposals = {k: v for k, v in proposals.items() if v}
        if not proposals:
            return {}
        plan = self.drafter.plan(proposals, len(self.running))
        return {k: proposals[k][:n] for k, n in plan.items() if n}

    def _drafts(self, request: Request, budget: int) -> list[int]:
        """Drafts for a decoding sequence, as many as its output, the context and the step's
        token budget leave room for; under a grammar, only those it accepts."""
        assert self.drafter is not None
        if request.num_output_tokens == 0 or request.num_computed_tokens != request.num_tokens - 1:
            return []  # still in its prompt
        grammar = request.grammar
        if grammar is not None and (not grammar.is_active or self.drafter.on_workers):
            # during the reasoning the grammar is not active yet, and a model drafter's
            # drafts (draft_model, mtp, eagle3) are not known here to be checked against it
            return []
        limit = min(
            budget - 1,
            request.sampling_params.max_tokens - request.num_output_tokens - 1,
            self.max_model_len - request.num_tokens,
        )
        if limit <= 0:
            return []
        drafts = self.drafter.draft(request.request_id, request.all_token_ids, limit)
        if grammar is not None and drafts:
            drafts = drafts[: grammar.valid_prefix(drafts)]
        return drafts

    def _adapter_fits(self, request: Request, running: set[Adapter]) -> bool:
        """Whether a request's LoRA adapter is loaded and one more distinct adapter (if it is
        one) keeps the step within --max-loras; `running`: the running requests' adapters."""
        adapter = request.lora
        if adapter is None:
            return True
        return adapter.slot >= 0 and (adapter in running or len(running) < self.max_loras)

    def running_adapters(self) -> set[Adapter]:
        return {r.lora for r in self.running if r.lora is not None}

    def _start_routing(self, request: Request, num_cached: int) -> None:
        """A request starting (or resuming) takes the routing rows of its cached blocks."""
        if request.routing is None:
            request.routing = RequestRouting(self.routing_shape)
        cache, routing = self.kv.routing, request.routing
        for i in range(num_cached // self.block_size):
            if (i + 1) * self.block_size > routing.num_rows:
                routing.add(i * self.block_size, cache.get(request.block_hashes[i]))
        routing.num_cached_blocks = max(routing.num_cached_blocks, num_cached // self.block_size)

    def _schedule_chunk(
        self,
        request: Request,
        num_new: int,
        new_block_ids: list[list[int]],
        drafts: Sequence[int] = (),
    ) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_new
        on_workers = self.drafter is not None and self.drafter.on_workers
        drafts_sent = () if on_workers else drafts  # a draft model's are drafted on the workers
        request.num_computed_tokens = end
        is_new = request.needs_new_state
        request.needs_new_state = False
        # A decode step computes the last sampled token; everything else is prefill work.
        if not (request.num_output_tokens > 0 and start == request.num_tokens - 1):
            self.num_prefill_tokens_total += num_new
        scheduled = ScheduledRequest(
            req_id=request.request_id,
            token_ids=[*request.all_token_ids[start:end], *drafts_sent],
            start_pos=start,
            new_block_ids=new_block_ids[0],
            other_group_block_ids=new_block_ids[1:],
            sample_index=request.num_output_tokens if end == request.num_tokens else -1,
            sampling_params=request.sampling_params if is_new else None,
            state_slot=request.state_slot if is_new else -1,
            lora_slot=request.lora.slot if is_new and request.lora is not None else -1,
            save_checkpoints=self.kv.checkpoints_to_save(request, start, end),
            num_draft_tokens=len(drafts_sent),
            num_model_drafts=len(drafts) if on_workers else 0,
        )
        if is_new and request.mm_items:
            scheduled.mm_items = [self._item_sent(item, start) for item in request.mm_items]
            scheduled.mm_items = [item for item in scheduled.mm_items if item is not None]
        if is_new and request.sampling_params.needs_history:
            scheduled.history_token_ids = list(request.all_token_ids)
            scheduled.num_prompt_tokens = request.num_prompt_tokens
        return scheduled

    def _item_sent(self, item: MultiModalItem, start: int) -> MultiModalItem | None:
        """An image as a request's first chunk, at `start`, sends it to the workers: whole when its
        placeholders are still to compute (an encoder-decoder's audio, which has none, always:
        every position attends to it); else its layout alone, or nothing."""
        if not item.spans or item.end > start:
            return item
        if not self.image_layout_tensors:
            return None
        layout = {k: v for k, v in item.tensors.items() if k in self.image_layout_tensors}
        return MultiModalItem(item.modality, item.content_hash, item.spans, layout)

    def retract_running(self) -> int:
        """Preempts every running request (SGLang's "retract" pause): their KV blocks are freed and
        they wait, in their order, to be recomputed and continue."""
        running = list(self.running)
        for request in reversed(running):
            self._preempt(request)
        return len(running)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        self._free_state_slot(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.needs_new_state = True
        request.num_preemptions += 1
        self.num_preempted_total += 1
        self._finished_req_ids.append(request.request_id)  # the worker drops its stale block table
        self.waiting.appendleft(request)

    def update_from_output(
        self, step: SchedulerOutput, output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Appends sampled tokens, finishes requests that stop, and returns what the frontend must see."""
        assert output.step_id == step.step_id, (output.step_id, step.step_id)
        if self.kv.checkpoints is not None:
            self.kv.checkpoints.publish()  # the step wrote them
        outputs = self._finish_pooled(output.pooled)
        if output.routed_experts:
            self._add_routing(step, output.routed_experts)
        if output.expert_tokens:
            total = self.expert_tokens_total or [0] * len(output.expert_tokens)
            self.expert_tokens_total = list(map(operator.add, total, output.expert_tokens))
        for request_id, chunk in output.prompt_logprobs.items():
            request = self.requests.get(request_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                request.add_prompt_logprobs(chunk)
        drafted = {
            r.req_id: r.num_draft_tokens + r.num_model_drafts
            for r in step.requests
            if r.num_draft_tokens or r.num_model_drafts
        }
        starts = {r.req_id: r.start_pos for r in step.requests}
        for request_id, token_ids in zip(output.req_ids, output.sampled_token_ids):
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            num_drafts = drafted.get(request_id, 0)
            if num_drafts:
                assert self.drafter is not None and len(token_ids) <= num_drafts + 1
                self.drafter.record(request_id, num_drafts, len(token_ids) - 1)
                # The accepted drafts' KV is valid; the rejected ones' is written over later.
                request.num_computed_tokens += len(token_ids) - 1
            out = self._append_tokens(request, token_ids)
            rows = output.cross_attention.get(request_id)
            if rows is not None:
                out.cross_attention = request.take_cross_attention(starts[request_id], rows)
            logprobs = output.logprobs.get(request_id)
            if logprobs is not None and logprobs.num_positions > len(out.new_token_ids):
                logprobs = logprobs.slice(0, len(out.new_token_ids))
            out.new_logprobs = logprobs
            outputs.append(out)
            if out.finish_reason is not None:
                self.running.remove(request)
                self._finish(request, out.finish_reason)
                if request.kv_lease_id is not None:
                    self._describe_lease(request, out)
        return outputs

    def _describe_lease(self, request: Request, out: EngineCoreOutput) -> None:
        """A finished producing request's last output says what it lent: its full prompt blocks
        of each KV-cache group (a lent prompt keeps its sliding-window blocks), their positions'
        routing rows when routing is recorded, a hybrid model's state checkpoint."""
        held = self.leases is not None and self.leases.holds(request.kv_lease_id)
        num_blocks = request.num_prompt_tokens // self.block_size if held else 0
        lent = [
            self.kv.block_ids(request, g)[:num_blocks] for g in range(len(self.kv.group_windows))
        ]
        out.kv_lease_block_ids, *out.kv_lease_other_block_ids = lent
        if request.routing is not None and out.kv_lease_block_ids:
            num_lent = len(out.kv_lease_block_ids) * self.block_size
            out.kv_lease_routing = request.routing.rows_of(0, num_lent)
        if request.kv_lease_checkpoint is not None:
            out.kv_lease_state_checkpoint = request.kv_lease_checkpoint[1]

    def _append_tokens(self, request: Request, token_ids: list[int]) -> EngineCoreOutput:
        """Appends a step's sampled tokens up to the first that stops the request (or breaks its
        grammar); the output carries them and what the first token's output owes the frontend."""
        new_token_ids: list[int] = []
        error, finish_reason = None, None
        for token_id in token_ids:
            request.append_output_token(token_id)
            new_token_ids.append(token_id)
            self.num_generated_tokens_total += 1
            if request.grammar is not None and not request.grammar.accept(token_id):
                error = f"token {token_id} was sampled against the request's grammar"
            finish_reason = FinishReason.ERROR if error else self._check_stop(request, token_id)
            if finish_reason is not None:
                break  # what follows a stop is dropped
        out = EngineCoreOutput(
            request.request_id,
            new_token_ids,
            finish_reason,
            num_cached_tokens=request.num_cached_tokens,
            error=error,
        )
        if request.routing is not None:
            out.routed_experts = request.routing.take_new()
        if request.num_output_tokens == 1:
            out.queued_time = request.queued_time
            out.first_scheduled_time = request.first_scheduled_time
            if request.sampling_params.prompt_logprobs is not None:
                out.prompt_logprobs = request.take_prompt_logprobs()
        return out

    def _add_routing(self, step: SchedulerOutput, routed: dict[str, bytes]) -> None:
        starts = {r.req_id: r.start_pos for r in step.requests}
        for request_id, data in routed.items():
            request = self.requests.get(request_id)
            if request is None or request.routing is None:
                continue  # finished or aborted while the step ran
            request.routing.add(starts[request_id], data)
            if self.kv.routing is not None:
                request.routing.cache_blocks(self.kv.routing, request.block_hashes, self.block_size)

    def _finish_pooled(self, pooled: dict[str, list[float]]) -> list[EngineCoreOutput]:
        """Pooling requests whose prompt the step completed: their one output, and they finish."""
        outputs = []
        for request_id, vector in pooled.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            outputs.append(
                EngineCoreOutput(
                    request_id,
                    [],
                    FinishReason.STOP,
                    num_cached_tokens=request.num_cached_tokens,
                    queued_time=request.queued_time,
                    first_scheduled_time=request.first_scheduled_time,
                    pooled=vector,
                )
            )
            self.running.remove(request)
            self._finish(request, FinishReason.STOP)
        return outputs

    def _check_stop(self, request: Request, token_id: int) -> FinishReason | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in params.eos_token_ids:
                return FinishReason.STOP
            if token_id in params.stop_token_ids:
                return FinishReason.STOP
        if request.grammar is not None and request.grammar.is_terminated:
            return FinishReason.STOP  # the grammar's output is complete: nothing may follow
        if request.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH
        if request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if self.drafter is not None:
            self.drafter.finish(request.request_id, request.output_token_ids)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        lease_id = request.kv_lease_id
        if (
            lease_id is not None
            and self.leases is not None
            and reason in (FinishReason.STOP, FinishReason.LENGTH)
        ):
            self.leases.lend(lease_id, request)  # its blocks go back when the lease ends
            self._pin_lent_states(request)
        else:
            self.kv.free(request)
        if request.kv_pulled is not None:  # never loaded
            remove([*request.kv_pulled.paths, *request.kv_pulled.state_paths])
            request.kv_pulled = None
        self._free_state_slot(request)
        del self.requests[request.request_id]
        if not request.needs_new_state:  # the worker holds state for it
            self._finished_req_ids.append(request.request_id)

    def _pin_lent_states(self, request: Request) -> None:
        """A hybrid model's lent prompt: the consumer resumes from the states after its last
        full block before its last token, which the prompt's chunk checkpointed (there, where
        the prefix cache wants one too); the lease keeps that checkpoint."""
        checkpoints = self.kv.checkpoints
        num_blocks = (request.num_prompt_tokens - 1) // self.block_size
        if checkpoints is None or num_blocks == 0:
            return
        prefix_hash = request.block_hashes[num_blocks - 1]
        slot = checkpoints.pin(prefix_hash)
        if slot is not None:
            request.kv_lease_checkpoint = (prefix_hash, slot)

    def _free_lent(self, request: Request) -> None:
        """A lease ends: its blocks go back to the pool, its checkpoint may be evicted."""
        self.kv.free(request)
        if request.kv_lease_checkpoint is not None and self.kv.checkpoints is not None:
            self.kv.checkpoints.unpin(request.kv_lease_checkpoint[0])
            request.kv_lease_checkpoint = None

    def _free_state_slot(self, request: Request) -> None:
        if request.state_slot >= 0:
            self.free_state_slots.append(request.state_slot)
            request.state_slot = -1

    # ----------------------------------------------------------------------------- introspection

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            num_preempted_total=self.num_preempted_total,
            num_free_blocks=self.kv.num_free_blocks,
            num_total_blocks=self.kv.num_total_blocks,
            block_size=self.block_size,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_prefill_tokens_total=self.num_prefill_tokens_total,
            num_generated_tokens_total=self.num_generated_tokens_total,
            num_state_slots=self.num_state_slots,
            num_free_state_slots=len(self.free_state_slots),
            num_state_checkpoints=self.kv.checkpoints.num_slots if self.kv.checkpoints else 0,
            num_used_state_checkpoints=self.kv.checkpoints.num_used if self.kv.checkpoints else 0,
            expert_tokens_total=list(self.expert_tokens_total),
            num_experts=self.num_experts,
            max_lora=self.max_loras,
            running_lora_adapters=sorted({a.name for a in self.running_adapters()}),
            waiting_lora_adapters=sorted({r.lora.name for r in self.waiting if r.lora}),
            external_prefix_cache_queries=self.external_prefix_cache_queries,
            external_prefix_cache_hits=self.external_prefix_cache_hits,
            kv_leases_total=self.leases.num_lent_total if self.leases is not None else 0,
            num_kv_leases=len(self.leases) if self.leases is not None else 0,
            **self._spec_stats(),
        )

    def _spec_stats(self) -> dict[str, int | list[int]]:
        if self.drafter is None:
            return {}
        s = self.drafter.stats
        return {
            "spec_num_drafts": s.num_drafts,
            "spec_num_draft_tokens": s.num_draft_tokens,
            "spec_num_accepted_tokens": s.num_accepted_tokens,
            "spec_accepted_per_pos": list(s.accepted_per_pos),
        }

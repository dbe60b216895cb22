"""EngineCore: one scheduling step at a time, with no sockets (core_proc.py is the process around it).

step() = schedule -> execute on the workers -> update request state. Used directly by tests and
scripts/bench_step.py with an in-process executor. The engine core's loop takes it in two halves,
launch_step() and finish_step(), and sends the outputs of one step after it has launched the next.

The served model either generates or pools (`model_task`, from config.json and --task): requests of
the other kind are refused with an error output, as are those that cannot be served at all.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from enginecore.config import Config
from enginecore.executor import Executor
from enginecore.kv_transfer.puller import KVPuller
from enginecore.lora import LoraError, LoraRegistry, adapter_spec, read_adapter_config
from enginecore.messages import (
    ControlCall,
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    KVPulled,
    LoadLora,
    SamplingParams,
    SchedulerOutput,
    SchedulerStats,
)
from enginecore.model_task import ModelTask, read_model_task
from enginecore.request import Request
from enginecore.scheduler import Scheduler
from enginecore.structured_output import GrammarCompiler, RequestGrammar

logger = logging.getLogger(__name__)

# How long a step with nothing to run waits for a compiling grammar before going back to its inputs.
GRAMMAR_WAIT_S = 0.02


class EngineCore:
    def __init__(self, config: Config, executor: Executor) -> None:
        self.config = config
        self.executor = executor
        self.model_task: ModelTask = read_model_task(
            config.model.path, config.model.task, config.model.language_model_only
        )
        hybrid = self.model_task.has_linear_attention
        if hybrid and config.cache.enable_prefix_caching:
            config = self.config = self._hybrid_prefix_caching(config, executor)
        if config.speculative.enabled and config.model.enable_return_routed_experts:
            raise ValueError("speculative decoding and --enable-return-routed-experts exclude "
                             "each other: drafts' routing is not recorded")  # fmt: skip
        self.max_model_len = executor.max_model_len
        self.scheduler = Scheduler(
            config,
            executor.num_kv_blocks,
            self.max_model_len,
            executor.kv_cache_windows,
            num_state_slots=config.scheduler.max_num_seqs if hybrid else 0,
            num_state_checkpoints=executor.num_state_checkpoints,
            state_checkpoint_interval=executor.state_checkpoint_interval,
            routing_shape=executor.routing_shape
            if config.model.enable_return_routed_experts
            else None,
            num_experts=executor.routing_shape.num_experts if executor.routing_shape else 0,
            whole_image_spans=self.model_task.whole_image_spans,
            image_layout_tensors=self.model_task.image_layout_tensors,
        )
        self._rng = random.Random()
        self.grammars = GrammarCompiler(
            config.model.path,
            executor.vocab_size,
            config.structured_output.bound_json_numbers,
        )
        # Waiting requests whose grammar is compiling, and its future.
        self._compiling: dict[str, tuple[Request, Future[Any]]] = {}
        self._in_flight: tuple[SchedulerOutput, float] | None = None  # launched, not finished
        self.loras = (
            LoraRegistry(config.lora, self._run_on_workers) if config.lora.enabled else None
        )
        self._on_adapter: dict[str, Request] = {}  # requests in flight on a LoRA adapter
        self._load_startup_adapters()
        self.kv_puller = self._kv_puller(config, executor)

    def _kv_puller(self, config: Config, executor: Executor) -> KVPuller | None:
        """Prefill/decode disaggregation moves the prompt's blocks of every KV-cache group (and a
        hybrid model's linear-attention states after them, and the positions' routing rows when
        they are recorded); a consumer pulls with a KVPuller."""
        if not config.kv_transfer.enabled:
            return None
        hybrid = self.model_task.has_linear_attention
        if hybrid and config.kv_transfer.produces and not config.cache.enable_prefix_caching:
            # The lease keeps the states after its blocks in a prefix-cache state checkpoint.
            raise ValueError(
                f"--kv-transfer-config cannot serve {self.model_task.architecture}: a hybrid "
                "producer keeps each prompt's linear-attention states in a prefix-cache "
                "checkpoint, and prefix caching is off (--no-enable-prefix-caching, or "
                "--kv-cache-memory leaves no room for a checkpoint)"
            )
        if not config.kv_transfer.consumes:
            return None
        routing = self.scheduler.routing_shape
        return KVPuller(
            config.kv_transfer, executor.kv_layouts, config.cache.block_size,
            config.ipc_path("kv_pulled"), with_states=hybrid,
            num_groups=len(executor.kv_cache_windows),
            routing_row_bytes=routing.row_bytes if routing is not None else 0,
        )  # fmt: skip

    def _hybrid_prefix_caching(self, config: Config, executor: Executor) -> Config:
        """A hybrid model caches prefixes only with room for its linear-attention state
        checkpoints; the config without prefix caching where there is none."""
        if executor.num_state_checkpoints:
            logger.info(
                "prefix caching on %s: %d linear-attention state checkpoints, taken every "
                "%d tokens and at each prompt's last block", self.model_task.architecture,
                executor.num_state_checkpoints, executor.state_checkpoint_interval,
            )  # fmt: skip
            return config
        # A hit would skip tokens whose linear-attention state is kept nowhere.
        logger.warning(
            "prefix caching is off: --kv-cache-memory leaves no room for a checkpoint "
            "of %s's linear-attention states", self.model_task.architecture,
        )  # fmt: skip
        return dataclasses.replace(
            config, cache=dataclasses.replace(config.cache, enable_prefix_caching=False)
        )

    def _run_on_workers(self, call: ControlCall) -> None:
        errors = self.executor.run_control(call)
        if errors:
            raise LoraError("; ".join(errors))

    def _load_startup_adapters(self) -> None:
        """--lora-modules: each served from the start (a bad one stops the server here)."""
        assert self.loras is not None or not self.config.lora.modules
        for name, path in self.config.lora.modules:
            rank, scaling = adapter_spec(read_adapter_config(path), self.config.lora.max_lora_rank)
            self.loras.load(name, LoadLora(-1, rank, scaling, path=path), None, ())

    def add_request(self, req: EngineCoreRequest) -> list[EngineCoreOutput]:
        """Queues a request. Returns an error output at once for a request that cannot be served."""
        error = self._validate(req)
        if error is not None:
            return [EngineCoreOutput(req.request_id, [], FinishReason.ERROR, error=error)]
        if req.pooling:
            # NOTE: neutral parameters: the worker must not read the client's (prompt logprobs...).
            request = Request(
                req.request_id,
                req.prompt_token_ids,
                SamplingParams(),
                req.arrival_time or None,
                pooling_type=self.config.model.pooling_type,
            )
            self.scheduler.add_request(request)
            return []
        params = req.sampling_params
        if params.seed is None:
            params.seed = self._rng.getrandbits(63)
        request = Request(
            req.request_id,
            req.prompt_token_ids,
            params,
            req.arrival_time or None,
            req.structured_output,
            mm_items=req.mm_items,
        )
        if req.lora_name is not None:
            try:
                request.lora = self.adapters().acquire(req.lora_name)
            except LoraError as e:
                return [EngineCoreOutput(req.request_id, [], FinishReason.ERROR, error=str(e))]
            self._on_adapter[req.request_id] = request
        if req.structured_output is not None:
            future = self.grammars.submit(req.structured_output, params.eos_token_ids)
            self._compiling[req.request_id] = (request, future)
        spec = req.kv_transfer
        if spec is not None and spec.role == "consume":
            assert self.kv_puller is not None  # _validate refused it otherwise
            self.kv_puller.park(request, spec)  # scheduled once its blocks are here
            return []
        if spec is not None:
            request.kv_lease_id = spec.lease_id
        self.scheduler.add_request(request)
        return []

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        outputs = []
        for request_id in request_ids:
            if self.kv_puller is not None and self.kv_puller.cancel(request_id) is not None:
                self._compiling.pop(request_id, None)
                outputs.append(EngineCoreOutput(request_id, [], FinishReason.ABORT))
        return self._ended(outputs + self.scheduler.abort_requests(request_ids))

    def kv_pulled(self, result: KVPulled) -> list[EngineCoreOutput]:
        """A consumer's pull ended: the request runs from the pulled blocks; or, when the pull
        failed, fails (load_failure_policy "fail") or computes its prompt itself ("recompute")."""
        assert self.kv_puller is not None
        request = self.kv_puller.take(result)
        if request is None:
            return []  # aborted meanwhile
        if result.error is None:
            request.kv_pulled = result
        else:
            self.scheduler.record_external_lookup(request.num_prompt_tokens, 0)
            if self.config.kv_transfer.load_failure_policy == "fail":
                self._compiling.pop(request.request_id, None)
                error = (
                    f"the prompt's KV cache could not be pulled from its producer: {result.error}"
                )
                out = EngineCoreOutput(request.request_id, [], FinishReason.ERROR, error=error)
                return self._ended([out])
        self.scheduler.add_request(request)
        return []

    def release_kv_leases(self, lease_ids: list[str]) -> None:
        """A producer's consumers took (or gave up on) these leases' blocks."""
        if self.scheduler.leases is not None:
            for lease_id in lease_ids:
                self.scheduler.leases.release(lease_id)

    def expire_kv_leases(self) -> None:
        if self.scheduler.leases is not None:
            self.scheduler.leases.expire()

    def fail_all(self, error: str) -> list[EngineCoreOutput]:
        """Ends every request, those waiting for their blocks too, with an error."""
        outputs = self.scheduler.fail_all(error)
        if self.kv_puller is not None:
            for request_id in list(self.kv_puller.parked):
                self.kv_puller.cancel(request_id)
                outputs.append(EngineCoreOutput(request_id, [], FinishReason.ERROR, error=error))
        return outputs

    def adapters(self) -> LoraRegistry:
        if self.loras is None:
            raise LoraError("this server was started without --enable-lora: it serves no adapter")
        return self.loras

    def _ended(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Finished requests give their adapter version back; their last output names it."""
        for out in outputs:
            if out.finish_reason is None:
                continue
            request = self._on_adapter.pop(out.request_id, None)
            if request is not None and request.lora is not None:
                out.lora_version = request.lora.version
                self.adapters().release(request.lora)
        return outputs

    def _load_waiting_adapters(self) -> list[EngineCoreOutput]:
        """Adapters evicted from the workers that waiting requests need, loaded again (as many
        as slots idle adapters free); the requests on one that no longer loads fail."""
        assert self.loras is not None
        running = self.scheduler.running_adapters()
        failed: list[EngineCoreOutput] = []
        for request in list(self.scheduler.waiting)[: self.config.scheduler.max_num_seqs]:
            adapter = request.lora
            if adapter is None or adapter.slot >= 0 or request.is_finished:
                continue
            try:
                if not self.loras.ensure_loaded(adapter, running):
                    break
            except LoraError as e:
                error = f"LoRA adapter {adapter.name!r} could not be loaded again: {e}"
                for r in list(self.scheduler.waiting):
                    if r.lora is adapter:
                        out = self.scheduler.fail_request(r.request_id, error)
                        failed += [out] if out is not None else []
        return failed

    def step(self, admit_waiting: bool = True) -> list[EngineCoreOutput]:
        """One step. admit_waiting=False runs only the requests already started (a pause)."""
        failed = self.launch_step(admit_waiting)
        return failed + self.finish_step()

    def launch_step(self, admit_waiting: bool = True) -> list[EngineCoreOutput]:
        """Schedules a step and starts it on the workers (finish_step collects it); returns the
        requests that failed before it could run (grammars, adapters)."""
        assert self._in_flight is None, "the last step was not finished"
        return self._ended(self._launch(admit_waiting))

    def finish_step(self) -> list[EngineCoreOutput]:
        """Waits for the step launch_step started and updates the requests from its output; []
        when none is in flight."""
        if self._in_flight is None:
            return []
        step, start = self._in_flight
        self._in_flight = None
        output = self.executor.collect_step()
        self.scheduler.record_step_time(step, time.perf_counter() - start)
        return self._ended(self.scheduler.update_from_output(step, output))

    def _launch(self, admit_waiting: bool) -> list[EngineCoreOutput]:
        self.expire_kv_leases()
        if not self.scheduler.has_requests:
            return []
        failed = self._take_compiled_grammars()
        if self.loras is not None:
            failed += self._load_waiting_adapters()
        step = self.scheduler.schedule(admit_waiting)
        if not step.requests:
            if self._compiling and not failed:
                futures = [future for _, future in self._compiling.values()]
                wait(futures, GRAMMAR_WAIT_S, FIRST_COMPLETED)
            return failed
        constrained = []  # (request id, its grammar, its drafts)
        for scheduled in step.requests:
            grammar = self.scheduler.requests[scheduled.req_id].grammar
            if grammar is not None and grammar.is_active and scheduled.sample_index >= 0:
                drafts = scheduled.token_ids[
                    len(scheduled.token_ids) - scheduled.num_draft_tokens :
                ]
                constrained.append((scheduled.req_id, grammar, drafts))
        step.grammar_bitmasks_follow = bool(constrained)

        def bitmasks() -> dict[str, bytes]:
            return {req_id: g.bitmasks_along(drafts) for req_id, g, drafts in constrained}

        start = time.perf_counter()
        self.executor.submit_step(step, bitmasks if constrained else None)
        self._in_flight = (step, start)
        return failed

    def _take_compiled_grammars(self) -> list[EngineCoreOutput]:
        """Gives each request whose grammar has compiled its matcher; fails those that did not."""
        failed = []
        for request_id, (request, future) in list(self._compiling.items()):
            assert request.structured_output is not None
            if not future.done():
                continue
            del self._compiling[request_id]
            if request.is_finished:
                continue  # aborted while compiling
            try:
                compiled = future.result()
            except Exception as e:
                out = self.scheduler.fail_request(request_id, f"the grammar did not compile: {e}")
                failed += [out] if out is not None else []
                continue
            end = request.structured_output.reasoning_end_token_ids
            request.grammar = RequestGrammar(compiled, self.grammars, end)
        return failed

    def stats(self) -> SchedulerStats:
        stats = self.scheduler.stats()
        puller = self.kv_puller
        if puller is not None:
            stats.kv_pulls_total = puller.num_pulls_total
            stats.kv_pull_failures_total = puller.num_failures_total
            stats.kv_pull_bytes_total = puller.num_bytes_total
        return stats

    def shutdown(self) -> None:
        if self.kv_puller is not None:
            self.kv_puller.shutdown()
        self.grammars.shutdown()
        self.executor.shutdown()

    def _validate(self, req: EngineCoreRequest) -> str | None:
        if req.request_id in self.scheduler.requests:
            return f"duplicate request id {req.request_id!r}"
        task = self.model_task
        if req.pooling and not task.is_pooling:
            return (
                "this model is served for text generation (task generate); embedding, "
                "classification and reward requests need a model served with --task embed, "
                "classify or reward"
            )
        if not req.pooling and task.is_pooling:
            return f"this model is served for task {task.task!r}: it cannot generate text"
        n = len(req.prompt_token_ids)
        if n == 0:
            return "the prompt is empty"
        # A pooling request may fill the context: no token follows its prompt.
        if n > self.max_model_len or (n == self.max_model_len and not req.pooling):
            return f"the prompt has {n} tokens; the context length is {self.max_model_len}"
        vocab = self.executor.vocab_size
        if any(t < 0 or t >= vocab for t in req.prompt_token_ids):
            return f"prompt token ids must be in [0, {vocab})"
        if req.kv_transfer is not None:
            error = self._validate_kv_transfer(req)
            if error is not None:
                return error
        if req.pooling:
            if req.structured_output is not None:
                return "a pooling request cannot have a structured output"
            return None
        if req.sampling_params.max_tokens < 1:
            return "max_tokens must be at least 1"
        if req.mm_items or self.model_task.is_encoder_decoder:
            error = self._validate_mm_items(req)
            if error is not None:
                return error
        return _validate_sampling(req.sampling_params, vocab)

    def _validate_kv_transfer(self, req: EngineCoreRequest) -> str | None:
        spec = req.kv_transfer
        assert spec is not None
        config = self.config.kv_transfer
        if spec.role == "produce" and not config.produces:
            return (
                "this server does not produce KV caches for others (--kv-transfer-config kv_role)"
            )
        if spec.role == "consume" and not config.consumes:
            return "this server does not consume others' KV caches (--kv-transfer-config kv_role)"
        if spec.role not in ("produce", "consume"):
            return f"unknown KV transfer role {spec.role!r}"
        if spec.role == "consume" and not spec.bootstrap_addr.startswith("tcp://"):
            return "a consuming request needs its producer's bootstrap address (tcp://host:port)"
        if req.pooling:
            return "pooling requests are not disaggregated"
        return None

    def _validate_mm_items(self, req: EngineCoreRequest) -> str | None:
        task = self.model_task
        if task.is_encoder_decoder:
            return _validate_audio_items(req)
        for item in req.mm_items:
            served = task.takes_audio if item.modality == "audio" else task.takes_images
            if not served:
                return f"{task.architecture} is served without {item.modality} inputs"
        if req.pooling:
            return "a pooling request cannot carry images"
        n, last_end = len(req.prompt_token_ids), 0
        budget = self.config.scheduler.max_num_batched_tokens
        for item in req.mm_items:
            for start, length in item.spans:
                if start < last_end or length < 1 or start + length > n:
                    return "image placeholder spans must be in order, inside the prompt"
                if task.whole_image_spans and length > budget:
                    return (
                        f"an image takes {length} tokens, computed in one step on this model; "
                        f"--max-num-batched-tokens is {budget}"
                    )
                last_end = start + length
        return None


def _validate_audio_items(req: EngineCoreRequest) -> str | None:
    """An encoder-decoder's request: one audio item, its features, no placeholders."""
    if req.pooling:
        return "a pooling request cannot carry audio"
    if len(req.mm_items) != 1 or req.mm_items[0].modality != "audio":
        return "a request to a speech-to-text model carries exactly one audio item"
    item = req.mm_items[0]
    if item.spans or "input_features" not in item.tensors:
        return "an audio item carries its input_features and no placeholder spans"
    return None


def _validate_sampling(p: SamplingParams, vocab_size: int) -> str | None:
    """What the worker would fail on, caught before the request reaches it (the frontend checks the
    same with messages for the client; this guards other clients of the engine core)."""
    token_ids = [
        *p.allowed_token_ids, *p.logit_bias, *p.stop_token_ids, *p.eos_token_ids,
        *p.suppress_token_ids, *p.begin_suppress_token_ids,
    ]  # fmt: skip
    if any(not 0 <= t < vocab_size for t in token_ids):
        return f"token ids in sampling parameters must be in [0, {vocab_size})"
    if p.repetition_penalty <= 0:
        return "repetition_penalty must be positive"
    for k in (p.logprobs, p.prompt_logprobs):
        if k is not None and not 0 <= k <= vocab_size:
            return f"logprobs must be in [0, {vocab_size}]"
    return None

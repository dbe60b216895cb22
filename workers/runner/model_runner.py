"""Runs the model for one scheduler step: flat batch in, one forward pass, sampled tokens out.

The model runner owns the model, the paged KV cache and, per request, the block table and sampling
parameters the engine core sent when it scheduled the request. It knows nothing about scheduling,
stop conditions or text. Each step it
1. forgets finished requests, starts or extends the block tables of the scheduled ones;
2. flattens every scheduled token (prefill chunks and decodes mixed) into one batch and builds the
   attention metadata (positions, cache slots, block tables, gather indices) for it;
3. runs the image encoder on the images the step's chunks reach first (images.py) or an
   encoder-decoder's audio encoder on the requests it starts (audio.py), the model once,
   and the LM head only on the last token of the requests that sample (and on the prompt positions
   of requests that asked for prompt logprobs);
4. samples those rows (logits processors first) and returns the tokens in batch order, with the
   logprobs of the requests that asked for them.
A pooling model (--task embed, classify, reward) samples nothing: step 3 adds each request's
chunk to its pooling state (workers/layers/pooler.py) and, for the requests whose prompt ends this
step, runs the model's head on the pooled hidden state and returns the vectors by request id.

Under tensor/pipeline parallelism every rank runs every step (all read the same broadcast and keep
the same block tables). A pipeline stage other than the first receives the previous stage's hidden
states instead of embedding tokens, and one other than the last sends its own on and returns an
empty output; one micro-batch is in flight at a time, so stages do not overlap. Only the driver
(TP rank 0 of the last stage) samples: the other last-stage ranks take part in the LM head's
all-gather and return an empty output. Pooled vectors travel the same way: every last-stage rank
pools (the hidden states are replicated after the all-reduce) and runs the head, the driver returns.

The runner is the step; what it holds lives beside it in workers/runner/: the requests' states and
each step's batch (inputs.py), their images and the encoder cache (images.py), the KV cache and
state pools (kv_cache.py), the model's loading, dtypes and weights (loading.py), the MoE routing
capture (routing.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from enginecore.config import Config
from enginecore.messages import (
    BitmaskSource,
    KVLayout,
    ModelRunnerOutput,
    RoutingShape,
    ScheduledRequest,
    SchedulerOutput,
)
from enginecore.model_task import WHOLE_IMAGE_SPAN_ARCHITECTURES
from workers.distributed import ParallelContext
from workers.kernels import fused_decode, memory_floor
from workers.kv_transfer.layout import kv_layout
from workers.kv_transfer.loader import load_pulled_blocks
from workers.kv_transfer.states import load_pulled_states
from workers.layers.attention import AttentionMetadata
from workers.layers.pooler import Pooler, PoolingState
from workers.models.args import load_model_args
from workers.models.kv_cache_groups import KVCacheGroup
from workers.runner.audio import AudioInputs
from workers.runner.images import ImageInputs
from workers.runner.inputs import StepInputs
from workers.runner.kv_cache import KVCache
from workers.runner.loading import (
    ServedWeights,
    build_drafter,
    build_served_model,
    default_device,
    describe_model,
    make_batch_invariant,
    served_dtypes,
)
from workers.runner.mrope import mrope_layout
from workers.runner.routing import RoutingCapture
from workers.sample.logprobs import prompt_logprobs, prompt_logprobs_jobs
from workers.sample.sampler import Sampler
from workers.sample.step import draw_step
from workers.spec.drafter import Drafter
from workers.spec.verification import SampleRows

logger = logging.getLogger(__name__)

_DEFAULT_MAX_MODEL_LEN = 32768


class ModelRunner:
    def __init__(
        self,
        config: Config,
        rank: int = 0,
        device: torch.device | None = None,
        parallel: ParallelContext | None = None,
    ) -> None:
        if parallel is None:
            if config.parallel.world_size > 1:
                raise ValueError("a multi-rank ModelRunner needs its ParallelContext")
            parallel = ParallelContext.single()
        self.config = config
        self.rank = rank
        self.parallel = parallel
        self.device = device or default_device(rank)
        self.dtype, self.weight_dtype, self.quantize_x = served_dtypes(config, self.device)
        self.block_size = config.cache.block_size
        self.args = replace(
            load_model_args(config.model.path, config.model.task, config.model.language_model_only),
            quantization=None if config.model.quantization == "int4" else config.model.quantization,
            expert_parallel=config.parallel.enable_expert_parallel,
        )
        self.pooler = None if self.args.task == "generate" else Pooler(config.model.pooling_type)
        self.model: torch.nn.Module | None = None
        self.weights: ServedWeights | None = None
        self.routing: RoutingCapture | None = None
        self.inputs = StepInputs(config, self.device, is_pooling=self.pooler is not None)
        self.cache = KVCache(config, self.args, parallel, self.dtype, self.device)
        self.kv_cache: torch.Tensor | None = None
        self.num_kv_blocks = 0
        self.num_state_checkpoints = 0  # rows after the sequences' in the state pools
        # False after the weights were discarded (sleep level 2) until an update commits new ones.
        self.weights_valid = True
        self.sampler = Sampler()
        # Speculative decoding's drafter on the workers, if any (loading.build_drafter).
        self.draft: Drafter | None = None
        # The running requests' images and their encoder outputs (models whose images are served).
        self.images: ImageInputs | None = None
        # An encoder-decoder's running requests' audio: cross-attention keys and values (audio.py).
        self.audio: AudioInputs | None = None
        self._processed_logprobs = config.model.logprobs_mode == "processed_logprobs"
        # Seconds spent in each phase of the last step (scripts/bench_step.py reads it).
        self.last_step_timings: dict[str, float] = {}

    # ------------------------------------------------------------------ set-up

    def load_model(self) -> None:
        model, lora_batch = build_served_model(
            self.config, self.args, self.parallel, self.device, (self.dtype, self.weight_dtype),
            self.quantize_x,
        )  # fmt: skip
        self.model = model
        self.routing = RoutingCapture(model)
        if self.routing.shape is None and self.config.model.enable_return_routed_experts:
            raise ValueError(
                "--enable-return-routed-experts needs a mixture-of-experts model; "
                f"{self.args.architecture} has no expert layers"
            )
        if self.config.model.batch_invariant:
            make_batch_invariant(model, self.device, self.args.architecture)
        self.draft = build_drafter(
            self.config, model, self.args, self.parallel, self.device, self.dtype
        )
        self.weights = ServedWeights(model, self.draft)
        if self.args.takes_images or self.args.takes_audio:  # placeholders an encoder fills
            whole = self.args.architecture in WHOLE_IMAGE_SPAN_ARCHITECTURES
            self.images = ImageInputs(
                model.vision, self.device, bidirectional=whole,
                mrope=mrope_layout(self.args.image_config),
            )  # fmt: skip
            self.weights.on_change.append(self.images.weights_changed)
        if self.args.is_encoder_decoder:
            self.audio = AudioInputs(model, self.device)
            self.weights.on_change.append(self.audio.weights_changed)
        self.cache.bind(model, self.draft)
        self.inputs.bind(model, lora_batch, self.draft, self.max_model_len)
        self.weights.repack()
        logger.info("loaded %s", self.model_summary)

    def init_kv_cache(self, num_blocks: int, num_state_checkpoints: int = 0) -> None:
        """Allocate the KV cache of `num_blocks` and the state pools (kv_cache.py)."""
        if self.model is None:
            raise RuntimeError("load_model must run before init_kv_cache")
        self.kv_cache = self.cache.allocate(num_blocks, num_state_checkpoints)
        self.num_kv_blocks = num_blocks
        self.num_state_checkpoints = num_state_checkpoints
        self.inputs.cache_allocated(num_blocks, num_state_checkpoints)
        self.storage_moved()

    def kv_layout(self) -> KVLayout:
        """What this rank's KV blocks are (prefill/decode disaggregation)."""
        block_shape, dtype = self.cache.block_shape()
        draft = self.draft.kv_layout() if self.draft is not None else ""
        return kv_layout(self.config, self.args, block_shape, dtype, self.rank, draft)

    def draft_kv_cache(self) -> torch.Tensor | None:
        """The draft model's own KV cache (what travels with the blocks), if it has one."""
        return self.draft.kv_blocks() if self.draft is not None else None

    def release_kv_cache(self) -> None:
        """Frees the KV cache (sleep); init_kv_cache(self.num_kv_blocks,
        self.num_state_checkpoints) brings it back."""
        self.cache.release()
        self.kv_cache = None
        self.inputs.cache_allocated(self.num_kv_blocks, self.num_state_checkpoints)
        self.storage_moved()

    def kernel_report(self) -> str:
        """Which CPU kernels this worker runs and whether its decoder layers run fused."""
        assert self.model is not None
        return fused_decode.kernel_report(self.model, self.device)

    def decode_floor(self, remembered: bool = True) -> memory_floor.DecodeFloor | None:
        """This rank's decode floor on a CPU: its weights per step over the read bandwidth,
        measured now or (`remembered`) at an earlier start on this CPU (None on an accelerator:
        no probe buffer beside its allocated KV cache)."""
        assert self.model is not None
        if self.device.type != "cpu":
            return None
        return memory_floor.measure_floor(self.model, remembered)

    def kv_cache_bytes_per_block(self) -> int:
        return self.cache.bytes_per_block()

    def num_kv_blocks_for_memory(self) -> int:
        return self.cache.num_blocks_for_memory()

    def plan_state_checkpoints(self) -> tuple[int, int]:
        return self.cache.plan_state_checkpoints()

    def routing_shape(self) -> RoutingShape | None:
        """What one token's routing row holds (mixture-of-experts models), over the whole model."""
        assert self.routing is not None
        return self.routing.shape

    def storage_moved(self) -> None:
        """The weights' or the cache's storage may have moved (loading.ServedWeights)."""
        assert self.weights is not None
        self.weights.storage_moved()

    # ------------------------------------------------------------------ properties

    @property
    def kv_cache_groups(self) -> list[KVCacheGroup]:
        return self.inputs.kv_cache_groups

    @property
    def max_model_len(self) -> int:
        limit = self.config.model.max_model_len or _DEFAULT_MAX_MODEL_LEN
        return min(self.args.max_position_embeddings, limit)

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def model_summary(self) -> str:
        return describe_model(
            self.args, self.model, self.parallel, self.pooler, self.dtype, self.weight_dtype
        )

    # ------------------------------------------------------------------ the step

    def execute_model(
        self, step: SchedulerOutput, bitmasks: BitmaskSource | None = None
    ) -> ModelRunnerOutput:
        """`bitmasks`: the grammar bitmasks of the step's constrained requests (GrammarBitmasks),
        needed when step.grammar_bitmasks_follow; called by the sampling rank after the forward."""
        output, _ = self._execute(step, want_logprobs=False, bitmasks=bitmasks)
        return output

    def execute_model_with_logprobs(
        self, step: SchedulerOutput
    ) -> tuple[ModelRunnerOutput, torch.Tensor]:
        """Also returns log_softmax of the raw logits (before temperature) of the rows that sampled,
        (N, vocab) float32 on the CPU, in the order of `req_ids`."""
        output, logprobs = self._execute(step, want_logprobs=True)
        if logprobs is None:  # no row sampled (every request mid-prefill)
            logprobs = torch.empty(0, self.args.vocab_size)
        return output, logprobs

    @torch.inference_mode()
    def _execute(
        self,
        step: SchedulerOutput,
        want_logprobs: bool,
        bitmasks: BitmaskSource | None = None,
    ) -> tuple[ModelRunnerOutput, torch.Tensor | None]:
        if self.model is None or self.kv_cache is None:
            raise RuntimeError("the model and the KV cache must be initialised before a step")
        timings = self.last_step_timings = {}
        t0 = time.perf_counter()
        empty = ModelRunnerOutput(step.step_id, [], [])
        prepared = self._prepare(step)
        if prepared is None:
            return empty, None
        reqs, input_ids, meta = prepared
        t1 = time.perf_counter()
        timings["prepare"] = t1 - t0
        hidden, routes = self._forward(reqs, input_ids, meta)
        t2 = time.perf_counter()
        timings["forward"] = t2 - t1
        p = self.parallel
        if not p.is_last_stage:
            p.send_to_next_stage(hidden)
            if routes is not None and routes.size(1):
                p.send_to_next_stage(routes)
            return empty, None
        routed: dict[str, bytes] = {}
        expert_tokens: list[int] = []
        if routes is not None and p.is_driver:
            assert self.routing is not None
            if self.config.model.enable_return_routed_experts:
                routed = self.routing.per_request(routes, reqs, meta.query_start_loc.tolist())
            expert_tokens = self.routing.expert_tokens(routes)
        if self.pooler is not None:
            output = self._pool(step, hidden, meta.query_start_loc.tolist())
            timings["pool"] = time.perf_counter() - t2
            return output, None
        output = ModelRunnerOutput(
            step.step_id, [], [], routed_experts=routed, expert_tokens=expert_tokens
        )
        if self.audio is not None:  # word timestamps' cross-attention (a collective)
            output.cross_attention = self.audio.captured(meta.cross_attention, reqs, p)
        return self._sample(step, reqs, hidden, meta, output, bitmasks, want_logprobs)

    def _prepare(
        self, step: SchedulerOutput
    ) -> tuple[list[ScheduledRequest], torch.Tensor, AttentionMetadata] | None:
        """The step's requests in the persistent state (inputs, images, audio), then, unless the
        step has none, its batch: the requests (with the draft model's drafts), the input ids and
        the attention metadata (M-RoPE positions, cross-attention rows)."""
        self.inputs.update(step)
        if self.images is not None:
            self.images.update(step)
        if self.audio is not None:
            self.audio.update(step)
        reqs = step.requests
        if not reqs:
            return None
        load_pulled_blocks(self.kv_cache, reqs, self.rank, self.draft_kv_cache())
        load_pulled_states(reqs, self.rank, self.inputs.request_states)
        self.inputs.validate(reqs)
        if self.draft is not None:
            reqs = self.inputs.add_model_drafts(reqs)
        spans = self.images.bidirectional_spans(reqs) if self.images is not None else None
        input_ids, meta = self.inputs.build(reqs, spans)
        if self.images is not None:
            meta.set_mrope_positions(self.images.rope_positions(reqs))
        if self.audio is not None:
            meta.cross_kv = self.audio.batch(reqs)
            meta.cross_attention = self.audio.capture(
                reqs, [self.inputs.requests[r.req_id].sampling_params for r in reqs]
            )
        return reqs, input_ids, meta

    def _forward(
        self, reqs: list[ScheduledRequest], input_ids: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model over the step's batch -> (its hidden states, the step's routing or None).
        (T, hidden) on the last stage; (2, T, hidden), hidden states and residual, on the others;
        a later stage takes the previous one's (and its routing) first."""
        assert self.model is not None and self.routing is not None
        p, routing = self.parallel, self.routing
        intermediate, earlier_routes = None, None
        num_tokens = input_ids.numel()
        if not p.is_first_stage:
            shape = (2, num_tokens, self.args.hidden_size)
            intermediate = p.recv_from_prev_stage(shape, self.dtype, self.device)
            if routing.layers_before:
                shape = (num_tokens, routing.layers_before, routing.top_k)
                earlier_routes = p.recv_from_prev_stage(shape, torch.int16, self.device)
        image_embeds = self.images.embeddings(reqs) if self.images is not None else None
        # Every step's routing is counted (tern:moe_expert_tokens); requests get it on demand.
        routing.start()
        hidden = self.model(input_ids, meta, intermediate, image_embeds)
        self.inputs.keep_drafted_states(reqs, meta.draft_seqs)
        if self.draft is not None:  # (a pooling model has no MTP head)
            mtp = getattr(self.model, "mtp", None)
            features = hidden if mtp is not None else self.model.model.features
            self.draft.record(reqs, features, meta.query_start_loc.tolist())
        routes = routing.collect(earlier_routes, num_tokens) if routing.is_on else None
        return hidden, routes

    def _sample(
        self,
        step: SchedulerOutput,
        reqs: list[ScheduledRequest],
        hidden: torch.Tensor,
        meta: AttentionMetadata,
        output: ModelRunnerOutput,
        bitmasks: BitmaskSource | None,
        want_logprobs: bool,
    ) -> tuple[ModelRunnerOutput, torch.Tensor | None]:
        """The LM head on the rows that sample (and on prompt-logprob positions), then sampling
        on the driver: `output` (the step's routing so far) with the tokens and logprobs."""
        assert self.model is not None
        t2, timings = time.perf_counter(), self.last_step_timings
        sampling = [i for i, r in enumerate(reqs) if r.sample_index >= 0]
        states = [self.inputs.requests[r.req_id] for r in reqs]
        # NOTE: every rank of the last stage runs these LM-head rows too (a collective under TP).
        prompt_lps = prompt_logprobs(
            self.model.compute_logits,
            hidden,
            prompt_logprobs_jobs(
                reqs, [s.sampling_params for s in states], [s.history for s in states]
            ),
        )
        output.prompt_logprobs = prompt_lps if self.parallel.is_driver else {}
        if not sampling:
            return output, None
        # Each sampling request's rows: its last position, or with drafts its last k + 1.
        rows = SampleRows.of(
            [reqs[i] for i in sampling], meta.query_start_loc[1:][sampling].tolist()
        )
        logits = self.model.compute_logits(hidden[rows.positions(self.device)]).float()  # (R, V)
        t3 = time.perf_counter()
        timings["lm_head"] = t3 - t2
        if not self.parallel.is_driver:  # the logits were a collective; the driver samples
            return ModelRunnerOutput(step.step_id, [], []), None
        masks: dict[str, bytes] = {}
        if step.grammar_bitmasks_follow:
            if bitmasks is None:
                raise ValueError(f"step {step.step_id} needs grammar bitmasks; none were given")
            masks = bitmasks()
        output.req_ids = [reqs[i].req_id for i in sampling]
        drawn = draw_step(
            self.sampler, logits, rows, output.req_ids,
            [states[i].sampling_params for i in sampling],
            [reqs[i].sample_index for i in sampling],
            [states[i].history for i in sampling],
            [masks.get(req_id) for req_id in output.req_ids],
            self._processed_logprobs,
        )  # fmt: skip
        output.sampled_token_ids, output.logprobs = drawn.token_ids, drawn.logprobs
        logprobs = logits.log_softmax(dim=-1).cpu() if want_logprobs else None
        timings["sample"] = time.perf_counter() - t3
        return output, logprobs

    def _pool(
        self, step: SchedulerOutput, hidden: torch.Tensor, starts: list[int]
    ) -> ModelRunnerOutput:
        """Adds each request's chunk (rows starts[i]:starts[i + 1] of `hidden`) to its pooling;
        the requests whose prompt ends this step get the head's output on their pooled state."""
        assert self.pooler is not None
        ending: list[tuple[str, PoolingState]] = []
        for i, r in enumerate(step.requests):
            state = self.inputs.requests[r.req_id].pooling
            assert state is not None
            self.pooler.add_chunk(state, hidden[starts[i] : starts[i + 1]], r.start_pos)
            if r.sample_index >= 0:  # the prompt's last chunk
                ending.append((r.req_id, state))
        if not ending:
            return ModelRunnerOutput(step.step_id, [], [])
        pooled = torch.stack([self.pooler.pooled(state) for _, state in ending])  # (N, hidden)
        vectors = self.model.compute_pooled(pooled)  # (N, pooled_size) float32
        if not self.parallel.is_driver:  # the head may have been a collective; the driver answers
            return ModelRunnerOutput(step.step_id, [], [])
        rows = vectors.cpu().tolist()
        return ModelRunnerOutput(
            step.step_id, [], [], pooled={req_id: row for (req_id, _), row in zip(ending, rows)}
        )

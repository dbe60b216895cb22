"""Runs the model for one scheduler step: flat batch in, one forward pass, sampled tokens out.

The model runner owns the model, the paged KV cache and, per request, the block table and sampling
parameters the engine core sent when it scheduled the request. It knows nothing about scheduling,
stop conditions or text. Each step it
1. forgets finished requests, starts or extends the block tables of the scheduled ones;
2. flattens every scheduled token (prefill chunks and decodes mixed) into one batch and builds the
   attention metadata (positions, cache slots, block tables, gather indices) for it;
3. runs the model once and the LM head only on the last token of the requests that sample (and
   on the prompt positions of requests that asked for prompt logprobs);
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
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import torch

from enginecore.config import Config, ParallelConfig
from enginecore.messages import (
    BitmaskSource,
    Logprobs,
    ModelRunnerOutput,
    RoutingShape,
    SamplingParams,
    ScheduledRequest,
    SchedulerOutput,
)
from workers.distributed import ParallelContext, shard_heads, stage_layers
from workers.kernels import fused_decode, kernel_library
from workers.layers.attention import Attention, build_attention_metadata
from workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from workers.layers.gated_delta_net import CHUNK, GatedDeltaNet
from workers.layers.linear import LinearBase
from workers.layers.lora import LoraBatch
from workers.layers.moe import SparseMoE
from workers.layers.norm import RMSNorm
from workers.layers.pooler import Pooler, PoolingState
from workers.lora_adapters import attach_lora_stacks
from workers.models.args import ModelArgs, load_model_args
from workers.models.decoder import mlp_shard_of
from workers.models.eagle3 import load_eagle3_head
from workers.models.mtp import attach_mtp
from workers.models.registry import build_model
from workers.quant import kv_int8
from workers.quant.gguf_weights import gguf_file_of
from workers.quant.quantized_checkpoints import checkpoint_quantization
from workers.runner.kv_cache_groups import KVCacheGroup
from workers.sample.logits_processors import TokenHistory
from workers.sample.logprobs import (
    logprob_rows,
    prompt_logprobs,
    prompt_logprobs_jobs,
    sampled_logprobs_rows,
)
from workers.sample.sampler import Sampler, SamplingTensors
from workers.spec.draft_model import DraftModel
from workers.spec.head_drafter import HeadDrafter
from workers.spec.speculative import SampleRows
from workers.weight_loader import keep_blocks_everywhere, load_checkpoint, load_weights

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DEFAULT_MAX_MODEL_LEN = 32768
# The share of --kv-cache-memory (after the running sequences' states) that a hybrid model's
# linear-attention state checkpoints take when prefix caching is on.
CHECKPOINT_SHARE = 0.25


def check_parallel_split(args: ModelArgs, parallel: ParallelConfig) -> None:
    """Raise a ValueError naming the numbers when the model cannot be split as `parallel` asks."""
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    for tp_rank in range(tp):
        shard_heads(args.num_attention_heads, args.num_key_value_heads, tp, tp_rank)
        mlp_shard_of(args, tp, tp_rank)
    stage_layers(args.num_hidden_layers, pp, 0)


def default_device(rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def _cpu_has_fast_bf16() -> bool:
    """AVX512-BF16 or AMX, and tern's kernels not held to a tier without them (TERN_KERNELS=avx2
    runs tern as an AVX2-only CPU would)."""
    if not {"avx512_bf16", "amx_bf16"} & kernel_library.cpu_features():
        return False
    tier = kernel_library.active_tier_name()
    return tier in ("off", "avx512_bf16", "amx")


def resolve_dtypes(name: str, device: torch.device) -> tuple[torch.dtype, torch.dtype]:
    """(the activations' dtype, the linear and embedding weights' dtype).

    "auto" is bfloat16 where the device computes it fast, else float32. "bfloat16" asked of a CPU
    without bfloat16 arithmetic (where torch emulates it, ~10x slower than float32) keeps the
    weights bfloat16, half float32's bytes, and computes in float32: each weight is widened as it
    is used (linear.dense_linear), so the results are float32 arithmetic on bfloat16 weights."""
    if device.type == "cuda":
        fast_bf16 = torch.cuda.is_bf16_supported()
    else:
        fast_bf16 = device.type == "cpu" and _cpu_has_fast_bf16()
    if name == "auto":
        dtype = torch.bfloat16 if fast_bf16 else torch.float32
        return dtype, dtype
    if name == "bfloat16" and device.type == "cpu" and not fast_bf16:
        return torch.float32, torch.bfloat16
    return _DTYPES[name], _DTYPES[name]


def store_weights_in_bfloat16(model: torch.nn.Module) -> None:
    """Every unquantized linear and embedding weight of a float32 model re-allocated bfloat16, before
    the checkpoint is loaded into it (the weight loaders' copies round to bfloat16)."""
    for module in model.modules():
        if isinstance(module, (LinearBase, VocabParallelEmbedding)) and module.quant is None:
            if module.weight.dtype == torch.float32:  # a tied LM head shares the embedding's
                module.weight.data = torch.empty_like(module.weight, dtype=torch.bfloat16)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


# Weight updates name a draft model's (or an EAGLE-3 head's) tensors with this prefix.
DRAFT_WEIGHT_PREFIX = "draft."


@dataclass
class _RequestState:
    block_tables: list[list[int]]  # one per KV-cache group
    sampling_params: SamplingParams
    history: TokenHistory | None = None  # every token, when sampling reads them (penalties...)
    pooling: PoolingState | None = None  # pooling models: the prompt's pooling so far
    state_slot: int = -1  # hybrid models: its row in the linear-attention state pools
    lora_slot: int = -1  # the LoRA adapter it runs on (workers/lora_adapters.py), -1: none
    # Hybrid models, after a step that verified drafts: its first position and token count, and
    # each linear-attention layer's states after each of its tokens (GatedDeltaNet._verify).
    drafted: tuple[int, int, list[tuple[torch.Tensor, torch.Tensor]]] | None = None


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
        # Block-quantized weights (a GGUF file, a GPTQ / AWQ checkpoint, --quantization int4):
        # --dtype float32 multiplies the blocks exactly; any other --dtype takes the fast path
        # (activations quantized per block), and "auto" keeps float32 activations, which the
        # block kernels and the fused decode layer take.
        self.int4 = config.model.quantization == "int4"
        checkpoint_quant = checkpoint_quantization(config.model.path)
        keeps_blocks = (
            gguf_file_of(config.model.path) is not None
            or (checkpoint_quant is not None and checkpoint_quant.keeps_int4)
            or self.int4
        )
        auto = config.model.dtype == "auto"
        float32 = (keeps_blocks or config.model.batch_invariant) and auto
        dtype_name = "float32" if float32 else config.model.dtype
        self.quantize_x = keeps_blocks and config.model.dtype != "float32"
        self.dtype, self.weight_dtype = resolve_dtypes(dtype_name, self.device)
        self.block_size = config.cache.block_size
        self.args = replace(
            load_model_args(config.model.path, config.model.task),
            quantization=None if self.int4 else config.model.quantization,
            expert_parallel=config.parallel.enable_expert_parallel,
        )
        self.pooler = None if self.args.task == "generate" else Pooler(config.model.pooling_type)
        self.model: torch.nn.Module | None = None
        self.attn_layers: list[Attention] = []
        self.kv_cache_groups: list[KVCacheGroup] = []
        # Linear-attention layers (hybrid models), whose per-sequence state pools have one row per
        # sequence that can run at once (--max-num-seqs); the scheduler hands the rows out.
        self.linear_layers: list[GatedDeltaNet] = []
        # Mixture-of-experts layers of this stage, those of earlier stages (whose routing arrives
        # with their hidden states) and the experts per token.
        self.moe_layers: list[SparseMoE] = []
        self.moe_layers_before = 0
        self.moe_top_k = 0
        self.kv_cache: torch.Tensor | None = None
        self.num_kv_blocks = 0
        self.num_state_checkpoints = 0  # rows after the sequences' in the state pools
        # False after the weights were discarded (sleep level 2) until an update commits new ones.
        self.weights_valid = True
        self.requests: dict[str, _RequestState] = {}
        self.sampler = Sampler()
        self.lora_batch: LoraBatch | None = None  # with --enable-lora: the step's adapter slots
        # Speculative decoding's drafter on the workers, if any: a draft model, or a head fed
        # each step's features (the final hidden states for `mtp`, three layers' for `eagle3`).
        self.draft: DraftModel | HeadDrafter | None = None
        self.head_drafter: HeadDrafter | None = None
        self._processed_logprobs = config.model.logprobs_mode == "processed_logprobs"
        # Seconds spent in each phase of the last step (scripts/bench_step.py reads it).
        self.last_step_timings: dict[str, float] = {}

    # ------------------------------------------------------------------ set-up

    def load_model(self) -> None:
        speculative = self.config.speculative
        with _default_dtype(self.dtype), self.device:
            model = build_model(self.args, self.parallel)
            if speculative.method == "mtp":
                if self.config.lora.enabled:
                    raise ValueError("speculative method mtp is not served with --enable-lora")
                attach_mtp(model)
        if self.weight_dtype != self.dtype:
            store_weights_in_bfloat16(model)
        if self.int4:  # every linear layer keeps INT4_ZP blocks, quantized as the weights arrive
            keep_blocks_everywhere(model, "INT4_ZP", self.quantize_x)
        load_checkpoint(model, self.config.model.path, self.quantize_x)
        if self.config.lora.enabled:
            self.lora_batch = attach_lora_stacks(model, self.config.lora, self.device)
        self.model = model.eval()
        self.attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.kv_cache_groups = model.model.kv_cache_groups
        self.linear_layers = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
        self.moe_layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
        spec = model.model.spec
        if spec.moe is not None:
            first = model.model.stage_layers[0]
            self.moe_layers_before = sum(k.mlp == "moe" for k in spec.layers[:first])
            self.moe_top_k = spec.moe.top_k
        elif self.config.model.enable_return_routed_experts:
            raise ValueError(
                "--enable-return-routed-experts needs a mixture-of-experts model; "
                f"{self.args.architecture} has no expert layers"
            )
        if self.config.model.batch_invariant:
            self._make_batch_invariant()
        if speculative.method == "draft_model":
            assert speculative.model is not None
            self.draft = DraftModel(speculative.model, self.args, self.parallel, self.device,
                                    self.dtype, self.block_size)  # fmt: skip
        elif speculative.method == "mtp":
            self.draft = self.head_drafter = HeadDrafter(
                model.mtp, model.model.embed_tokens, model.compute_logits, self.block_size,
                self.device, self.dtype,
            )  # fmt: skip
        elif speculative.method == "eagle3":
            assert speculative.model is not None
            if self.parallel.pp_size > 1:
                raise ValueError("an EAGLE-3 head is not served with pipeline parallelism")
            head, model.model.feature_layers = load_eagle3_head(
                speculative.model, self.args, self.parallel, self.device, self.dtype
            )
            embed = model.model.embed_tokens if head.embed_tokens is None else head.embed_tokens
            self.draft = self.head_drafter = HeadDrafter(
                head, embed, head.compute_logits, self.block_size, self.device, self.dtype,
                head.midlayer.attn,
            )  # fmt: skip
        self.repack_weights()
        logger.info("loaded %s", self.model_summary)

    def _make_batch_invariant(self) -> None:
        """--batch-invariant: every linear (and the LM head) through the float32 kernel whose
        arithmetic is the same for every row whatever the batch, every token's attention through
        the paged decode kernel (one query at a time, its keys in order: the same sums whether its
        prompt was chunked or cached), module by module (the fused decode layer's few-row
        products sum differently). Norms, rotary and activations already work row by row; the
        all-reduces of tensor parallelism add the ranks in rank order."""
        assert self.model is not None
        arch = self.args.architecture
        if self.device.type != "cpu" or kernel_library.load() is None:
            raise ValueError("--batch-invariant runs on tern's CPU kernels, which are not loaded")
        if self.moe_layers or self.linear_layers:
            raise ValueError(
                f"--batch-invariant does not serve {arch}: its expert or linear-attention "
                "layers have no batch-invariant kernels"
            )
        for module in self.model.modules():
            if isinstance(module, (LinearBase, ParallelLMHead)):
                if module.quant is not None or module.weight.dtype != torch.float32:
                    raise ValueError(
                        "--batch-invariant serves float32 weights only; this model keeps "
                        f"{module.quant or module.weight.dtype} weights"
                    )
                module.batch_invariant = True
            if getattr(module, "fused_decode", None) is not None:
                module.fused_decode = None

    def repack_weights(self) -> None:
        """Re-derive the layers' packed copies of their weights (linear.pack_weight): after every
        change of the weights (update, rollback) and when they are discarded or come back."""
        assert self.model is not None
        draft = self.draft_weights()
        for model in (self.model,) if draft is None else (self.model, draft):
            for module in model.modules():
                if isinstance(module, (LinearBase, ParallelLMHead, RMSNorm)):
                    module.repack_weights()
        self.storage_moved()

    def storage_moved(self) -> None:
        """The weights' or KV cache's storage may have moved (a control call, the cache allocated
        or freed, the weights repacked): the fused layers check their tensors' addresses at their
        next call (fused_decode.py), not at every step."""
        assert self.model is not None
        fused_decode.storage_moved(self.model)
        if (draft := self.draft_weights()) is not None:
            fused_decode.storage_moved(draft)

    def draft_weights(self) -> torch.nn.Module | None:
        """The speculative draft whose weights live apart from the served model's, which weight
        updates replace under DRAFT_WEIGHT_PREFIX names: a draft model, an EAGLE-3 head (an MTP
        head is part of the served checkpoint: `mtp.*`)."""
        if isinstance(self.draft, DraftModel):
            return self.draft.model
        if self.head_drafter is not None and self.head_drafter.own_kv is not None:
            return self.head_drafter.head
        return None

    def named_weights(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """Every parameter a weight update may replace: the served model's, then the draft's
        (draft_weights) under DRAFT_WEIGHT_PREFIX."""
        assert self.model is not None
        yield from self.model.named_parameters()
        draft = self.draft_weights()
        if draft is not None:
            for name, param in draft.named_parameters():
                yield DRAFT_WEIGHT_PREFIX + name, param

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """(checkpoint name, tensor) pairs into the served model, those named DRAFT_WEIGHT_PREFIX
        + name into the draft (draft_weights); returns the served model's names loaded."""
        assert self.model is not None
        drafted: list[tuple[str, Any]] = []

        def served() -> Iterator[tuple[str, Any]]:  # streamed: a checkpoint is read as it loads
            for name, tensor in weights:
                if name.startswith(DRAFT_WEIGHT_PREFIX):
                    drafted.append((name.removeprefix(DRAFT_WEIGHT_PREFIX), tensor))
                else:
                    yield name, tensor

        loaded = load_weights(self.model, served())
        if drafted:
            draft = self.draft_weights()
            if draft is None:
                raise ValueError(
                    f"weight {DRAFT_WEIGHT_PREFIX}{drafted[0][0]!r} names a draft; this server "
                    "has no draft model or EAGLE-3 head"
                )
            load_weights(draft, drafted)
        return loaded

    def _kv_heads_per_rank(self) -> int:
        p = self.parallel
        return shard_heads(
            self.args.num_attention_heads, self.args.num_key_value_heads, p.tp_size, p.tp_rank
        ).num_kv_heads

    def _kv_cache_slots(self) -> int:
        """Layers one block holds on this stage: the most any KV-cache group has here."""
        if self.model is None:
            p = self.parallel
            return len(stage_layers(self.args.num_hidden_layers, p.pp_size, p.pp_rank))
        return max((layer.kv_slot + 1 for layer in self.attn_layers), default=1)

    def _kv_row(self) -> tuple[int, torch.dtype]:
        """(elements, dtype) of one head's K or V row of one token in the cache."""
        if self.config.cache.kv_cache_dtype == "int8":
            return kv_int8.row_bytes(self.args.head_dim), torch.uint8
        return self.args.head_dim, self.dtype

    def kv_cache_bytes_per_block(self) -> int:
        """K and V of one block over this stage's cache slots and this rank's KV heads."""
        row, dtype = self._kv_row()
        elem = torch.empty((), dtype=dtype).element_size()
        per_layer = 2 * self.block_size * self._kv_heads_per_rank() * row * elem
        draft = self.draft.bytes_per_block() if self.draft is not None else 0
        return per_layer * self._kv_cache_slots() + draft

    def routing_shape(self) -> RoutingShape | None:
        """What one token's routing row holds (mixture-of-experts models), over the whole model."""
        assert self.model is not None
        spec = self.model.model.spec
        if spec.moe is None:
            return None
        num_layers = sum(k.mlp == "moe" for k in spec.layers)
        return RoutingShape(num_layers, spec.moe.top_k, spec.moe.num_experts)

    def state_bytes_per_seq(self) -> int:
        """One sequence's linear-attention states over this stage's layers (0 without any)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        total = 0
        for layer in self.linear_layers:
            conv, recurrent = layer.state_shapes()
            total += math.prod(conv) * elem + math.prod(recurrent) * 4
        return total

    def plan_state_checkpoints(self) -> tuple[int, int]:
        """How many linear-attention state checkpoints (enginecore/state_checkpoints.py) this rank
        keeps for the prefix cache of a hybrid model, and every how many tokens they are taken.

        They get CHECKPOINT_SHARE of the memory the KV blocks would have, and are taken where
        one checkpoint costs about what the KV cache of the tokens since the last one does, at a
        multiple of the delta rule's chunk too: a prompt split there computes no padding."""
        per_seq = self.state_bytes_per_seq()
        if not per_seq or not self.config.cache.enable_prefix_caching:
            return 0, 0
        unit = math.lcm(self.block_size, CHUNK)
        unit_bytes = self.kv_cache_bytes_per_block() * (unit // self.block_size)
        interval = self.config.cache.state_checkpoint_interval or unit * -(-per_seq // unit_bytes)
        budget = self._kv_memory_bytes() - per_seq * self.config.scheduler.max_num_seqs
        return max(int(budget * CHECKPOINT_SHARE), 0) // per_seq, interval

    def _kv_memory_bytes(self) -> int:
        return int(self.config.cache.kv_cache_memory_gib * (1 << 30))

    def num_kv_blocks_for_memory(self) -> int:
        if self.config.cache.num_gpu_blocks_override is not None:
            return self.config.cache.num_gpu_blocks_override
        num_states = self.config.scheduler.max_num_seqs + self.plan_state_checkpoints()[0]
        budget = self._kv_memory_bytes() - self.state_bytes_per_seq() * num_states
        return max(budget, 0) // self.kv_cache_bytes_per_block()

    def init_kv_cache(self, num_blocks: int, num_state_checkpoints: int = 0) -> None:
        """Allocate (slots, 2, num_blocks, block_size, Hkv, D) and hand each layer its slot; and
        the linear-attention state pools: a row per running sequence, then the checkpoints'."""
        if self.model is None:
            raise RuntimeError("load_model must run before init_kv_cache")
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, not {num_blocks}")
        row, dtype = self._kv_row()
        shape = (self._kv_cache_slots(), 2, num_blocks, self.block_size, self._kv_heads_per_rank(),
                 row)  # fmt: skip
        # NOTE: zeros, not empty: masked-out keys are still multiplied, and NaN * 0 is NaN.
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        for layer in self.attn_layers:
            layer.kv_cache = self.kv_cache[layer.kv_slot]
        if self.draft is not None:
            self.draft.init_kv_cache(num_blocks)
        rows = self.config.scheduler.max_num_seqs + num_state_checkpoints
        for layer in self.linear_layers:
            conv, recurrent = layer.state_shapes()
            layer.conv_states = torch.zeros((rows, *conv), dtype=self.dtype, device=self.device)
            layer.recurrent_states = torch.zeros(
                (rows, *recurrent), dtype=torch.float32, device=self.device
            )
        self.num_kv_blocks = num_blocks
        self.num_state_checkpoints = num_state_checkpoints
        self.requests.clear()
        self.storage_moved()

    def kernel_report(self) -> str:
        """Which CPU kernels this worker runs and whether its decoder layers run fused, for the
        start-up log (once the KV cache is allocated: the fused path depends on it)."""
        assert self.model is not None
        if self.device.type != "cpu":
            return "kernels: not used on " + self.device.type
        fused = fused_decode.fused_layers(self.model)
        reasons = {r for r in (f.off_reason() for f in fused)}
        moe = any(isinstance(m, SparseMoE) for m in self.model.modules())
        if not fused:
            state = "off, reason: this model has no softmax-attention decoder layers"
        elif reasons == {None}:
            state = "on" + (" (then each layer's experts, grouped by expert)" if moe else "")
        else:
            state = "off, reason: " + "; ".join(sorted(r for r in reasons if r is not None))
        return f"{kernel_library.describe()}, fused decode layer: {state}"

    def release_kv_cache(self) -> None:
        """Frees the KV cache (sleep); init_kv_cache(self.num_kv_blocks,
        self.num_state_checkpoints) brings it back."""
        for layer in self.attn_layers:
            layer.kv_cache = torch.empty(0)
        for layer in self.linear_layers:
            layer.conv_states = layer.recurrent_states = torch.empty(0)
        if self.draft is not None:
            self.draft.release_kv_cache()
        self.kv_cache = None
        self.requests.clear()
        self.storage_moved()

    # ------------------------------------------------------------------ properties

    @property
    def max_model_len(self) -> int:
        limit = self.config.model.max_model_len or _DEFAULT_MAX_MODEL_LEN
        return min(self.args.max_position_embeddings, limit)

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def model_summary(self) -> str:
        a = self.args
        params = ""
        tp, pp = self.parallel.tp_size, self.parallel.pp_size
        if self.model is not None:
            num = sum(param.numel() for param in self.model.parameters())
            scope = "" if tp * pp == 1 else " on this rank"
            params = f", {num / 1e6:.1f}M params{scope}"
        if tp * pp > 1:
            params += f", tp {tp} x pp {pp}"
        if self.pooler is not None:
            params += f", task {a.task} ({self.pooler.pooling_type} pooling)"
        if a.multimodal:
            params += ", its language model only (image inputs are not served)"
        dtype = str(self.dtype).removeprefix("torch.")
        if self.weight_dtype != self.dtype:
            dtype += " (bfloat16-stored weights: no bfloat16 arithmetic on this CPU)"
        return (
            f"{a.architecture}: {a.num_hidden_layers} layers, hidden {a.hidden_size}, "
            f"{a.num_attention_heads} heads / {a.num_key_value_heads} KV heads{params}, {dtype}"
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

    def _update_states(self, step: SchedulerOutput) -> None:
        for req_id in step.finished_req_ids:
            self.requests.pop(req_id, None)
            if self.draft is not None:
                self.draft.forget(req_id)
        for r in step.requests:
            if r.sampling_params is not None:  # first schedule, or resumed after preemption
                self.requests.pop(r.req_id, None)
                self.requests[r.req_id] = _RequestState(
                    [list(r.new_block_ids), *map(list, r.other_group_block_ids)],
                    r.sampling_params,
                    _new_history(r),
                    PoolingState() if self.pooler is not None else None,
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
            for layer, states in zip(self.linear_layers, layer_states):
                layer.take_back(state.state_slot, states, kept)

    def _token_lora_slots(self, reqs: list[ScheduledRequest]) -> torch.Tensor | None:
        """Each token's adapter slot this step, or None when no request runs on one."""
        slots = [self.requests[r.req_id].lora_slot for r in reqs]
        if all(s < 0 for s in slots):
            return None
        counts = torch.tensor([len(r.token_ids) for r in reqs])
        return torch.tensor(slots, dtype=torch.int32).repeat_interleave(counts).to(self.device)

    def _lora_slot(self, r: ScheduledRequest) -> int:
        slots = self.config.lora.num_slots if self.lora_batch is not None else 0
        if r.lora_slot != -1 and not 0 <= r.lora_slot < slots:
            raise ValueError(f"request {r.req_id!r} scheduled with LoRA slot {r.lora_slot}")
        return r.lora_slot

    def _state_slot(self, r: ScheduledRequest) -> int:
        if not self.linear_layers:
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

    def _restore_checkpoint(self, r: ScheduledRequest) -> None:
        """A prefix-cache hit on a hybrid model: the request starts from the states after it."""
        row = self._checkpoint_row(r, r.restore_checkpoint)
        for layer in self.linear_layers:
            layer.copy_states([row], [r.state_slot])

    def _add_model_drafts(self, reqs: list[ScheduledRequest]) -> list[ScheduledRequest]:
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

    def _validate(self, reqs: list[ScheduledRequest]) -> None:
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
        self._update_states(step)
        reqs = step.requests
        if not reqs:
            return ModelRunnerOutput(step.step_id, [], []), None
        self._validate(reqs)
        if self.draft is not None:
            reqs = self._add_model_drafts(reqs)

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
        )
        if self.lora_batch is not None:
            self.lora_batch.slots = self._token_lora_slots(reqs)
        if self.linear_layers:
            meta.state_slots = torch.tensor(
                [self.requests[r.req_id].state_slot for r in reqs], device=self.device
            )
            meta.state_saves = [
                (i, offset, self._checkpoint_row(r, checkpoint))
                for i, r in enumerate(reqs)
                for offset, checkpoint in r.save_checkpoints
            ]
            meta.draft_seqs = [i for i, r in enumerate(reqs) if r.num_draft_tokens]
        p = self.parallel
        t1 = time.perf_counter()
        timings["prepare"] = t1 - t0
        intermediate, earlier_routes = None, None
        num_tokens = input_ids.numel()
        if not p.is_first_stage:
            shape = (2, num_tokens, self.args.hidden_size)
            intermediate = p.recv_from_prev_stage(shape, self.dtype, self.device)
            if self.moe_layers_before:
                shape = (num_tokens, self.moe_layers_before, self.moe_top_k)
                earlier_routes = p.recv_from_prev_stage(shape, torch.int16, self.device)
        # Every step's routing is counted (tern:moe_expert_tokens); requests get it on demand.
        recording = bool(self.moe_top_k)
        for layer in self.moe_layers:
            layer.captured = [] if recording else None
        # (T, hidden) on the last stage; (2, T, hidden), hidden states and residual, on the others
        hidden = self.model(input_ids, meta, intermediate)
        for i in meta.draft_seqs:
            r, state = reqs[i], self.requests[reqs[i].req_id]
            states = [layer.drafted_states.pop(state.state_slot) for layer in self.linear_layers]
            state.drafted = (r.start_pos, len(r.token_ids), states)
        if self.head_drafter is not None:
            features = hidden if self.model.mtp is not None else self.model.model.features
            self.head_drafter.record(reqs, features, meta.query_start_loc.tolist())
        t2 = time.perf_counter()
        timings["forward"] = t2 - t1
        routes = self._routes(earlier_routes, num_tokens) if recording else None
        if not p.is_last_stage:
            p.send_to_next_stage(hidden)
            if routes is not None and routes.size(1):
                p.send_to_next_stage(routes)
            return ModelRunnerOutput(step.step_id, [], []), None
        routed, expert_tokens = {}, []
        if routes is not None and p.is_driver:
            if self.config.model.enable_return_routed_experts:
                starts = meta.query_start_loc.tolist()
                routed = {
                    r.req_id: routes[starts[i] : starts[i + 1]].cpu().numpy().tobytes()
                    for i, r in enumerate(reqs)
                }
            expert_tokens = self._expert_tokens(routes)
        if self.pooler is not None:
            output = self._pool(step, hidden, meta.query_start_loc.tolist())
            timings["pool"] = time.perf_counter() - t2
            return output, None

        sampling = [i for i, r in enumerate(reqs) if r.sample_index >= 0]
        states = [self.requests[r.req_id] for r in reqs]
        # NOTE: every rank of the last stage runs these LM-head rows too (a collective under TP).
        prompt_lps = prompt_logprobs(
            self.model.compute_logits,
            hidden,
            prompt_logprobs_jobs(
                reqs, [s.sampling_params for s in states], [s.history for s in states]
            ),
        )
        if not p.is_driver:
            prompt_lps = {}
        if not sampling:
            return ModelRunnerOutput(
                step.step_id, [], [], prompt_logprobs=prompt_lps, routed_experts=routed,
                expert_tokens=expert_tokens,
            ), None  # fmt: skip
        # Each sampling request's rows: its last position, or with drafts its last k + 1.
        rows = SampleRows.of(
            [reqs[i] for i in sampling], meta.query_start_loc[1:][sampling].tolist()
        )
        logits = self.model.compute_logits(hidden[rows.positions(self.device)]).float()  # (R, V)
        t3 = time.perf_counter()
        timings["lm_head"] = t3 - t2
        if not p.is_driver:  # the logits were a collective; the driver samples
            return ModelRunnerOutput(step.step_id, [], []), None
        params = [states[i].sampling_params for i in sampling]
        masks: dict[str, bytes] = {}
        if step.grammar_bitmasks_follow:
            if bitmasks is None:
                raise ValueError(f"step {step.step_id} needs grammar bitmasks; none were given")
            masks = bitmasks()
        row_params = rows.per_row(params)
        tensors = SamplingTensors.from_params(
            row_params,
            rows.sample_indices([reqs[i].sample_index for i in sampling]),
            logits.size(-1),
            self.device,
            rows.histories([states[i].history for i in sampling]),
            rows.bitmasks([masks.get(reqs[i].req_id) for i in sampling]),
        )
        num_tops = [q.logprobs for q in row_params]
        # processed_logprobs: the sampler also returns the distributions it drew the rows from.
        processed_rows = logprob_rows(num_tops) if self._processed_logprobs else None
        sampled, processed = self.sampler.sample(logits, tensors, processed_rows)
        sampled_rows = sampled.tolist()
        req_ids = [reqs[i].req_id for i in sampling]
        emitted = rows.accepted(sampled_rows)  # per request: the rows it keeps
        row_logprobs = sampled_logprobs_rows(logits, sampled, num_tops, processed)
        output = ModelRunnerOutput(
            step.step_id,
            req_ids,
            [sampled_rows[lo:hi] for lo, hi in emitted],
            {
                req_id: Logprobs.concat(row_logprobs[lo:hi])
                for req_id, (lo, hi) in zip(req_ids, emitted)
                if row_logprobs[lo] is not None
            },
            prompt_lps,
            routed_experts=routed,
            expert_tokens=expert_tokens,
        )
        logprobs = logits.log_softmax(dim=-1).cpu() if want_logprobs else None
        timings["sample"] = time.perf_counter() - t3
        return output, logprobs

    def _expert_tokens(self, routes: torch.Tensor) -> list[int]:
        """Tokens each expert of each MoE layer took this step, layer-major (layers x experts)."""
        experts = self.model.model.spec.moe.num_experts
        offsets = torch.arange(routes.size(1), device=routes.device).unsqueeze(-1) * experts
        flat = (routes.long() + offsets).flatten()
        return torch.bincount(flat, minlength=routes.size(1) * experts).tolist()

    def _routes(self, earlier: torch.Tensor | None, num_tokens: int) -> torch.Tensor:
        """(T, MoE layers so far, top_k) int16: the step's routing in layer order, the earlier
        stages' first."""
        parts = [] if earlier is None else [earlier]
        for layer in self.moe_layers:
            assert layer.captured is not None
            parts += [e.to(torch.int16).unsqueeze(1) for e in layer.captured]
            layer.captured = None
        if not parts:
            return torch.empty(num_tokens, 0, self.moe_top_k, dtype=torch.int16)
        return torch.cat(parts, dim=1)

    def _pool(
        self, step: SchedulerOutput, hidden: torch.Tensor, starts: list[int]
    ) -> ModelRunnerOutput:
        """Adds each request's chunk (rows starts[i]:starts[i + 1] of `hidden`) to its pooling;
        the requests whose prompt ends this step get the head's output on their pooled state."""
        assert self.pooler is not None
        ending: list[tuple[str, PoolingState]] = []
        for i, r in enumerate(step.requests):
            state = self.requests[r.req_id].pooling
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

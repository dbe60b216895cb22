"""Loading the served model: its dtypes, its build and checkpoint, its speculative drafter, and its
weights afterwards (updates, repacking, the draft's own weights).

The model runner holds one `ServedWeights` for the control path (workers/worker_control.py:
update, rollback, sleep and wake-up); the step never reads it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from enginecore.config import Config, ParallelConfig
from workers.distributed import ParallelContext, shard_heads, stage_layers
from workers.kernels import fused_decode, kernel_library
from workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from workers.layers.gated_delta_net import GatedDeltaNet
from workers.layers.linear import LinearBase
from workers.layers.lora import LoraBatch
from workers.layers.moe import SparseMoE
from workers.layers.norm import RMSNorm
from workers.layers.pooler import Pooler
from workers.lora_adapters import attach_lora_stacks
from workers.models.args import ModelArgs
from workers.models.decoder import mlp_shard_of
from workers.models.eagle3 import load_eagle3_head
from workers.models.mtp import attach_mtp
from workers.models.registry import build_model
from workers.quant.gguf_weights import gguf_file_of
from workers.quant.quantized_checkpoints import checkpoint_quantization
from workers.spec.draft_model import DraftModel
from workers.spec.drafter import Drafter
from workers.spec.head_drafter import HeadDrafter
from workers.weight_loader import keep_blocks_everywhere, load_checkpoint, load_weights

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Weight updates name a draft model's (or an EAGLE-3 head's) tensors with this prefix.
DRAFT_WEIGHT_PREFIX = "draft."


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


def served_dtypes(config: Config, device: torch.device) -> tuple[torch.dtype, torch.dtype, bool]:
    """(the activations' dtype, the weights' dtype, whether activations are quantized per block).

    Block-quantized weights (a GGUF file, a GPTQ / AWQ checkpoint, --quantization int4): --dtype
    float32 multiplies the blocks exactly; any other --dtype takes the fast path (activations
    quantized per block), and "auto" keeps float32 activations, which the block kernels and the
    fused decode layer take."""
    checkpoint_quant = checkpoint_quantization(config.model.path)
    keeps_blocks = (
        gguf_file_of(config.model.path) is not None
        or (checkpoint_quant is not None and checkpoint_quant.keeps_int4)
        or config.model.quantization == "int4"
    )
    auto = config.model.dtype == "auto"
    float32 = (keeps_blocks or config.model.batch_invariant) and auto
    dtype, weight_dtype = resolve_dtypes("float32" if float32 else config.model.dtype, device)
    return dtype, weight_dtype, keeps_blocks and config.model.dtype != "float32"


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


def build_served_model(
    config: Config,
    args: ModelArgs,
    parallel: ParallelContext,
    device: torch.device,
    dtypes: tuple[torch.dtype, torch.dtype],
    quantize_x: bool,
) -> tuple[torch.nn.Module, LoraBatch | None]:
    """The model with its checkpoint loaded (and its MTP head, LoRA stacks, int4 blocks and
    bfloat16-stored weights where asked), in eval mode; with --enable-lora, its adapters' batch."""
    dtype, weight_dtype = dtypes
    with _default_dtype(dtype), device:
        model = build_model(args, parallel)
        if config.speculative.method == "mtp":
            if config.lora.enabled:
                raise ValueError("speculative method mtp is not served with --enable-lora")
            attach_mtp(model)
    if weight_dtype != dtype:
        store_weights_in_bfloat16(model)
    if config.model.quantization == "int4":  # every linear keeps INT4_ZP blocks as they arrive
        keep_blocks_everywhere(model, "INT4_ZP", quantize_x)
    load_checkpoint(model, config.model.path, quantize_x)
    lora_batch = None
    if config.lora.enabled:
        lora_batch = attach_lora_stacks(model, config.lora, device)
    return model.eval(), lora_batch


def build_drafter(
    config: Config,
    model: torch.nn.Module,
    args: ModelArgs,
    parallel: ParallelContext,
    device: torch.device,
    dtype: torch.dtype,
) -> Drafter | None:
    """Speculative decoding's drafter on the workers, if any: a draft model, or a head fed each
    step's features (the final hidden states for `mtp`, three layers' for `eagle3`)."""
    speculative, block_size = config.speculative, config.cache.block_size
    if speculative.method == "draft_model":
        assert speculative.model is not None
        return DraftModel(speculative.model, args, parallel, device, dtype, block_size)
    if speculative.method == "mtp":
        return HeadDrafter(
            model.mtp, model.model.embed_tokens, model.compute_logits, block_size, device, dtype
        )
    if speculative.method == "eagle3":
        assert speculative.model is not None
        if parallel.pp_size > 1:
            raise ValueError("an EAGLE-3 head is not served with pipeline parallelism")
        head, model.model.feature_layers = load_eagle3_head(
            speculative.model, args, parallel, device, dtype
        )
        embed = model.model.embed_tokens if head.embed_tokens is None else head.embed_tokens
        return HeadDrafter(
            head, embed, head.compute_logits, block_size, device, dtype, head.midlayer.attn
        )
    return None


def make_batch_invariant(model: torch.nn.Module, device: torch.device, arch: str) -> None:
    """--batch-invariant: every linear (and the LM head) through the float32 kernel whose
    arithmetic is the same for every row whatever the batch, every token's attention through
    the paged decode kernel (one query at a time, its keys in order: the same sums whether its
    prompt was chunked or cached), module by module (the fused decode layer's few-row
    products sum differently). Norms, rotary and activations already work row by row; the
    all-reduces of tensor parallelism add the ranks in rank order."""
    if device.type != "cpu" or kernel_library.load() is None:
        raise ValueError("--batch-invariant runs on tern's CPU kernels, which are not loaded")
    if any(isinstance(m, (SparseMoE, GatedDeltaNet)) for m in model.modules()):
        raise ValueError(
            f"--batch-invariant does not serve {arch}: its expert or linear-attention "
            "layers have no batch-invariant kernels"
        )
    for module in model.modules():
        if isinstance(module, (LinearBase, ParallelLMHead)):
            if module.quant is not None or module.weight.dtype != torch.float32:
                raise ValueError(
                    "--batch-invariant serves float32 weights only; this model keeps "
                    f"{module.quant or module.weight.dtype} weights"
                )
            module.batch_invariant = True
        if getattr(module, "fused_decode", None) is not None:
            module.fused_decode = None


def describe_model(
    args: ModelArgs,
    model: torch.nn.Module | None,
    parallel: ParallelContext,
    pooler: Pooler | None,
    dtype: torch.dtype,
    weight_dtype: torch.dtype,
) -> str:
    """The served model in one line, for the start-up log and the ready message."""
    a, params = args, ""
    tp, pp = parallel.tp_size, parallel.pp_size
    if model is not None:
        num = sum(param.numel() for param in model.parameters())
        scope = "" if tp * pp == 1 else " on this rank"
        params = f", {num / 1e6:.1f}M params{scope}"
    if tp * pp > 1:
        params += f", tp {tp} x pp {pp}"
    if pooler is not None:
        params += f", task {a.task} ({pooler.pooling_type} pooling)"
    if a.takes_images:
        params += ", with its image encoder"
    elif a.multimodal:
        params += ", its language model only (image and audio inputs are not served)"
    dtype_name = str(dtype).removeprefix("torch.")
    if weight_dtype != dtype:
        dtype_name += " (bfloat16-stored weights: no bfloat16 arithmetic on this CPU)"
    return (
        f"{a.architecture}: {a.num_hidden_layers} layers, hidden {a.hidden_size}, "
        f"{a.num_attention_heads} heads / {a.num_key_value_heads} KV heads{params}, {dtype_name}"
    )


class ServedWeights:
    """The served model's weights and, apart from them, the draft's (a draft model's, an EAGLE-3
    head's; an MTP head is part of the served checkpoint: `mtp.*`), as weight updates see them."""

    def __init__(self, model: torch.nn.Module, draft: Drafter | None) -> None:
        self.model = model
        self.draft = draft.own_weights() if draft is not None else None
        # Called after every change of the weights (what was derived from the old ones is stale).
        self.on_change: list[Callable[[], None]] = []

    def repack(self) -> None:
        """Re-derive the layers' packed copies of their weights (linear.pack_weight): after every
        change of the weights (update, rollback) and when they are discarded or come back."""
        for callback in self.on_change:
            callback()
        for model in self._models():
            for module in model.modules():
                if isinstance(module, (LinearBase, ParallelLMHead, RMSNorm)):
                    module.repack_weights()
        self.storage_moved()

    def storage_moved(self) -> None:
        """The weights' or KV cache's storage may have moved (a control call, the cache allocated
        or freed, the weights repacked): the fused layers check their tensors' addresses at their
        next call (fused_decode.py), not at every step."""
        for model in self._models():
            fused_decode.storage_moved(model)

    def named(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """Every parameter a weight update may replace: the served model's, then the draft's
        under DRAFT_WEIGHT_PREFIX."""
        yield from self.model.named_parameters()
        if self.draft is not None:
            for name, param in self.draft.named_parameters():
                yield DRAFT_WEIGHT_PREFIX + name, param

    def load(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """(checkpoint name, tensor) pairs into the served model, those named DRAFT_WEIGHT_PREFIX
        + name into the draft; returns the served model's names loaded."""
        drafted: list[tuple[str, Any]] = []

        def served() -> Iterator[tuple[str, Any]]:  # streamed: a checkpoint is read as it loads
            for name, tensor in weights:
                if name.startswith(DRAFT_WEIGHT_PREFIX):
                    drafted.append((name.removeprefix(DRAFT_WEIGHT_PREFIX), tensor))
                else:
                    yield name, tensor

        loaded = load_weights(self.model, served())
        if drafted:
            if self.draft is None:
                raise ValueError(
                    f"weight {DRAFT_WEIGHT_PREFIX}{drafted[0][0]!r} names a draft; this server "
                    "has no draft model or EAGLE-3 head"
                )
            load_weights(self.draft, drafted)
        return loaded

    def _models(self) -> tuple[torch.nn.Module, ...]:
        return (self.model,) if self.draft is None else (self.model, self.draft)

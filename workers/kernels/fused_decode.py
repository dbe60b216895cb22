"""A whole decoder layer in one native call (csrc/decode_layer.c) for decode steps of a few
sequences: the per-layer Python of such steps (~110 us of ~380 us per layer at one sequence on
this 2-core machine) is most of what is left besides reading the weights.

A model hands its layer over as a `DecodeLayerSpec`: the public parts the native layer reads
(the four linears, the two norms, the attention with its KV cache, the rotary tables), so this
module knows no model class. A layer takes the fused path only where the unfused one would run
exactly these kernels, so its output is bit for bit the same: the kernels on, activations and KV
cache on the CPU in bfloat16 (kernels with AVX512-BF16; bfloat16 or int8 weights) or float32 (any
tier; float32, bfloat16-stored or int8 weights), a layer unsharded or tensor-parallel within one
host (the two all-reduces then run in the native call, on the shared-memory segment of
shm_collectives.py), with a SiLU or GELU-tanh gate (output gates, residual multipliers, norms where the
family puts them, q/k norms, rotation whole, partial or none, softcapping: DecodeLayerSpec), norms
that multiply in float32 (Gemma, OLMo 2) under float32 activations only, and a step whose tokens are all
single-token decodes, at most `max_rows(dtype)` of them (the rows tern's few-row kernels take:
bfloat16 2, or 32 with AMX; float32 63). Linears serving LoRA adapters (LinearBase.lora) add them
in the native call with the kernel the module path calls (csrc/lora.c), each token on the step's
slot for it (LoraBatch.slots). Everything else returns None and runs module by module;
`off_reason` says why a layer does not qualify (the start-up log shows it).

Where a pipeline stage's layers are all fused with their MLPs and read one KV-cache group (dense
models without sliding windows), `FusedDecodeStack` runs them all in one native call
(tern_decode_layers_*: the same per-layer body in a loop), which saves the Python between layers.

The layer's fixed part (weights, norms, rotary tables, its KV cache) is one ctypes struct
(kernel_library.TernDecodeLayer, checked against tern_kernels.h at load), rebuilt whenever one of
those tensors moves (weight updates, sleep and wake-up replace storage). Storage moves only where
the model runner says it may have (`ModelRunner.storage_moved`: after every control call, when the
KV cache is allocated or freed, when the weights are repacked), so a layer checks its tensors'
addresses at its first call after that, not at every step: at one sequence the check of 30
layers cost ~0.6 ms a step, its Python objects cold once the weights have streamed through the
caches. The step's part (positions, block tables, slots, LoRA slots, scratch rows) is built once
per step and shared by the layers through the step's AttentionMetadata.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from workers.kernels import kernel_library, linear_ops
from workers.kernels.kernel_library import TernDecodeLayer, TernDecodeStep, TernLinear
from workers.layers.attention import Attention, AttentionMetadata
from workers.layers.linear import NATIVE_F32_MAX_ROWS, LinearBase
from workers.layers.lora import LoraBatch
from workers.layers.moe import SparseMoE
from workers.layers.norm import RMSNorm, ShardedRMSNorm
from workers.layers.rotary import RotaryEmbedding
from workers.quant import gguf_blocks

# TernLinear.weight_format (csrc/tern_kernels.h): bfloat16-stored, GGUF blocks multiplied exactly
# or with quantized activations (+ the block type).
WEIGHT_BF16, WEIGHT_GGUF, WEIGHT_GGUF_Q8ACT = 1, 256, 512


@dataclass(frozen=True)
class DecodeLayerSpec:
    """A decoder layer as the native layer reads it: x (+ residual) -> [input_norm] -> qkv ->
    [q and k norms, per head or over the projection] -> [rotary, whole or partial, halves or
    pairs] -> attention [softcapped] -> o -> [attn_out_norm] (+ residual) -> [post_norm] ->
    gate_up -> SiLU or GELU gate -> down -> [mlp_out_norm]; bracketed parts may be absent, and
    each branch may be multiplied by residual_scale before its residual add. Without gate_up and
    down (a mixture-of-experts layer) the native layer stops before the MLP and returns its input
    in place of its output: the caller runs the experts."""

    qkv: LinearBase
    o: LinearBase  # row-parallel: bias on TP rank 0 only, all-reduced
    gate_up: LinearBase | None
    down: LinearBase | None  # row-parallel
    input_norm: RMSNorm | None
    post_norm: RMSNorm | None  # before the MLP
    attn_out_norm: RMSNorm | None
    mlp_out_norm: RMSNorm | None
    q_norm: RMSNorm | ShardedRMSNorm | None  # RMSNorm: per head (Qwen3); sharded: over q (OLMo 2)
    k_norm: RMSNorm | ShardedRMSNorm | None
    attention: Attention
    rotary: RotaryEmbedding | None  # None: no rotation (NoPE layers)
    gelu: bool  # the MLP's gate is GELU (tanh approximation), not SiLU
    residual_scale: float  # multiplies each branch before its residual add (Granite), else 1
    output_gate: bool  # q_proj gives each head a gate: its output times sigmoid(gate) (Qwen3.5)


def max_rows(dtype: torch.dtype) -> int:
    """Rows of the largest decode step the fused layer takes in activations of `dtype`."""
    if dtype == torch.float32:
        return NATIVE_F32_MAX_ROWS
    return max(linear_ops.bf16_gemv_max_rows(), linear_ops.bf16_amx_max_rows())


def _scratch_widths(fixed: TernDecodeLayer) -> tuple[int, ...]:
    """Row widths of the step's scratch buffers, in TernDecodeStep's order (normed .. act)."""
    attn = fixed.num_heads * fixed.head_dim
    return (fixed.hidden, fixed.qkv.n, attn, attn, fixed.hidden, fixed.gate_up.n,
            fixed.intermediate)  # fmt: skip


class StepBuffers:
    """One step's inputs to the fused layers, and scratch rows of `widths`. Lives on the step's
    AttentionMetadata, which also holds the input tensors the struct points at."""

    def __init__(
        self, meta: AttentionMetadata, widths: tuple[int, ...], dtype: torch.dtype
    ) -> None:
        d = meta.decode
        t = d.q_tokens.numel()
        self.key = (widths, dtype)
        # NOTE: the tensors are kept on self: the struct holds their addresses only.
        self._scratch = [torch.empty(t, w, dtype=dtype) for w in widths]
        self.struct = TernDecodeStep(
            t, meta.positions.data_ptr(), meta.slot_mapping.data_ptr(),
            d.block_tables.data_ptr(), d.context_lens.data_ptr(), d.block_tables.stride(0),
            *(b.data_ptr() for b in self._scratch),
        )  # fmt: skip
        self.lora_slots: torch.Tensor | None = None  # what struct.lora_slots points at

    def use_lora_slots(self, slots: torch.Tensor | None) -> bool:
        """Point the struct at each token's LoRA slot (None: no adapters this step); False where
        the kernel cannot take them (the module path then says why)."""
        if slots is not None and (
            slots.dtype != torch.int32
            or not slots.is_cpu
            or not slots.is_contiguous()
            or slots.numel() != self.struct.num_tokens
        ):
            return False
        self.lora_slots = slots  # NOTE: kept alive here: the struct holds its address only
        self.struct.lora_slots = None if slots is None else slots.data_ptr()
        return True


class FusedDecodeLayer:
    """The fused path of one decoder layer (held by it; see the module docstring)."""

    def __init__(self, spec: DecodeLayerSpec) -> None:
        self.spec = spec
        self._linears = _linears(spec)
        self._norms = _norms(spec)
        self._key: list | None = None
        self._fixed: TernDecodeLayer | None = None
        self._off_reason = "not built yet"
        self._lora_batch: LoraBatch | None = None  # the adapters' step slots, if it serves any
        self._widths: tuple[int, ...] = ()  # _scratch_widths(self._fixed)
        self._dtype = torch.float32  # the activations' (and KV cache's), once built
        self._checked = False  # _key checked since storage last moved

    def storage_moved(self) -> None:
        """The layer's tensors may have moved: check their addresses at its next call."""
        self._checked = False

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(MLP output, residual) as the layer's forward returns them (without an MLP: its input),
        or None: not fused."""
        step = self.prepare(x, meta, residual)
        if step is None:
            return None
        fixed = self._fixed
        # NOTE: exactly the all-reduces the layer runs: the shared segment's two buffers alternate
        # by sequence number, so a number left unused would let a rank overwrite one being read.
        num_reduces = 2 if self.spec.gate_up is not None else 1
        entry = _entry("tern_decode_layer", x.dtype)
        return _run_native(
            x, self.spec, fixed.tp_size, num_reduces,
            lambda out, res_out, seq: entry(
                ctypes.byref(fixed), ctypes.byref(step.struct), x.data_ptr(), _ptr(residual),
                out, res_out, seq,
            ),
        )  # fmt: skip

    def prepare(
        self, x: torch.Tensor, meta: AttentionMetadata, residual: torch.Tensor | None
    ) -> StepBuffers | None:
        """The step's native buffers (LoRA slots set) if this layer takes x fused, else None."""
        d = meta.decode
        if (
            d is None
            or not d.is_whole_batch
            or x.dim() != 2
            or x.size(0) > max_rows(x.dtype)
            or not x.is_contiguous()
            or (residual is not None and not residual.is_contiguous())
        ):
            return None
        fixed = self._fixed_struct()
        if fixed is None or x.dtype != self._dtype:
            return None
        step = meta.native_step
        if step is None or step.key != (self._widths, x.dtype):
            step = meta.native_step = StepBuffers(meta, self._widths, x.dtype)
        batch = self._lora_batch
        if batch is not None and batch.slots is not step.lora_slots:
            if not step.use_lora_slots(batch.slots):
                return None
        return step

    def off_reason(self) -> str | None:
        """Why this layer runs module by module (None: it is fused)."""
        return None if self._fixed_struct() is not None else self._off_reason

    def _fixed_struct(self) -> TernDecodeLayer | None:
        if self._checked:
            return self._fixed
        spec = self.spec
        linears = self._linears
        # NOTE: modules' parameters are read from their _parameters dicts (nn.Module.__getattr__
        # costs ~0.5 us each), and the key is flat.
        key = [spec.attention.kv_cache.data_ptr()]
        key += [lin._parameters["weight"].data_ptr() for lin in linears]
        key += [_norm_weight(n).data_ptr() for n in self._norms]
        if spec.rotary is not None:
            key.append(spec.rotary._buffers["cos_cache"].data_ptr())
        sinks = spec.attention._parameters.get("sinks")
        key.append(0 if sinks is None else sinks.data_ptr())
        for lin in linears:
            # NOTE: whether each bf16 linear is packed decides whether the unfused path would
            # take the few-row kernel, so it is part of the key.
            key.append(lin.packed_weight is None)
            if lin.gguf_packed is not None:
                key += [0 if p is None else p.data_ptr() for p in lin.gguf_packed]
            if lin.lora is not None:
                key += [t.data_ptr() for t in (lin.lora.a, lin.lora.b, lin.lora.seg_rows)]
            key.append(-1)  # each linear's part ends here
        if key != self._key:
            (self._fixed, self._off_reason), self._key = _build_fixed(spec), key
            self._lora_batch = next(
                (lin.lora.batch for lin in linears if lin.lora is not None), None
            )
            self._dtype = spec.qkv.dtype
            self._widths = _scratch_widths(self._fixed) if self._fixed is not None else ()
        self._checked = True
        return self._fixed


def fused_layers(model: torch.nn.Module) -> list[FusedDecodeLayer]:
    """The fused paths of `model`'s decoder layers (those that have one)."""
    return [
        f
        for m in model.modules()
        if isinstance(f := getattr(m, "fused_decode", None), FusedDecodeLayer)
    ]


def storage_moved(model: torch.nn.Module) -> None:
    """Every fused layer of `model` checks its tensors' addresses at its next call."""
    for fused in fused_layers(model):
        fused.storage_moved()


class FusableLayer(Protocol):
    """A decoder layer with a fused path (None: it runs module by module, e.g. --batch-invariant)."""

    fused_decode: FusedDecodeLayer | None


class FusedDecodeStack:
    """A pipeline stage's fused layers in one native call (tern_decode_layers_*): for a model whose
    every layer on the stage is fused with its MLP and reads the same KV-cache group's metadata.
    Each layer still builds (and checks) its own fixed struct; a step that any layer would not
    take, or a layer whose fused path is off, runs layer by layer."""

    def __init__(self, layers: list[FusableLayer]) -> None:
        self.layers = layers
        self._structs: tuple[TernDecodeLayer, ...] = ()
        self._array: ctypes.Array | None = None  # the structs' addresses, in layer order

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the last layer's MLP output, its residual), as running the layers one by one returns
        them, or None: not fused."""
        fused = [layer.fused_decode for layer in self.layers]
        if None in fused:
            return None
        first = fused[0]
        step = first.prepare(x, meta, residual)  # None, or first._fixed is current
        if step is None:
            return None
        structs = [first._fixed]
        for layer in fused[1:]:
            fixed = layer._fixed_struct()
            if fixed is None or layer._dtype != x.dtype or layer._widths != first._widths:
                return None
            if layer._lora_batch is not first._lora_batch:
                return None
            structs.append(fixed)
        if tuple(map(id, structs)) != tuple(map(id, self._structs)):
            self._structs = tuple(structs)
            self._array = (ctypes.c_void_p * len(structs))(*map(ctypes.addressof, structs))
        tmp_out, tmp_res = torch.empty_like(x), torch.empty_like(x)
        n = len(structs)
        entry = _entry("tern_decode_layers", x.dtype)
        return _run_native(
            x, first.spec, structs[0].tp_size, 2 * n,
            lambda out, res_out, seq: entry(
                self._array, n, ctypes.byref(step.struct), x.data_ptr(), _ptr(residual), out,
                res_out, tmp_out.data_ptr(), tmp_res.data_ptr(), seq,
            ),
        )  # fmt: skip


def _entry(name: str, dtype: torch.dtype) -> Callable[..., int]:
    """The native entry `name` for activations of `dtype`."""
    return getattr(kernel_library.load(), f"{name}_{'bf16' if dtype == torch.bfloat16 else 'f32'}")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _run_native(
    x: torch.Tensor,
    spec: DecodeLayerSpec,
    tp_size: int,
    num_reduces: int,
    call: Callable[[int, int, int], int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, res_out) shaped as x, filled by call(out address, res_out address, the first of
    num_reduces all-reduce sequence numbers)."""
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    shm = spec.qkv.ctx.tp_shm
    seq = shm.take_sequence_numbers(num_reduces) if tp_size > 1 else 0
    _raise_for(call(out.data_ptr(), res_out.data_ptr(), seq), shm)
    return out, res_out


def _raise_for(rc: int, shm: object) -> None:
    """The error a fused layer's (or stack's) return code stands for, if any."""
    if rc == -2:
        raise ValueError("a position is past the rotary tables or a KV slot outside the cache")
    if rc == -3:
        raise RuntimeError(
            f"tensor-parallel all-reduce: a peer rank did not arrive within {shm.timeout_s:.0f} s"
        )
    if rc != 0:
        raise RuntimeError("the fused decode layer's kernels refused their inputs")


def _linear(
    lin: LinearBase | None, dtype: torch.dtype, row_parallel: bool = False
) -> TernLinear | None:
    """The struct of a linear the unfused path would run on the few-row kernels in activations of
    `dtype`, else None (an absent MLP's: an empty struct). Row-parallel layers add their bias on
    TP rank 0 only (before the all-reduce)."""
    if lin is None:
        return TernLinear(None, None, None, 0, 0, 0)
    bias = None if row_parallel and lin.ctx.tp_rank != 0 else lin.bias
    if bias is not None and (bias.dtype != dtype or not bias.is_contiguous()):
        return None
    bias_ptr = bias.data_ptr() if bias is not None else None
    if lin.quant == "int8":
        w, scale = lin.int8_views()
        if not (w.is_contiguous() and scale.is_contiguous() and scale.dtype == torch.float32):
            return None
        return TernLinear(w.data_ptr(), scale.data_ptr(), bias_ptr, w.size(0), w.size(1), 0)
    w = lin.weight
    if lin.input_perm is not None:  # the input permuted first (GPTQ act-order): unfused
        return None
    if lin.quant == "gguf" and lin.gguf_segments is not None:
        if dtype != torch.float32 or not w.is_contiguous():
            return None
        return _segmented(lin, bias)
    if lin.quant == "gguf" and dtype == torch.float32 and w.is_contiguous():
        base = WEIGHT_GGUF_Q8ACT if lin.gguf_quantize_x else WEIGHT_GGUF
        fmt = base + linear_ops.BLOCK_TYPES[lin.block_type][0]
        struct = TernLinear(w.data_ptr(), None, bias_ptr, w.size(0), lin.input_size, fmt)
        struct.packed = _packed_ptr(lin, 0)
        return struct
    if lin.quant is not None or not w.is_contiguous():
        return None
    if dtype == torch.float32 and w.dtype in (torch.float32, torch.bfloat16):
        fmt = WEIGHT_BF16 if w.dtype == torch.bfloat16 else 0  # bfloat16-stored: widened
        return TernLinear(w.data_ptr(), None, bias_ptr, w.size(0), w.size(1), fmt)
    if dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or lin.packed_weight is None:
        return None
    rows = max_rows(dtype)
    if rows > linear_ops.bf16_gemv_max_rows() and not linear_ops.amx_fits(
        rows, w.size(0), w.size(1)
    ):
        return None  # dense_linear would take oneDNN for some row counts
    return TernLinear(w.data_ptr(), None, bias_ptr, w.size(0), w.size(1), 0)


def _add_lora(struct: TernLinear, lin: LinearBase) -> bool:
    """Let `struct` add lin's LoRA adapters after its product (after every segment's); False
    where lora_ops.lora_add would refuse the stack (the module path then says why)."""
    lora = lin.lora
    a, b, seg_rows = lora.a, lora.b, lora.seg_rows
    if not all(t.is_cpu and t.is_contiguous() for t in (a, b, seg_rows)):
        return False
    if a.dtype != torch.float32 or b.dtype != torch.float32 or seg_rows.dtype != torch.int32:
        return False
    num_slots, nseg = a.size(0), seg_rows.numel()
    a_shape, b_shape = (num_slots, nseg * lora.rank, struct.k), (num_slots, struct.n, lora.rank)
    if tuple(a.shape) != a_shape or tuple(b.shape) != b_shape:
        return False
    struct.lora_a, struct.lora_b = a.data_ptr(), b.data_ptr()
    struct.lora_seg_rows, struct.lora_nseg = seg_rows.data_ptr(), nseg
    struct.lora_rank, struct.lora_num_slots = lora.rank, num_slots
    return True


def _segmented(lin: LinearBase, bias: torch.Tensor | None) -> TernLinear:
    """A linear whose projections have different block types: a head struct (no weight, every
    row) whose `rest` chains one struct per segment (csrc/tern_kernels.h). The segments' structs
    live on the head (`_segments`), which _build_fixed keeps on the layer's struct."""
    base = WEIGHT_GGUF_Q8ACT if lin.gguf_quantize_x else WEIGHT_GGUF
    segments = []
    for i, seg in enumerate(lin.gguf_segments):
        rows = gguf_blocks.segment_rows(lin.weight, seg, lin.input_size)
        seg_bias = bias[seg.row_start :].data_ptr() if bias is not None else None
        fmt = base + linear_ops.BLOCK_TYPES[seg.block_type][0]
        segments.append(TernLinear(rows.data_ptr(), None, seg_bias, seg.rows, lin.input_size, fmt))
        segments[-1].packed = _packed_ptr(lin, i)
    for seg, nxt in zip(segments, segments[1:]):
        seg.rest = ctypes.pointer(nxt)
    head = TernLinear(None, None, None, lin.output_size, lin.input_size, 0)
    head.rest = ctypes.pointer(segments[0])
    head._segments = segments
    return head


def _packed_ptr(lin: LinearBase, segment: int) -> int | None:
    """The address of a GGUF linear's rows repacked for few-row products (segment `segment`'s)."""
    packed = lin.gguf_packed[segment] if lin.gguf_packed is not None else None
    return packed.data_ptr() if packed is not None else None


def _linears(spec: DecodeLayerSpec) -> list[LinearBase]:
    return [lin for lin in (spec.qkv, spec.o, spec.gate_up, spec.down) if lin is not None]


def _norms(spec: DecodeLayerSpec) -> list[RMSNorm | ShardedRMSNorm]:
    norms = (spec.input_norm, spec.post_norm, spec.attn_out_norm, spec.mlp_out_norm,
             spec.q_norm, spec.k_norm)  # fmt: skip
    return [n for n in norms if n is not None]


def _norm_weight(norm: RMSNorm | ShardedRMSNorm) -> torch.Tensor:
    """The weight the unfused path's kernel multiplies by."""
    if isinstance(norm, RMSNorm) and not norm.is_plain:
        return norm.kernel_weight()
    return norm._parameters["weight"]


def _ptr_or_none(norm: RMSNorm | ShardedRMSNorm | None) -> int | None:
    return None if norm is None else _norm_weight(norm).data_ptr()


def _norms_differ(spec: DecodeLayerSpec, dtype: torch.dtype) -> str | None:
    """Why the unfused path would not run these norms on tern's kernel as the native layer does
    (None: it would)."""
    norms = _norms(spec)
    if (spec.q_norm is None) != (spec.k_norm is None):
        return "a q norm without a k norm"
    if any(n.eps != norms[0].eps for n in norms):
        return "norms with different eps"
    for n in norms:
        if isinstance(n, ShardedRMSNorm):  # over the whole projection: the kernel at tp 1 only
            if n.ctx.tp_size != 1 or dtype != torch.float32 or n.weight.dtype != dtype:
                return "q/k norms over the whole projection outside float32 at --tp 1"
        elif not n.is_plain and dtype != torch.float32:
            return f"norms that multiply in float32 (Gemma, OLMo 2) under {dtype} activations"
        elif n.kernel_weight().dtype != dtype:
            return f"norms not in {dtype}"
    return None


def _build_fixed(spec: DecodeLayerSpec) -> tuple[TernDecodeLayer | None, str]:
    """The layer's struct, or None and why the layer does not qualify."""
    a = spec.attention
    norms = _norms(spec)
    ctx = spec.qkv.ctx
    dtype = spec.qkv.dtype  # the activations'
    cache_dtype = a.kv_cache.dtype  # theirs, or int8 rows (uint8)
    if kernel_library.load() is None:
        return None, "the kernels are off"
    if not a.uses_decode_kernel or dtype not in (torch.float32, torch.bfloat16):
        return None, f"the activations are {dtype} or the KV cache not on tern's decode kernel"
    if cache_dtype not in (dtype, torch.uint8):
        return None, f"a {cache_dtype} KV cache under {dtype} activations"
    if dtype == torch.bfloat16 and linear_ops.bf16_gemv_max_rows() == 0:
        return (
            None,
            f"the {kernel_library.active_tier_name()} kernels have no AVX512-BF16 few-row linear",
        )
    if ctx.tp_size > 1 and (
        ctx.tp_shm is None
        or max_rows(dtype) * spec.o.weight.size(0) * dtype.itemsize > ctx.tp_shm.slot_bytes
    ):  # the all-reduces run in the native call: on the shared segment, rows of the largest step
        return None, "no shared-memory segment for the tensor-parallel all-reduces"
    if (reason := _norms_differ(spec, dtype)) is not None:
        return None, reason
    if spec.gate_up is None and spec.mlp_out_norm is not None:
        return None, "a norm after a mixture of experts"
    linears = [
        _linear(spec.qkv, dtype), _linear(spec.o, dtype, row_parallel=True),
        _linear(spec.gate_up, dtype), _linear(spec.down, dtype, row_parallel=True),
    ]  # fmt: skip
    if any(x is None for x in linears):
        return None, "a linear layer is not on tern's few-row kernels"
    modules = (spec.qkv, spec.o, spec.gate_up, spec.down)
    with_lora = [(s, m) for s, m in zip(linears, modules) if m is not None and m.lora is not None]
    if not all(_add_lora(s, lin) for s, lin in with_lora):
        return None, "a LoRA stack not float32 contiguous CPU tensors of the linear's shape"
    if len({id(lin.lora.batch) for _, lin in with_lora}) > 1:
        return None, "LoRA stacks reading different batches' slots"
    rope = spec.rotary
    k_cache = a.k_cache  # (num_blocks, block_size, Hkv, D)
    layer = TernDecodeLayer(
        *linears,
        _ptr_or_none(spec.input_norm), _ptr_or_none(spec.post_norm),
        _ptr_or_none(spec.attn_out_norm), _ptr_or_none(spec.mlp_out_norm),
        _ptr_or_none(spec.q_norm), _ptr_or_none(spec.k_norm),
        int(isinstance(spec.q_norm, ShardedRMSNorm)),
        norms[0].eps if norms else 1e-6, a.scale, a.softcap or 0.0,
        rope.rotary_dim if rope is not None else 0, int(rope is not None and rope.interleaved),
        int(spec.gelu), spec.residual_scale, int(spec.output_gate),
        linears[1].n, a.num_heads, a.num_kv_heads, a.head_dim, linears[3].k,
        rope.cos_cache.data_ptr() if rope is not None else None,
        rope.sin_cache.data_ptr() if rope is not None else None,
        rope.cos_cache.size(0) if rope is not None else 0,
        k_cache.data_ptr(), a.v_cache.data_ptr(), k_cache.size(0) * k_cache.size(1),
        k_cache.size(1), a.sliding_window or 0,
        2 if cache_dtype == torch.uint8 else int(dtype == torch.bfloat16),
        a.sinks.data_ptr() if a.sinks is not None else None,
        ctx.tp_shm.base if ctx.tp_size > 1 else None, ctx.tp_rank, ctx.tp_size,
        ctx.tp_shm.slot_bytes if ctx.tp_size > 1 else 0,
        ctx.tp_shm.timeout_s if ctx.tp_size > 1 else 0.0,
    )  # fmt: skip
    # NOTE: the struct copies each linear's head; their segments' structs must outlive it.
    layer._segments = [getattr(lin, "_segments", None) for lin in linears]
    return layer, ""


def kernel_report(model: torch.nn.Module, device: torch.device) -> str:
    """Which CPU kernels this worker runs and whether its decoder layers run fused, for the
    start-up log (once the KV cache is allocated: the fused path depends on it)."""
    if device.type != "cpu":
        return "kernels: not used on " + device.type
    fused = fused_layers(model)
    reasons = {r for r in (f.off_reason() for f in fused)}
    moe = any(isinstance(m, SparseMoE) for m in model.modules())
    if not fused:
        state = "off, reason: this model has no softmax-attention decoder layers"
    elif reasons == {None}:
        state = "on" + (" (then each layer's experts, grouped by expert)" if moe else "")
    else:
        state = "off, reason: " + "; ".join(sorted(r for r in reasons if r is not None))
    return f"{kernel_library.describe()}, fused decode layer: {state}"

"""A whole decoder layer in one native call (decode_layer.c) for decode steps of a few sequences: the per-layer Python of such steps (~110 us of ~380 us per layer at one sequence on
this 2-core machine) is most of what is left besides reading the weights.

A layer takes the fused path only where the unfused one would run exactly these kernels, so its
output is bit for bit the same: the kernels built with AVX512-BF16, bfloat16 activations and KV
cache on the CPU, a layer unsharded or tensor-parallel within one host (the two all-reduces then
run in the native call, on the shared-memory segment of shm_collectives.py), Llama-style (no q/k
norm), bfloat16 or int8 linears, and a step whose tokens are all single-token decodes, at most
`max_rows()` of them (the rows tern's few-row bfloat16 kernels take: 2, or 32 with AMX). Everything else returns None and runs module by module.

The layer's fixed part (weights, norms, rotary tables, its KV cache) is one ctypes struct, rebuilt
whenever one of those tensors moves (weight updates, sleep and wake-up replace storage); the
step's part (positions, block tables, slots, scratch rows) is built once per step and shared by
the layers through the step's AttentionMetadata.
"""

from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING

import torch

from workers.layers import native
from workers.layers.activation import SiluAndMul
from workers.layers.attention import AttentionMetadata

if TYPE_CHECKING:
    from workers.layers.linear import LinearBase
    from workers.models.llama import LlamaDecoderLayer

_vp, _i32, _i64, _f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


class _Linear(ctypes.Structure):
    _fields_ = [("weight", _vp), ("scale", _vp), ("bias", _vp), ("n", _i32), ("k", _i32)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
        ("input_norm", _vp), ("post_norm", _vp), ("eps", _f32), ("attn_scale", _f32),
        ("hidden", _i32), ("num_heads", _i32), ("num_kv_heads", _i32), ("head_dim", _i32),
        ("intermediate", _i32), ("cos_cache", _vp), ("sin_cache", _vp), ("num_positions", _i64),
        ("k_cache", _vp), ("v_cache", _vp), ("num_slots", _i64), ("block_size", _i32),
        ("shm", _vp), ("tp_rank", _i32), ("tp_size", _i32), ("shm_slot_bytes", _i64),
        ("shm_timeout_s", ctypes.c_double),
    ]  # fmt: skip


class _Step(ctypes.Structure):
    _fields_ = [
        ("num_tokens", _i32), ("positions", _vp), ("slots", _vp), ("block_tables", _vp),
        ("context_lens", _vp), ("table_stride", _i64), ("normed", _vp), ("qkv", _vp), ("q", _vp),
        ("attn", _vp), ("attn_out", _vp), ("gate_up", _vp), ("act", _vp),
    ]  # fmt: skip


@functools.cache
def max_rows() -> int:
    return max(native.bf16_gemv_max_rows(), native.bf16_amx_max_rows())


def _scratch_widths(fixed: _Layer) -> tuple[int, ...]:
    """Row widths of the step's scratch buffers, in _Step's order (normed .. act)."""
    attn = fixed.num_heads * fixed.head_dim
    return (fixed.hidden, fixed.qkv.n, attn, attn, fixed.hidden, fixed.gate_up.n,
            fixed.intermediate)  # fmt: skip


class StepBuffers:
    """One step's inputs to the fused layers, and scratch rows of `widths`. Lives on the step's
    AttentionMetadata, which also holds the input tensors the struct points at."""

    def __init__(self, meta: AttentionMetadata, widths: tuple[int, ...]) -> None:
        d = meta.decode
        t = d.q_tokens.numel()
        self.widths = widths
        # NOTE: the tensors are kept on self: the struct holds their addresses only.
        self._scratch = [torch.empty(t, w, dtype=torch.bfloat16) for w in widths]
        self.struct = _Step(
            t, meta.positions.data_ptr(), meta.slot_mapping.data_ptr(),
            d.block_tables.data_ptr(), d.context_lens.data_ptr(), d.block_tables.stride(0),
            *(b.data_ptr() for b in self._scratch),
        )  # fmt: skip


class FusedDecodeLayer:
    """The fused path of one LlamaDecoderLayer (held by it; see the module docstring)."""

    def __init__(self, layer: LlamaDecoderLayer) -> None:
        self.layer = layer
        self._key: tuple | None = None
        self._fixed: _Layer | None = None
        self._widths: tuple[int, ...] = ()  # _scratch_widths(self._fixed)

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(MLP output, residual) as the layer's forward returns them, or None: not fused."""
        d = meta.decode
        if (
            d is None
            or not d.is_whole_batch
            or x.dtype != torch.bfloat16
            or x.dim() != 2
            or x.size(0) > max_rows()
            or not x.is_contiguous()
            or (residual is not None and not residual.is_contiguous())
        ):
            return None
        fixed = self._fixed_struct()
        if fixed is None:
            return None
        step = meta.native_step
        if step is None or step.widths != self._widths:
            step = meta.native_step = StepBuffers(meta, self._widths)
        out, res_out = torch.empty_like(x), torch.empty_like(x)
        shm = self.layer.self_attn.qkv_proj.ctx.tp_shm
        seq = shm.take_sequence_numbers(2) if fixed.tp_size > 1 else 0
        rc = native.load().tern_decode_layer_bf16(
            ctypes.byref(fixed), ctypes.byref(step.struct), x.data_ptr(),
            residual.data_ptr() if residual is not None else None, out.data_ptr(),
            res_out.data_ptr(), seq,
        )  # fmt: skip
        if rc == -2:
            raise ValueError("a position is past the rotary tables or a KV slot outside the cache")
        if rc == -3:
            raise RuntimeError(
                f"tensor-parallel all-reduce: a peer rank did not arrive within "
                f"{shm.timeout_s:.0f} s"
            )
        if rc != 0:
            raise RuntimeError("the fused decode layer's kernels refused their inputs")
        return out, res_out

    def _fixed_struct(self) -> _Layer | None:
        layer = self.layer
        attn, mlp = layer.self_attn, layer.mlp
        tensors = [
            lin.weight for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        ] + [
            layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
            attn.attn.kv_cache, attn.rotary_emb.cos_cache,
        ]  # fmt: skip
        # NOTE: whether each bf16 linear is packed decides whether the unfused path would take the
        # few-row kernel, so it is part of the key.
        key = tuple(t.data_ptr() for t in tensors) + tuple(
            lin.packed_weight is None
            for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        )
        if key != self._key:
            self._fixed, self._key = _build_fixed(layer), key
            self._widths = _scratch_widths(self._fixed) if self._fixed is not None else ()
        return self._fixed


def _linear(lin: LinearBase, row_parallel: bool = False) -> _Linear | None:
    """The struct of a linear the unfused path would run on the few-row kernels, else None.
    Row-parallel layers add their bias on TP rank 0 only (before the all-reduce)."""
    bias = None if row_parallel and lin.ctx.tp_rank != 0 else lin.bias
    if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
        return None
    bias_ptr = bias.data_ptr() if bias is not None else None
    if lin.quant is None:
        w = lin.weight
        if lin.packed_weight is None or w.dtype != torch.bfloat16 or not w.is_contiguous():
            return None
        if max_rows() > native.bf16_gemv_max_rows() and not native.amx_fits(
            max_rows(), w.size(0), w.size(1)
        ):
            return None  # dense_linear would take oneDNN for some row counts
        return _Linear(w.data_ptr(), None, bias_ptr, w.size(0), w.size(1))
    if lin.quant != "int8":
        return None
    w, scale = lin._int8.views(lin.weight)
    if not (w.is_contiguous() and scale.is_contiguous() and scale.dtype == torch.float32):
        return None
    return _Linear(w.data_ptr(), scale.data_ptr(), bias_ptr, w.size(0), w.size(1))


def _build_fixed(layer: LlamaDecoderLayer) -> _Layer | None:
    attn, mlp = layer.self_attn, layer.mlp
    a = attn.attn
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    ctx = attn.qkv_proj.ctx
    if (
        native.bf16_gemv_max_rows() == 0
        # the all-reduces run in the native call: on the shared segment, rows of the largest step
        or (
            ctx.tp_size > 1
            and (
                ctx.tp_shm is None
                or max_rows() * norms[0].weight.numel() * 2 > ctx.tp_shm.slot_bytes
            )
        )
        or attn.qk_norm
        or not isinstance(mlp.act_fn, SiluAndMul)
        or not a._uses_decode_kernel
        or a.kv_cache.dtype != torch.bfloat16
        or any(n.weight.dtype != torch.bfloat16 or n.eps != norms[0].eps for n in norms)
    ):
        return None
    linears = [
        _linear(attn.qkv_proj), _linear(attn.o_proj, row_parallel=True),
        _linear(mlp.gate_up_proj), _linear(mlp.down_proj, row_parallel=True),
    ]  # fmt: skip
    if any(x is None for x in linears):
        return None
    rope = attn.rotary_emb
    k_cache = a._k_cache  # (num_blocks, block_size, Hkv, D)
    return _Layer(
        *linears,
        norms[0].weight.data_ptr(), norms[1].weight.data_ptr(), norms[0].eps, a.scale,
        linears[1].n, a.num_heads, a.num_kv_heads, a.head_dim, linears[3].k,
        rope.cos_cache.data_ptr(), rope.sin_cache.data_ptr(), rope.cos_cache.size(0),
        k_cache.data_ptr(), a._v_cache.data_ptr(), k_cache.size(0) * k_cache.size(1),
        k_cache.size(1),
        ctx.tp_shm.base if ctx.tp_size > 1 else None, ctx.tp_rank, ctx.tp_size,
        ctx.tp_shm.slot_bytes if ctx.tp_size > 1 else 0,
        ctx.tp_shm.timeout_s if ctx.tp_size > 1 else 0.0,
    )  # fmt: skip

"""Tensor-parallel linear layers; each shards its weight when built and loads its own shard.

Column-parallel layers split the output features across ranks (no communication in forward);
row-parallel layers split the input features and all-reduce the partial sums in forward. Every
parameter carries `weight_loader(param, loaded_weight, shard_id=None)`, which takes the full
Hugging Face tensor and copies in this rank's slice, so loading is one loop over checkpoint tensors.
`loaded_weight` may also be a lazy checkpoint slice (weight_loader.LazyWeight): loaders only call
`shape`, `size` and `narrow` on it before `copy_checked`, so a rank reads only its shard from disk.
With `quant="int8"` a layer's weight is stored int8 with per-row scales (quantization.py): the
loaders are the same, and `_store` quantizes the rows this rank keeps as they arrive.
Float32 products of a few rows (decode steps) on the CPU go to tern's kernel; bfloat16 weights on
the CPU keep a oneDNN-packed copy (`packed_weight`), which `repack_weights()` re-derives whenever
the weights change (load, update, rollback, sleep, wake-up): see `dense_linear`. Under float32
activations a weight may be stored bfloat16 (CPUs without bfloat16 arithmetic, ModelRunner),
widened to float32 as it is used.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from workers.distributed import ParallelContext, divide, shard_heads
from workers.kernels import kernel_library, linear_ops
from workers.layers.lora import LoraStack
from workers.quant import gguf_blocks, quantization

# Measured on a 2-core AVX2 EPYC (scripts/bench_quant.py --kernels): below 64 rows tern's float32
# kernel beats BLAS (about 2x at 8 rows, 1.5x at 32); from 64 rows BLAS is as fast or faster.
NATIVE_F32_MAX_ROWS = 63


@functools.cache
def _has_mkldnn_bf16() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked layout of a bfloat16 CPU weight (N, K), or None for other weights.

    F.linear on bfloat16 reorders the weight into this layout on every call, which at decode batch
    sizes doubles the step's memory traffic: packed once, the default model's linears take 14 ms
    per decode step instead of 21 (2-core Sapphire Rapids, scripts/bench_step.py).
    """
    if weight.dtype != torch.bfloat16 or not weight.is_cpu or weight.dim() != 2:
        return None
    if weight.numel() == 0 or not _has_mkldnn_bf16():  # numel 0: discarded (sleep level 2)
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


def dense_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """F.linear(x, weight, bias), through `packed` (pack_weight(weight)) when given; few-row
    bfloat16 (1-2 rows, and up to 32 with AMX) and float32 products on the CPU use tern's
    kernels. `batch_invariant` (float32 on the CPU): every row through one arithmetic, so that a
    row's result does not depend on the rows beside it."""
    if batch_invariant:
        x = x.contiguous()
        return linear_ops.f32_linear(x.view(-1, x.size(-1)), weight, bias, invariant=True).view(
            *x.shape[:-1], weight.size(0)
        )
    if weight.dtype == torch.bfloat16 and x.dtype == torch.float32 and x.is_cpu:
        return _bf16_stored_linear(x, weight, bias)
    if packed is not None and x.dtype == torch.bfloat16 and x.is_cpu:
        if x.dim() == 2 and x.is_contiguous():  # few rows: the weights streamed at memory speed
            if x.size(0) <= linear_ops.bf16_gemv_max_rows():
                return linear_ops.bf16_gemv(x, weight, bias)
            if linear_ops.amx_fits(x.size(0), weight.size(0), weight.size(1)):
                return linear_ops.bf16_amx_linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    if (
        x.dim() == 2
        and x.size(0) <= NATIVE_F32_MAX_ROWS
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.is_cpu
        and x.is_contiguous()
        and weight.is_contiguous()
        and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
        and kernel_library.load() is not None
    ):
        return linear_ops.f32_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _bf16_stored_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """float32 x @ bfloat16-stored weight.T: few rows through tern's kernel, which widens the
    weight in registers (half float32's bytes read per decode step); more rows through BLAS on a
    widened copy, where the arithmetic, not the weight's bytes, is the cost."""
    if (
        x.dim() == 2
        and x.size(0) <= NATIVE_F32_MAX_ROWS
        and x.is_contiguous()
        and weight.is_contiguous()
        and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
        and kernel_library.load() is not None
    ):
        return linear_ops.bf16w_linear(x, weight, bias)
    return F.linear(x, weight.float(), bias)


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy a (sliced) checkpoint tensor into a parameter, refusing shape mismatches."""
    if not isinstance(src, torch.Tensor):  # a lazy checkpoint slice: read it now
        src = src.materialize()
    if dst.shape != src.shape:
        raise ValueError(
            f"weight shape mismatch: expected {tuple(dst.shape)}, got {tuple(src.shape)}"
        )
    dst.copy_(src)


def default_weight_loader(
    param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
) -> None:
    """Loader of unsharded parameters (norms): the checkpoint tensor is copied whole."""
    if shard_id is not None:
        raise ValueError(f"unexpected shard {shard_id!r} for an unsharded parameter")
    copy_checked(param.data, loaded_weight)


class LinearBase(nn.Module):
    """A linear layer whose weight is (output_size, input_size) on this rank."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        tp_dim: int | None,
        ctx: ParallelContext,
        quant: str | None = None,
    ) -> None:
        super().__init__()
        quantization.check_quantization(quant)
        self.ctx = ctx
        self.tp_dim = tp_dim
        self.input_size, self.output_size = input_size, output_size  # this rank's
        self.quant = quant
        # The activations' dtype; the weight may be stored bfloat16 under float32 activations
        # (ModelRunner on CPUs without bfloat16 arithmetic), widened as it is used.
        self.dtype = torch.get_default_dtype()
        # This rank's slice [shard_start, shard_start + local size) of the full tp_dim; subclasses
        # with uneven shards overwrite it.
        local = output_size if tp_dim == 0 else input_size
        self.shard_start = ctx.tp_rank * local
        self.full_size = local * ctx.tp_size
        if quant is None:
            self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
            self.weight.weight_loader = self.weight_loader
        else:
            self.store_int8()
        self.packed_weight: torch.Tensor | None = None
        # GGUF blocks under quantized activations: their rows repacked for products of a few rows
        # (gguf_blocks.repack_x8), one per segment.
        self.gguf_packed: list[torch.Tensor | None] | None = None
        # Kept blocks whose columns are the input's permuted (GPTQ act-order: gguf_blocks.py).
        self.input_perm: torch.Tensor | None = None
        self.lora: LoraStack | None = None  # the LoRA adapters it serves (--enable-lora)
        # --batch-invariant: each row's product independent of the batch (set by the model runner)
        self.batch_invariant = False
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        raise NotImplementedError

    def keep_gguf_blocks(self, block_types: str | list[str], quantize_x: bool = False) -> None:
        """Store the weight as GGUF blocks (linear_ops.BLOCK_TYPES) multiplied as stored (with
        `quantize_x`, the activations quantized per block: gguf_blocks.py); before the checkpoint
        loads. One type: (N, row bytes) uint8. One type per shard (`shard_rows`) where they
        differ: a flat parameter of row segments (gguf_blocks.Segment)."""
        types = [block_types] if isinstance(block_types, str) else list(block_types)
        self.quant, self.gguf_quantize_x = "gguf", quantize_x
        if len(set(types)) == 1:
            self.block_type, self.gguf_segments = types[0], None
            self.weight = gguf_blocks.new_parameter(self.output_size, self.input_size, types[0])
        else:
            self.block_type = None
            self.gguf_segments = gguf_blocks.segments_of(self.shard_rows(), types, self.input_size)
            self.weight = gguf_blocks.new_segmented_parameter(self.gguf_segments, self.input_size)
        self.weight.weight_loader = self.weight_loader

    def store_int8(self) -> None:
        """Store the weight int8 with per-row scales (quant="int8", or an int8 checkpoint's
        quantized layers); before the checkpoint loads."""
        self.weight = quantization.new_packed_weight(self.output_size, self.input_size)
        self._int8 = quantization.PackedInt8(self.output_size)
        self.weight.weight_loader = self.weight_loader
        self.quant = "int8"

    def shard_rows(self) -> list[int]:
        """This rank's rows of each projection fused into the layer, in shard order."""
        return [self.output_size]

    def repack_weights(self) -> None:
        packs = self.quant is None and self.dtype == torch.bfloat16
        self.packed_weight = pack_weight(self.weight) if packs else None
        self.gguf_packed = None
        if self.quant == "gguf" and self.gguf_quantize_x:
            self.gguf_packed = gguf_blocks.repack_layer(
                self.weight, self.block_type, self.gguf_segments, self.input_size
            )

    def int8_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight (N, K) int8, scale (N,) float32) of an int8 layer."""
        return self._int8.views(self.weight)

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ W.T + bias with this rank's weight, plus each token's LoRA adapter's product."""
        y = self._base_linear(x, bias)
        if self.lora is not None:
            self.lora.add_(x, y)
        return y

    def _base_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.input_perm is not None:
            x = x.index_select(-1, self.input_perm)
        if self.quant is None:
            return dense_linear(x, self.weight, bias, self.packed_weight, self.batch_invariant)
        if self.quant == "gguf" and self.gguf_segments is not None:
            return gguf_blocks.segmented_linear(
                x, self.weight, self.gguf_segments, self.input_size, bias, self.gguf_quantize_x,
                self.gguf_packed,
            )  # fmt: skip
        if self.quant == "gguf":
            packed = self.gguf_packed[0] if self.gguf_packed is not None else None
            return gguf_blocks.linear(
                x, self.weight, self.block_type, self.input_size, bias, self.gguf_quantize_x, packed
            )
        weight, scale = self.int8_views()
        backend = quantization.int8_backend(x)
        return quantization.int8_matmul(x, weight, scale, bias, backend)

    def _store(
        self, param: nn.Parameter, src: torch.Tensor, offset: int = 0, size: int | None = None
    ) -> None:
        """Copy checkpoint rows `src` into rows [offset, offset + size) of `param` (the whole
        parameter when size is None), quantizing them when the weight is quantized."""
        if self.quant is None or param is not self.weight:
            copy_checked(param.data if size is None else param.data.narrow(0, offset, size), src)
            return
        size = self.output_size if size is None else size
        if self.quant == "gguf" and self.gguf_segments is not None:
            segment = next(
                (s for s in self.gguf_segments if (s.row_start, s.rows) == (offset, size)), None
            )
            if segment is None:
                raise ValueError(f"rows [{offset}, {offset + size}) are not one projection's")
            rows = gguf_blocks.rows_of(src, segment.block_type, self.input_size)
            copy_checked(gguf_blocks.segment_rows(param.data, segment, self.input_size), rows)
            return
        if self.quant == "gguf":
            src = self._permuted_input(src)
            rows = gguf_blocks.rows_of(src, self.block_type, self.input_size)
            copy_checked(param.data.narrow(0, offset, size), rows)
            return
        if not isinstance(src, torch.Tensor):  # a lazy checkpoint slice: read it now
            src = src.materialize()
        if tuple(src.shape) != (size, self.input_size):
            raise ValueError(
                f"weight shape mismatch: expected {(size, self.input_size)}, got {tuple(src.shape)}"
            )
        quantization.store_rows(param.data, self.output_size, offset, src)

    def _permuted_input(self, src: object) -> object:
        """Checkpoint rows for blocks in permuted column order: GGUFBlocks carrying the
        permutation set it (every projection of a fused layer the same one); float rows (a
        weight update) are permuted to it."""
        perm = getattr(src, "input_perm", None)
        if perm is not None:
            if self.input_perm is not None and not torch.equal(self.input_perm, perm):
                raise ValueError("the projections of a fused layer permute their input differently")
            self.input_perm = perm
            return src
        if self.input_perm is None:
            return src
        if isinstance(src, gguf_blocks.GGUFBlocks):
            raise ValueError("blocks in the checkpoint's column order for a permuted layer")
        if not isinstance(src, torch.Tensor):
            src = src.materialize()
        return src.index_select(1, self.input_perm.to(src.device))

    def _narrow_shard(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full checkpoint tensor along the sharded dimension."""
        size = self.output_size if self.tp_dim == 0 else self.input_size
        if loaded_weight.size(self.tp_dim) != self.full_size:
            raise ValueError(
                f"weight shape mismatch: {tuple(loaded_weight.shape)} does not shard into "
                f"{tuple(param.shape)} x {self.ctx.tp_size} along dim {self.tp_dim}"
            )
        return loaded_weight.narrow(self.tp_dim, self.shard_start, size)


class ReplicatedLinear(LinearBase):
    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        *,
        ctx: ParallelContext,
        quant: str | None = None,
    ) -> None:
        super().__init__(input_size, output_size, bias, None, ctx, quant)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if shard_id is not None:
            raise ValueError(f"unexpected shard {shard_id!r} for an unsharded parameter")
        self._store(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; forward returns this rank's slice of the output."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        *,
        ctx: ParallelContext,
        quant: str | None = None,
    ) -> None:
        super().__init__(input_size, divide(output_size, ctx.tp_size), bias, 0, ctx, quant)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if shard_id is not None:
            raise ValueError(f"unexpected shard {shard_id!r} for {type(self).__name__}")
        self._store(param, self._narrow_shard(param, loaded_weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matrix (gate_up_proj).

    Each rank holds rows [start, start + size) of every projection, contiguous per projection:
    by default an even split (size = output size / tp_size), or the `shard` (start, size) given,
    the same for every projection (projections of equal size).
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        *,
        ctx: ParallelContext,
        quant: str | None = None,
        shard: tuple[int, int] | None = None,
    ) -> None:
        self.output_sizes = output_sizes
        if shard is None:
            super().__init__(input_size, sum(output_sizes), bias, ctx=ctx, quant=quant)
            self.shards = [
                (ctx.tp_rank * (n // ctx.tp_size), n // ctx.tp_size) for n in output_sizes
            ]
        else:
            start, size = shard
            if len(set(output_sizes)) != 1 or not 0 <= start < start + size <= output_sizes[0]:
                raise ValueError(f"shard {shard} does not fit projections of {output_sizes} rows")
            LinearBase.__init__(self, input_size, size * len(output_sizes), bias, 0, ctx, quant)
            self.shards = [shard] * len(output_sizes)

    def shard_rows(self) -> list[int]:
        return [size for _, size in self.shards]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if shard_id is None and loaded_weight.size(0) == sum(self.output_sizes):
            # The projections stored as one tensor (Qwen3.5's in_proj_qkv): each in turn.
            start = 0
            for i, rows in enumerate(self.output_sizes):
                self.weight_loader(param, loaded_weight.narrow(0, start, rows), i)
                start += rows
            return
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(
                f"{type(self).__name__} needs a shard id in 0..{len(self.output_sizes)}"
            )
        start, size = self.shards[shard_id]
        offset = sum(n for _, n in self.shards[:shard_id])
        if loaded_weight.size(0) != self.output_sizes[shard_id]:
            raise ValueError(
                f"weight shape mismatch: shard {shard_id} has {loaded_weight.size(0)} rows, "
                f"expected {self.output_sizes[shard_id]}"
            )
        self._store(param, loaded_weight.narrow(0, start, size), offset, size)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matrix, split by heads across ranks (see `shard_heads`).

    Each rank holds whole KV groups, possibly unevenly (9 heads / 3 KV heads at tp 2: 6 + 3); with
    fewer KV heads than ranks, each KV head is replicated on tp_size / num_kv_heads ranks.
    `q_per_head` 2: each query head's rows are its query and then its output gate (Qwen3.5).
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        *,
        ctx: ParallelContext,
        quant: str | None = None,
        q_per_head: int = 1,
    ) -> None:
        shard = shard_heads(total_num_heads, total_num_kv_heads, ctx.tp_size, ctx.tp_rank)
        self.head_dim = head_dim
        self.q_rows_per_head = head_dim * q_per_head
        self.head_start = shard.head_start
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.kv_head_index = shard.kv_head_start
        self.q_size = self.num_heads * self.q_rows_per_head
        self.kv_size = self.num_kv_heads * head_dim
        # NOTE: skips ColumnParallelLinear's even split: this rank's rows are q + k + v of its heads.
        LinearBase.__init__(self, hidden_size, self.q_size + 2 * self.kv_size, bias, 0, ctx, quant)

    def shard_rows(self) -> list[int]:
        return [self.q_size, self.kv_size, self.kv_size]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.head_start * self.q_rows_per_head
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, start = self.kv_size, self.kv_head_index * self.head_dim
        else:
            raise ValueError(f"QKVParallelLinear needs shard id 'q', 'k' or 'v', not {shard_id!r}")
        if start + size > loaded_weight.size(0):
            raise ValueError(
                f"weight shape mismatch: {shard_id} projection has {loaded_weight.size(0)} rows"
            )
        self._store(param, loaded_weight.narrow(0, start, size), offset, size)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; forward all-reduces the partial products.

    `input_shard` = (start, size) gives this rank's input features when they are not an even split
    (o_proj after uneven attention heads); by default each rank takes input_size / tp_size.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        *,
        ctx: ParallelContext,
        input_shard: tuple[int, int] | None = None,
        quant: str | None = None,
    ) -> None:
        if input_shard is None:
            input_shard = (ctx.tp_rank * divide(input_size, ctx.tp_size), input_size // ctx.tp_size)
        start, size = input_shard
        if not (0 <= start and size > 0 and start + size <= input_size):
            raise ValueError(f"input shard {input_shard} outside {input_size} input features")
        super().__init__(size, output_size, bias, 1, ctx, quant)
        self.shard_start, self.full_size = start, input_size

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if shard_id is not None:
            raise ValueError(f"unexpected shard {shard_id!r} for {type(self).__name__}")
        if param is self.bias:  # the bias is not sharded: rank 0 adds it once
            copy_checked(param.data, loaded_weight)
        else:
            self._store(param, self._narrow_shard(param, loaded_weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.ctx.tp_rank == 0 else None
        y = self._linear(x, bias)
        return self.ctx.all_reduce(y)

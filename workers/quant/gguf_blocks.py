"""Block-quantized weights kept as they are stored: GGUF's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (blocks of 32
values) and Q4_K, Q5_K, Q6_K (super-blocks of 256), and tern's INT4_ZP (int4_blocks.py: GPTQ,
AWQ, --quantization int4): linear_ops.BLOCK_TYPES.

A linear layer that keeps them (`LinearBase.keep_gguf_blocks`) holds its rows' blocks as one uint8
parameter (N, K / block values * block bytes); tensor parallelism shards rows, or columns at block
boundaries. Checkpoint tensors arrive as `GGUFBlocks` (a GGUF file's rows, not dequantized) or, from
a weight update, as float tensors, quantized on arrival to the layer's block type (by the `gguf`
package as llama.cpp's quantizer rounds them; K-quants by kquants.py). The products: tern's kernel
dequantizes each block in registers exactly as the gguf package does and multiplies in float32 (what
a --dtype float32 server does: it computes with the file's dequantized weights). The fast path (any
other --dtype) quantizes each 32-value block of the activations to int8 with its own scale and takes
the products in integers, as llama.cpp does (csrc/linear_gguf.c), reading a copy of the rows
repacked at load in groups of 8 (`repack_x8`, kept beside the blocks and re-derived by
`repack_weights` whenever they change: every type's records within 3% of its blocks' bytes), 4 rows
of x per unpacking from 4 rows: at any number of rows on AVX2 and AVX-512 (1.2-2.3x the float32
tiles), below 32 rows on tiers with bfloat16 arithmetic, where from 32 rows the kernels' tiles are
dequantized to bfloat16 and multiplied in bfloat16 (2-2.6x the float32 tiles at 32 rows) and from
BF16_MIN_ROWS (long prefills) torch's bfloat16 GEMM multiplies the dequantized weight. A build
without AVX2 takes the float32 products from 4 rows. The exact path from dequant_min_rows() rows
dequantizes the weight once per call and the GEMM is torch's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from workers.kernels import kernel_library, linear_ops
from workers.quant import int4_blocks, kquants

# Rows from which a product dequantizes the whole weight and calls torch's GEMM, per kernel tier:
# below, the kernels' tiles (dequantized into L1, register-blocked) win (measured on 2048 x 2048
# Q4_K / Q8_0: at 256 rows AVX2 at par, AVX-512 1.35x faster; at 1024 AVX-512 1.15x).
DEQUANT_MIN_ROWS = {"baseline": 64, "avx2": 256}
DEQUANT_MIN_ROWS_WIDER = 1024  # the AVX-512 tiers


# The fast path's long prefills (quantize_x) on tiers with bfloat16 arithmetic (AVX512-BF16, AMX):
# the dequantized weight and the activations rounded to bfloat16, torch's bfloat16 GEMM (at 2048 x
# 576 x 1536 here 946 GFLOP/s, float32's 192), from BF16_MIN_ROWS rows, where it overtakes the
# kernels' bfloat16 tiles (measured on the default model's shapes in Q4_K: at par at 256-512
# rows, torch's 1.1-1.4x faster from 768).
BF16_TIERS = ("avx512_bf16", "amx")
BF16_MIN_ROWS = 384


def dequant_min_rows() -> int:
    return DEQUANT_MIN_ROWS.get(kernel_library.active_tier_name(), DEQUANT_MIN_ROWS_WIDER)


def block_values(block_type: str) -> int:
    """Values per block (or K-quant super-block) of `block_type`."""
    return linear_ops.BLOCK_TYPES[block_type][1]


class GGUFBlocks:
    """Rows of a GGUF tensor in their block format, shaped as the (N, K) weight they hold.

    Offers the part of the torch.Tensor API weight loaders use (shape, size, dim, narrow) and
    `materialize` (the dequantized float32 tensor), as weight_loader.LazyWeight does.
    """

    def __init__(
        self,
        blocks: torch.Tensor,
        block_type: str,
        cols: int,
        input_perm: torch.Tensor | None = None,
    ) -> None:
        # input_perm: the blocks hold the columns input_perm[0], input_perm[1], ... (GPTQ's
        # act-order, its groups made contiguous): the layer permutes its input the same way.
        self.blocks, self.block_type, self.input_perm = blocks, block_type, input_perm
        self.shape = torch.Size([blocks.size(0), cols])

    def size(self, dim: int | None = None) -> int | torch.Size:
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return 2

    def narrow(self, dim: int, start: int, length: int) -> GGUFBlocks | torch.Tensor:
        dim %= 2
        if not 0 <= start <= start + length <= self.shape[dim]:
            raise ValueError(f"slice [{start}, {start + length}) outside dim {dim} of {self.shape}")
        if start == 0 and length == self.shape[dim]:
            return self
        if dim == 0:
            rows = self.blocks.narrow(0, start, length)
            return GGUFBlocks(rows, self.block_type, self.shape[1], self.input_perm)
        values = block_values(self.block_type)
        if start % values or length % values or self.input_perm is not None:
            # not at block boundaries, or columns permuted: the values themselves
            return self.materialize().narrow(1, start, length)
        start_byte = linear_ops.gguf_row_bytes(self.block_type, start)
        cols = self.blocks.narrow(1, start_byte, linear_ops.gguf_row_bytes(self.block_type, length))
        return GGUFBlocks(cols, self.block_type, length)

    def materialize(self) -> torch.Tensor:
        """The float32 weight, its columns in the checkpoint's order."""
        values = dequantize(self.blocks.contiguous(), self.block_type, self.shape[1])
        if self.input_perm is None:
            return values
        out = torch.empty_like(values)
        out[:, self.input_perm] = values
        return out


def new_parameter(rows: int, cols: int, block_type: str) -> nn.Parameter:
    """A zeroed (rows, row bytes) uint8 parameter: the blocks of a (rows, cols) weight (zero
    blocks dequantize to zeros)."""
    nbytes = linear_ops.gguf_row_bytes(block_type, cols)
    return nn.Parameter(torch.zeros(rows, nbytes, dtype=torch.uint8), requires_grad=False)


@dataclass(frozen=True)
class Segment:
    """Rows [row_start, row_start + rows) of a fused linear (q, k, v; gate, up) stored as
    `block_type` from byte `byte_start` of the layer's flat parameter: llama.cpp's mixes give one
    fused layer's projections different types (a Q4_K_M file's v Q6_K beside q and k Q4_K)."""

    row_start: int
    rows: int
    block_type: str
    byte_start: int


def segments_of(row_counts: list[int], block_types: list[str], cols: int) -> list[Segment]:
    """Consecutive segments of `row_counts` rows in `block_types`, packed back to back."""
    segments, row, byte = [], 0, 0
    for rows, block_type in zip(row_counts, block_types, strict=True):
        segments.append(Segment(row, rows, block_type, byte))
        row += rows
        byte += rows * linear_ops.gguf_row_bytes(block_type, cols)
    return segments


def new_segmented_parameter(segments: list[Segment], cols: int) -> nn.Parameter:
    """A zeroed flat uint8 parameter holding every segment's rows of blocks."""
    last = segments[-1]
    nbytes = last.byte_start + last.rows * linear_ops.gguf_row_bytes(last.block_type, cols)
    return nn.Parameter(torch.zeros(nbytes, dtype=torch.uint8), requires_grad=False)


def segment_rows(flat: torch.Tensor, segment: Segment, cols: int) -> torch.Tensor:
    """The (rows, row bytes) view of one segment in a segmented parameter."""
    row_bytes = linear_ops.gguf_row_bytes(segment.block_type, cols)
    return flat.narrow(0, segment.byte_start, segment.rows * row_bytes).view(-1, row_bytes)


def segmented_linear(
    x: torch.Tensor,
    flat: torch.Tensor,
    segments: list[Segment],
    cols: int,
    bias: torch.Tensor | None,
    quantize_x: bool = False,
    packed: list[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """x @ W.T + bias with W's row segments in their own block types (`linear` on each; `packed`:
    each segment's repack_x8)."""
    packed = packed or [None] * len(segments)
    parts = [
        linear(x, segment_rows(flat, s, cols), s.block_type, cols, None, quantize_x, p)
        for s, p in zip(segments, packed)
    ]
    y = torch.cat(parts, dim=-1)
    return y if bias is None else y + bias.to(y.dtype)


def _qtype(block_type: str):
    import gguf

    return gguf.GGMLQuantizationType[block_type]


def dequantize(blocks: torch.Tensor, block_type: str, cols: int) -> torch.Tensor:
    """(N, row bytes) uint8 -> the (N, K) float32 weight, as the gguf package computes it."""
    if blocks.is_cpu and kernel_library.load() is not None:
        return linear_ops.gguf_dequantize(blocks, block_type, cols)
    import gguf

    if block_type == "INT4_ZP":
        values = int4_blocks.dequantize(blocks.cpu().numpy(), cols)
    else:
        values = gguf.quants.dequantize(blocks.cpu().numpy(), _qtype(block_type))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(blocks.device)


def quantize(weight: torch.Tensor, block_type: str) -> torch.Tensor:
    """An (N, K) float weight as blocks of `block_type`, rounded as llama.cpp's quantizer does
    (K-quants: kquants.py's plain rounding; INT4_ZP: int4_blocks.py's)."""
    import gguf

    values = weight.detach().to(torch.float32).cpu().numpy()
    if block_type == "INT4_ZP":
        return torch.from_numpy(int4_blocks.quantize(values))
    if block_type.endswith("_K"):
        return torch.from_numpy(kquants.quantize_k(values, block_type))
    return torch.from_numpy(gguf.quants.quantize(values, _qtype(block_type)))


def rows_of(src: object, block_type: str, cols: int) -> torch.Tensor:
    """Checkpoint rows (GGUFBlocks, a lazy slice or a float tensor) as blocks of `block_type`."""
    if isinstance(src, GGUFBlocks) and src.block_type == block_type:
        if src.shape[1] != cols:
            raise ValueError(f"weight shape mismatch: {tuple(src.shape)} has not {cols} columns")
        return src.blocks
    if not isinstance(src, torch.Tensor):
        src = src.materialize()
    if src.dim() != 2 or src.size(1) != cols:
        raise ValueError(f"weight shape mismatch: {tuple(src.shape)} has not {cols} columns")
    return quantize(src, block_type)


def repack_x8(blocks: torch.Tensor, block_type: str, cols: int) -> torch.Tensor | None:
    """The blocks' rows repacked in groups of 8 for the quantized-activation products of a few
    rows (csrc/linear_gguf.c: ~3x faster at one row), or None where the kernels cannot read them
    (off, not on the CPU, or the weight discarded by sleep)."""
    if not blocks.is_cpu or blocks.numel() == 0 or kernel_library.load() is None:
        return None
    return linear_ops.gguf_repack_x8(blocks, block_type, cols)


def repack_layer(
    weight: torch.Tensor, block_type: str | None, segments: list[Segment] | None, cols: int
) -> list[torch.Tensor | None]:
    """A layer's kept blocks repacked (repack_x8): one entry, or one per segment."""
    if segments is None:
        assert block_type is not None
        return [repack_x8(weight, block_type, cols)]
    return [repack_x8(segment_rows(weight, s, cols), s.block_type, cols) for s in segments]


def linear(
    x: torch.Tensor,
    blocks: torch.Tensor,
    block_type: str,
    cols: int,
    bias: torch.Tensor | None,
    quantize_x: bool = False,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """x (..., K) @ W.T + bias, W stored as `blocks`, the result in x's dtype: float32 arithmetic,
    or (`quantize_x`) x quantized to int8 per block and integer products from `packed`
    (repack_x8 of the blocks; without it, the float32 product), on tiers with bfloat16
    arithmetic from 32 rows bfloat16 products."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, cols)
    native_ok = x.is_cpu and kernel_library.load() is not None
    # The fast path: the kernels at any number of rows (integer products from the repacked rows;
    # bfloat16 tiles from 32 rows where the tier has them), but torch's bfloat16 GEMM for long
    # prefills on those tiers; a build without AVX2 (baseline) takes the float32 products.
    tier = kernel_library.active_tier_name() if quantize_x and native_ok else None
    kernels_at_any_rows = packed is not None and tier not in (None, "baseline")
    if tier in BF16_TIERS and x2.size(0) >= BF16_MIN_ROWS:
        w = dequantize(blocks, block_type, cols).to(torch.bfloat16)
        b = None if bias is None else bias.to(torch.bfloat16)
        y = F.linear(x2.to(torch.bfloat16), w, b).float()
    elif not native_ok or (x2.size(0) >= dequant_min_rows() and not kernels_at_any_rows):
        w = dequantize(blocks, block_type, cols)
        y = F.linear(x2.float(), w, None if bias is None else bias.float())
    else:
        b = None if bias is None else bias.float().contiguous()
        y = linear_ops.gguf_linear(
            x2.float().contiguous(), blocks, block_type, b, quantize_x, packed
        )
    return y.to(x.dtype).view(*lead, -1)

"""Bindings of the linear kernels (csrc/linear_*.c): float32, bfloat16-stored, few-row bfloat16
(AVX512-BF16 and AMX), int8 and GGUF / int4 blocks, and the float32 MoE experts. They check
dtypes, devices and contiguity and raise ValueError on misuse rather than pass bad pointers;
`kernel_library.load()` is the library this process uses, or None (kernels off or unbuildable):
every caller then takes its torch path."""

from __future__ import annotations

import functools
from typing import Any

import torch

from workers.kernels.kernel_library import active_tier_name, load, load_tier
from workers.kernels.tensor_args import check, float_dtype, ptr


@functools.cache
def _bf16_rows(tier_name: str) -> tuple[int, int]:
    """(few-row bf16 kernel rows, AMX kernel rows) of a tier's build: 0 where it has none."""
    lib = None if tier_name == "off" else load_tier(tier_name)
    if lib is None:
        return 0, 0
    return int(lib.tern_bf16_gemv_available()), int(lib.tern_bf16_amx_max_rows())


def bf16_gemv_max_rows() -> int:
    """Rows of x tern's few-row bfloat16 linear takes (AVX512-BF16), 0 where it has none."""
    return _bf16_rows(active_tier_name())[0]


def int8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x (M, K) float32 or bfloat16 (bias alike), weight (N, K) int8, scale (N,) float32 ->
    x @ (weight * scale).T + bias in x's dtype."""
    lib = load()
    assert lib is not None, "the CPU kernels are not available"
    check(x, float_dtype(x), "x")
    check(weight, torch.int8, "weight")
    check(scale, torch.float32, "scale")
    if bias is not None:
        check(bias, x.dtype, "bias")
    (m, k), (n, k_w) = x.shape, weight.shape
    if k != k_w or scale.numel() != n or (bias is not None and bias.numel() != n):
        raise ValueError(f"int8 linear: x {tuple(x.shape)} does not fit weight {(n, k_w)}")
    y = torch.empty(m, n, dtype=x.dtype)
    fn = lib.tern_int8_linear if x.dtype == torch.float32 else lib.tern_int8_linear_bf16
    rc = fn(
        ptr(x), ptr(weight), ptr(scale), ptr(bias) if bias is not None else None, ptr(y),
        m, n, k,
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("int8 linear: no memory for a scratch tile")
    return y


def int8_dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """weight (N, K) int8, scale (N,) float32 -> weight * scale[:, None], (N, K) float32."""
    lib = load()
    assert lib is not None, "the CPU kernels are not available"
    check(weight, torch.int8, "weight")
    check(scale, torch.float32, "scale")
    n, k = weight.shape
    if scale.numel() != n:
        raise ValueError(f"int8 dequantize: {scale.numel()} scales for {n} rows")
    out = torch.empty(n, k, dtype=torch.float32)
    lib.tern_int8_dequantize(ptr(weight), ptr(scale), ptr(out), n, k)
    return out


# Block types the kernels multiply as stored: name -> (type id, values per block, bytes per block).
# GGUF's (ggml's type ids) and tern's INT4_ZP (GPTQ / AWQ / --quantization int4: int4_blocks.py).
BLOCK_TYPES = {
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q5_0": (6, 32, 22),
    "Q5_1": (7, 32, 24),
    "Q8_0": (8, 32, 34),
    "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210),
    "INT4_ZP": (64, 32, 21),
}


def gguf_row_bytes(block_type: str, k: int) -> int:
    """Bytes of a row of k values in `block_type`; k must split into its blocks."""
    _, values, nbytes = BLOCK_TYPES[block_type]
    if k % values:
        raise ValueError(f"{k} values do not split into {block_type} blocks of {values}")
    return k // values * nbytes


def _gguf_type(blocks: torch.Tensor, block_type: str, k: int, name: str) -> int:
    """The ggml type id of `blocks`, checked to be (N, row bytes of k values) contiguous uint8."""
    check(blocks, torch.uint8, "blocks")
    if k % BLOCK_TYPES[block_type][1] or blocks.size(1) != gguf_row_bytes(block_type, k):
        raise ValueError(f"{name}: {tuple(blocks.shape)} are not {block_type} rows of {k} values")
    return BLOCK_TYPES[block_type][0]


def gguf_linear(
    x: torch.Tensor,
    blocks: torch.Tensor,
    block_type: str,
    bias: torch.Tensor | None,
    quantize_x: bool = False,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """x (M, K) float32 @ W.T + bias, W (N, K) stored as `blocks` (N, row bytes) uint8 of a GGUF
    block type, dequantized in registers; with `quantize_x` and `packed` (gguf_repack_x8 of the
    blocks), x quantized to int8 per 32-value block and the products taken in integers from the
    repacked rows, from 32 rows in bfloat16 tiles on tiers with bfloat16 arithmetic (the fast
    path)."""
    lib = load()
    assert lib is not None, "the CPU kernels are not available"
    check(x, torch.float32, "x")
    (m, k), n = x.shape, blocks.size(0)
    type_id = _gguf_type(blocks, block_type, k, "gguf linear")
    if bias is not None:
        check(bias, torch.float32, "bias")
        if bias.numel() != n:
            raise ValueError(f"gguf linear: {bias.numel()} biases for {n} rows")
    y = torch.empty(m, n, dtype=torch.float32)
    b = ptr(bias) if bias is not None else None
    if quantize_x:
        if packed is not None:
            check(packed, torch.uint8, "packed")
            if packed.numel() != lib.tern_gguf_x8_bytes(type_id, n, k):
                raise ValueError(f"gguf linear: {packed.numel()} packed bytes for {n} x {k}")
        p = ptr(packed) if packed is not None else None
        rc = lib.tern_gguf_linear_q8act(ptr(x), ptr(blocks), p, type_id, b, ptr(y), m, n, k)
    else:
        rc = lib.tern_gguf_linear(ptr(x), ptr(blocks), type_id, b, ptr(y), m, n, k)
    if rc != 0:
        raise MemoryError("gguf linear: no memory for a scratch tile")
    return y


def gguf_repack_x8(blocks: torch.Tensor, block_type: str, k: int) -> torch.Tensor:
    """(N, row bytes) uint8 blocks -> their rows repacked in groups of 8 (csrc/linear_gguf.c),
    which gguf_linear's products of few quantized rows read."""
    lib = load()
    assert lib is not None, "the CPU kernels are not available"
    type_id = _gguf_type(blocks, block_type, k, "gguf repack")
    n = blocks.size(0)
    out = torch.empty(lib.tern_gguf_x8_bytes(type_id, n, k), dtype=torch.uint8)
    lib.tern_gguf_repack_x8(ptr(blocks), type_id, n, k, ptr(out))
    return out


def gguf_dequantize(blocks: torch.Tensor, block_type: str, k: int) -> torch.Tensor:
    """(N, row bytes) uint8 blocks -> the (N, K) float32 weight."""
    lib = load()
    assert lib is not None, "the CPU kernels are not available"
    type_id = _gguf_type(blocks, block_type, k, "gguf dequantize")
    out = torch.empty(blocks.size(0), k, dtype=torch.float32)
    lib.tern_gguf_dequantize(ptr(blocks), type_id, ptr(out), blocks.size(0), k)
    return out


def _linear_shape(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, name: str
) -> tuple[int, int, int]:
    """(M, N, K) of x (M, K) @ weight (N, K).T + bias (N,), all contiguous CPU `dtype` tensors."""
    check(x, dtype, "x")
    check(weight, dtype, "weight")
    if bias is not None:
        check(bias, dtype, "bias")
    (m, k), (n, k_w) = x.shape, weight.shape
    if k != k_w or (bias is not None and bias.numel() != n):
        raise ValueError(f"{name}: x {tuple(x.shape)} does not fit weight {(n, k_w)}")
    return m, n, k


def f32_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, invariant: bool = False
) -> torch.Tensor:
    """x (M, K) @ weight (N, K).T + bias, all float32: the few-row GEMM of decode steps; with
    `invariant`, any M, each row's result independent of the others (--batch-invariant)."""
    lib = load()
    assert lib is not None, "the CPU kernels are not available"
    m, n, k = _linear_shape(x, weight, bias, torch.float32, "f32 linear")
    y = torch.empty(m, n, dtype=torch.float32)
    entry = lib.tern_f32_linear_invariant if invariant else lib.tern_f32_linear
    rc = entry(ptr(x), ptr(weight), ptr(bias) if bias is not None else None, ptr(y), m, n, k)
    if rc != 0:
        raise MemoryError("f32 linear: no memory for a scratch tile")
    return y


def f32_moe_experts(
    x: torch.Tensor,
    tokens: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    b13: torch.Tensor | None,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
) -> torch.Tensor:
    """x (T, H) float32 through SiLU-gated experts: pair p sends token tokens[p] through expert
    experts[p] (int64, each token's pairs in the order they are to be added) weighted by
    weights[p]; w13 (E, 2I, H), w2 (E, H, I), biases (E, 2I) / (E, H) or None -> (T, H)."""
    lib = load()
    assert lib is not None, "the CPU kernels are not available"
    for t, dtype, name in ((x, torch.float32, "x"), (tokens, torch.int64, "tokens"),
                           (experts, torch.int64, "experts"), (weights, torch.float32, "weights"),
                           (w13, torch.float32, "w13"), (w2, torch.float32, "w2")):  # fmt: skip
        check(t, dtype, name)
    for b in (b13, b2):
        if b is not None:
            check(b, torch.float32, "bias")
    num_pairs, (num_experts, inter2, hidden) = tokens.numel(), w13.shape
    if x.size(1) != hidden or w2.shape != (num_experts, hidden, inter2 // 2):
        raise ValueError("f32 MoE experts: x, w13 and w2 do not agree")
    if experts.numel() != num_pairs or weights.numel() != num_pairs:
        raise ValueError("f32 MoE experts: one expert and one weight per pair")
    if num_pairs and (int(experts.min()) < 0 or int(experts.max()) >= num_experts):
        raise ValueError("f32 MoE experts: an expert outside the weights")
    gate_up = torch.empty(num_pairs, inter2)
    act = torch.empty(num_pairs, inter2 // 2)
    y = torch.empty(num_pairs, hidden)
    out = torch.zeros_like(x)
    lib.tern_f32_moe_experts(
        ptr(x), hidden, ptr(tokens), ptr(experts), ptr(weights), num_pairs, ptr(w13),
        ptr(b13) if b13 is not None else None, ptr(w2), ptr(b2) if b2 is not None else None,
        inter2 // 2, ptr(gate_up), ptr(act), ptr(y), ptr(out),
    )  # fmt: skip
    return out


def bf16_amx_max_rows() -> int:
    """Rows of x tern's AMX bfloat16 linear takes, 0 where the CPU, build or OS has no AMX."""
    return _bf16_rows(active_tier_name())[1]


def bf16w_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (M, K) float32 @ weight (N, K).T + bias, the weight stored bfloat16 and widened to float32
    in registers; x, bias and the result float32."""
    lib = load()
    assert lib is not None, "the CPU kernels are not available"
    check(x, torch.float32, "x")
    check(weight, torch.bfloat16, "weight")
    if bias is not None:
        check(bias, torch.float32, "bias")
    (m, k), (n, k_w) = x.shape, weight.shape
    if k != k_w or (bias is not None and bias.numel() != n):
        raise ValueError(f"bf16w linear: x {tuple(x.shape)} does not fit weight {(n, k_w)}")
    y = torch.empty(m, n, dtype=torch.float32)
    rc = lib.tern_bf16w_linear(
        ptr(x), ptr(weight), ptr(bias) if bias is not None else None, ptr(y), m, n, k
    )
    if rc != 0:
        raise MemoryError("bf16w linear: no memory for a scratch tile")
    return y


def bf16_amx_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x (M, K) @ weight (N, K).T + bias, bfloat16, for M <= bf16_amx_max_rows(), K % 32 == 0
    and N % 16 == 0 (`amx_fits`): each weight is read once for all M rows."""
    return _bf16_linear("tern_bf16_amx_linear", "bf16 AMX linear", amx_fits, x, weight, bias)


def amx_fits(m: int, n: int, k: int) -> bool:
    return 1 <= m <= bf16_amx_max_rows() and k % 32 == 0 and n % 16 == 0


def bf16_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (M, K) @ weight (N, K).T + bias, all bfloat16 with float32 accumulation, for
    M <= bf16_gemv_max_rows(): each weight is read once for all M rows."""

    def fits(m: int, n: int, k: int) -> bool:
        return 1 <= m <= bf16_gemv_max_rows()

    return _bf16_linear("tern_bf16_gemv", "bf16 gemv", fits, x, weight, bias)


def _bf16_linear(
    entry: str,
    name: str,
    fits: Any,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """One of the few-row bfloat16 linears: checks, the output, the call."""
    lib = load()
    assert lib is not None, "the CPU kernels are not available"
    m, n, k = _linear_shape(x, weight, bias, torch.bfloat16, name)
    if not fits(m, n, k):
        raise ValueError(f"{name}: ({m}, {k}) rows @ ({n}, {k}).T is not a supported shape")
    y = torch.empty(m, n, dtype=torch.bfloat16)
    rc = getattr(lib, entry)(
        ptr(x), ptr(weight), ptr(bias) if bias is not None else None, ptr(y), m, n, k
    )
    if rc != 0:
        raise ValueError(f"{name}: not available in this build")
    return y

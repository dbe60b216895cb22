"""Python wrappers of tern's CPU kernels (csrc/, built and chosen by kernel_library.py).

`paged_decode_attention`, `f32_linear`, `bf16w_linear`, `bf16_gemv`, `int8_linear`,
`int8_dequantize`, `lora_add`, `exponential_uniforms` and the elementwise ops wrap the C entry
points: they check dtypes, devices and contiguity and raise ValueError on misuse rather than pass
bad pointers. `load()` is the library this process uses, or None (kernels off or unbuildable):
every caller then takes its torch path.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from workers.layers import kv_int8
from workers.layers.kernel_library import active_tier_name, load, load_tier


def usable(*tensors: torch.Tensor | None) -> bool:
    """Whether the kernels are built and these (optional) tensors are CPU tensors of one dtype,
    float32 or bfloat16: what the elementwise kernels take."""
    lib = load()
    dtypes = {t.dtype for t in tensors if t is not None}
    return (
        lib is not None
        and len(dtypes) == 1
        and dtypes <= {torch.float32, torch.bfloat16}
        and all(t is None or t.is_cpu for t in tensors)
    )


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


def _elementwise(lib: ctypes.CDLL, name: str, dtype: torch.dtype) -> Any:
    """The float32 or bfloat16 variant of an elementwise kernel."""
    return getattr(lib, name if dtype == torch.float32 else name + "_bf16")


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _check(t: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    # NOTE: is_cpu, not device.type: this runs several times per layer and device.type costs ~1 us.
    if t.dtype != dtype or not t.is_cpu or not t.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous CPU {dtype} tensor, got {t.dtype} {t.device}"
        )


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> bool:
    """logits[rows[i]] = -inf where bitmask[i] (xgrammar's packed int32 words) has a clear bit,
    in place. False when the kernels are not available (the caller falls back)."""
    lib = load()
    if lib is None:
        return False
    _check(logits, torch.float32, "logits")
    _check(bitmask, torch.int32, "bitmask")
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.size(0) != len(rows):
        raise ValueError(f"bitmask {tuple(bitmask.shape)} does not fit {len(rows)} rows of logits")
    if bitmask.size(1) * 32 < logits.size(1) or not all(0 <= r < logits.size(0) for r in rows):
        raise ValueError("the bitmask is narrower than the logits, or a row is out of range")
    index = torch.tensor(rows, dtype=torch.int64)
    lib.tern_apply_token_bitmask(
        _ptr(logits), logits.size(1), _ptr(bitmask), bitmask.size(1), _ptr(index), len(rows),
        logits.size(1),
    )  # fmt: skip
    return True


def exponential_uniforms(row_keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor | None:
    """The sampler's uniforms (N, K) float32 for row keys (N,) and token ids (K,) or (N, K), int64
    below 2^32 (sampler.exponential_noise's hash); None when the kernels are not available."""
    lib = load()
    if lib is None or not row_keys.is_cpu or not token_ids.is_cpu:
        return None
    row_keys, token_ids = row_keys.contiguous(), token_ids.contiguous()
    _check(row_keys, torch.int64, "row_keys")
    _check(token_ids, torch.int64, "token_ids")
    n, k = row_keys.numel(), token_ids.size(-1)
    per_row = token_ids.dim() == 2
    if token_ids.dim() not in (1, 2) or (per_row and token_ids.size(0) != n):
        raise ValueError(f"token ids {tuple(token_ids.shape)} do not fit {n} row keys")
    out = torch.empty(n, k, dtype=torch.float32)
    lib.tern_exponential_uniforms(_ptr(row_keys), n, _ptr(token_ids), k, int(per_row), _ptr(out))
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q (B, H, D) float32 or bfloat16 -> (B, H, D) alike: each sequence's one query over its
    cached context (its last `window` tokens only, for a sliding-window layer; scores capped to
    softcap * tanh(score / softcap) with `softcap`; `sinks` (H,) float32: each head's attention
    sink, a logit in the softmax with no value, as gpt-oss's).

    k_cache, v_cache (num_blocks, block_size, Hkv, D) float32 or bfloat16, or (...,
    kv_int8.row_bytes(D)) uint8: int8 rows with their group scales (kv_int8.py); block_tables
    (B, max_blocks) int32; context_lens (B,) int32, each at least 1. `new_kv` = (k, v, slots):
    this step's k and v (B, Hkv, D) in the cache's dtype (q's for int8 rows, quantized as
    kv_int8.quantize does; heads contiguous, any token stride), written to cache slots (B,)
    int64 before attending.
    """
    lib = load()
    assert lib is not None, "the CPU kernels are not available"
    _check(q, _float_dtype(q), "q")
    _check(block_tables, torch.int32, "block_tables")
    _check(context_lens, torch.int32, "context_lens")
    kv_formats = {torch.float32: 0, torch.bfloat16: 1, torch.uint8: 2}  # uint8: kv_int8.py's rows
    if k_cache.dtype not in kv_formats or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"the KV cache must be float32 or bfloat16 (or uint8: int8 rows), not {k_cache.dtype}"
        )
    _check(k_cache, k_cache.dtype, "k_cache")
    _check(v_cache, k_cache.dtype, "v_cache")
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, cache_dim = k_cache.shape
    row = kv_int8.row_bytes(head_dim) if k_cache.dtype == torch.uint8 else head_dim
    if cache_dim != row or not block_tables.size(0) == context_lens.size(0) == num_seqs:
        raise ValueError("q, the KV cache, block tables and context lengths do not agree")
    k_new = v_new = slots = None
    if new_kv is not None:
        k_new, v_new, slots = new_kv
        new_dtype = q.dtype if k_cache.dtype == torch.uint8 else k_cache.dtype
        _check_heads(k_new, new_dtype, "k")
        _check_heads(v_new, new_dtype, "v")
        _check(slots, torch.int64, "slots")
        shape = (num_seqs, num_kv_heads, head_dim)
        if k_new.shape != shape or v_new.shape != shape or slots.numel() != num_seqs:
            raise ValueError("the new k, v and slots do not fit q and the KV cache")
    if sinks is not None:
        _check(sinks, torch.float32, "sinks")
        if sinks.numel() != num_heads:
            raise ValueError(f"{sinks.numel()} attention sinks for {num_heads} heads")
    out = torch.empty_like(q)
    rc = lib.tern_paged_decode_attention(
        _ptr(q), _ptr(k_cache), _ptr(v_cache), _ptr(block_tables), block_tables.stride(0),
        _ptr(context_lens), _ptr(out), num_seqs, num_heads, num_kv_heads, head_dim, block_size,
        scale, kv_formats[k_cache.dtype], int(q.dtype == torch.bfloat16),
        _ptr(k_new) if k_new is not None else None, k_new.stride(0) if k_new is not None else 0,
        _ptr(v_new) if v_new is not None else None, v_new.stride(0) if v_new is not None else 0,
        _ptr(slots) if slots is not None else None, num_blocks * block_size, window or 0,
        softcap or 0.0, _ptr(sinks) if sinks is not None else None,
    )  # fmt: skip
    if rc == -2:
        raise ValueError("a new K/V slot is outside the KV cache")
    if rc != 0:
        raise ValueError(
            f"paged decode attention does not support {num_heads} heads / {num_kv_heads} KV "
            f"heads of dim {head_dim} with blocks of {block_size}"
        )
    return out


def supports_decode(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> bool:
    """Whether the decode kernel's fixed buffers fit these shapes (see csrc/attention.c)."""
    group = num_heads // num_kv_heads
    return (
        group * num_kv_heads == num_heads
        and group <= 16
        and head_dim <= 256
        and block_size <= 256
        and num_heads * head_dim <= 32768
    )


def int8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x (M, K) float32 or bfloat16 (bias alike), weight (N, K) int8, scale (N,) float32 ->
    x @ (weight * scale).T + bias in x's dtype."""
    lib = load()
    assert lib is not None, "the CPU kernels are not available"
    _check(x, _float_dtype(x), "x")
    _check(weight, torch.int8, "weight")
    _check(scale, torch.float32, "scale")
    if bias is not None:
        _check(bias, x.dtype, "bias")
    (m, k), (n, k_w) = x.shape, weight.shape
    if k != k_w or scale.numel() != n or (bias is not None and bias.numel() != n):
        raise ValueError(f"int8 linear: x {tuple(x.shape)} does not fit weight {(n, k_w)}")
    y = torch.empty(m, n, dtype=x.dtype)
    fn = lib.tern_int8_linear if x.dtype == torch.float32 else lib.tern_int8_linear_bf16
    rc = fn(
        _ptr(x), _ptr(weight), _ptr(scale), _ptr(bias) if bias is not None else None, _ptr(y),
        m, n, k,
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("int8 linear: no memory for a scratch tile")
    return y


def int8_dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """weight (N, K) int8, scale (N,) float32 -> weight * scale[:, None], (N, K) float32."""
    lib = load()
    assert lib is not None, "the CPU kernels are not available"
    _check(weight, torch.int8, "weight")
    _check(scale, torch.float32, "scale")
    n, k = weight.shape
    if scale.numel() != n:
        raise ValueError(f"int8 dequantize: {scale.numel()} scales for {n} rows")
    out = torch.empty(n, k, dtype=torch.float32)
    lib.tern_int8_dequantize(_ptr(weight), _ptr(scale), _ptr(out), n, k)
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
    _check(blocks, torch.uint8, "blocks")
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
    _check(x, torch.float32, "x")
    (m, k), n = x.shape, blocks.size(0)
    type_id = _gguf_type(blocks, block_type, k, "gguf linear")
    if bias is not None:
        _check(bias, torch.float32, "bias")
        if bias.numel() != n:
            raise ValueError(f"gguf linear: {bias.numel()} biases for {n} rows")
    y = torch.empty(m, n, dtype=torch.float32)
    b = _ptr(bias) if bias is not None else None
    if quantize_x:
        if packed is not None:
            _check(packed, torch.uint8, "packed")
            if packed.numel() != lib.tern_gguf_x8_bytes(type_id, n, k):
                raise ValueError(f"gguf linear: {packed.numel()} packed bytes for {n} x {k}")
        p = _ptr(packed) if packed is not None else None
        rc = lib.tern_gguf_linear_q8act(_ptr(x), _ptr(blocks), p, type_id, b, _ptr(y), m, n, k)
    else:
        rc = lib.tern_gguf_linear(_ptr(x), _ptr(blocks), type_id, b, _ptr(y), m, n, k)
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
    lib.tern_gguf_repack_x8(_ptr(blocks), type_id, n, k, _ptr(out))
    return out


def gguf_dequantize(blocks: torch.Tensor, block_type: str, k: int) -> torch.Tensor:
    """(N, row bytes) uint8 blocks -> the (N, K) float32 weight."""
    lib = load()
    assert lib is not None, "the CPU kernels are not available"
    type_id = _gguf_type(blocks, block_type, k, "gguf dequantize")
    out = torch.empty(blocks.size(0), k, dtype=torch.float32)
    lib.tern_gguf_dequantize(_ptr(blocks), type_id, _ptr(out), blocks.size(0), k)
    return out


def _linear_shape(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, name: str
) -> tuple[int, int, int]:
    """(M, N, K) of x (M, K) @ weight (N, K).T + bias (N,), all contiguous CPU `dtype` tensors."""
    _check(x, dtype, "x")
    _check(weight, dtype, "weight")
    if bias is not None:
        _check(bias, dtype, "bias")
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
    rc = entry(_ptr(x), _ptr(weight), _ptr(bias) if bias is not None else None, _ptr(y), m, n, k)
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
        _check(t, dtype, name)
    for b in (b13, b2):
        if b is not None:
            _check(b, torch.float32, "bias")
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
        _ptr(x), hidden, _ptr(tokens), _ptr(experts), _ptr(weights), num_pairs, _ptr(w13),
        _ptr(b13) if b13 is not None else None, _ptr(w2), _ptr(b2) if b2 is not None else None,
        inter2 // 2, _ptr(gate_up), _ptr(act), _ptr(y), _ptr(out),
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
    _check(x, torch.float32, "x")
    _check(weight, torch.bfloat16, "weight")
    if bias is not None:
        _check(bias, torch.float32, "bias")
    (m, k), (n, k_w) = x.shape, weight.shape
    if k != k_w or (bias is not None and bias.numel() != n):
        raise ValueError(f"bf16w linear: x {tuple(x.shape)} does not fit weight {(n, k_w)}")
    y = torch.empty(m, n, dtype=torch.float32)
    rc = lib.tern_bf16w_linear(
        _ptr(x), _ptr(weight), _ptr(bias) if bias is not None else None, _ptr(y), m, n, k
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
        _ptr(x), _ptr(weight), _ptr(bias) if bias is not None else None, _ptr(y), m, n, k
    )
    if rc != 0:
        raise ValueError(f"{name}: not available in this build")
    return y


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x (T, D) float32 or bfloat16 (weight and residual alike) -> (weight * rmsnorm(x + residual),
    x + residual or None)."""
    lib = load()
    assert lib is not None, "the CPU kernels are not available"
    _check(x, _float_dtype(x), "x")
    _check(weight, x.dtype, "weight")
    t, d = x.shape
    if weight.numel() != d:
        raise ValueError(f"rms norm: weight of {weight.numel()} for rows of {d}")
    out = torch.empty_like(x)
    res_out = None
    if residual is not None:
        _check(residual, x.dtype, "residual")
        if residual.shape != x.shape:
            raise ValueError(f"rms norm: residual {tuple(residual.shape)} is not {(t, d)}")
        res_out = torch.empty_like(x)
    _elementwise(lib, "tern_rms_norm", x.dtype)(
        _ptr(x), _ptr(residual) if residual is not None else None,
        _ptr(res_out) if res_out is not None else None, _ptr(weight), _ptr(out), t, d, eps,
    )  # fmt: skip
    return out, res_out


def gated_delta_decode(
    mixed: torch.Tensor,
    z: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_states: torch.Tensor,
    recurrent: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    heads: tuple[int, int, int, int],
) -> torch.Tensor:
    """A Gated DeltaNet decode step of G sequences (see csrc/gated_delta_net.c), updating their
    conv and recurrent states in place -> the gated norm's output (G, Hv * dv) for out_proj.

    mixed (G, C), z (G, Hv * dv), b and a (G, Hv): rows of the input projections (any row
    stride), float32 or bfloat16, as a_log and dt_bias (Hv,), conv_weight (C, 1, K), conv_states
    (slots, C, K - 1) and norm_weight (dv,); recurrent (slots, Hv, dk, dv) float32; slots (G,)
    int64; fresh (G,) uint8, 1 where a sequence's states start from zeros. heads: (Hk, Hv, dk,
    dv) on this rank."""
    lib = load()
    assert lib is not None, "the CPU kernels are not available"
    dtype = _float_dtype(mixed)
    hk, hv, dk, dv = heads
    num, c = mixed.shape
    for t, name in ((mixed, "mixed"), (z, "z"), (b, "b"), (a, "a")):
        if t.dtype != dtype or not t.is_cpu or t.dim() != 2 or t.stride(1) != 1 or t.size(0) != num:
            raise ValueError(f"{name} must be (G, n) CPU {dtype} rows with contiguous features")
    for t, name in ((conv_weight, "conv_weight"), (conv_states, "conv_states"),
                    (norm_weight, "norm_weight"), (a_log, "A_log"), (dt_bias, "dt_bias")):  # fmt: skip
        _check(t, dtype, name)
    _check(recurrent, torch.float32, "recurrent")
    _check(slots, torch.int64, "slots")
    _check(fresh, torch.uint8, "fresh")
    kernel = conv_weight.size(-1)
    if (
        c != 2 * hk * dk + hv * dv
        or z.size(1) != hv * dv
        or b.size(1) != hv
        or a.size(1) != hv
        or a_log.numel() != hv
        or dt_bias.numel() != hv
        or conv_weight.shape != (c, 1, kernel)
        or conv_states.shape[1:] != (c, kernel - 1)
        or recurrent.shape[1:] != (hv, dk, dv)
        or recurrent.size(0) != conv_states.size(0)
        or slots.numel() != num
        or fresh.numel() != num
        or norm_weight.numel() != dv
    ):
        raise ValueError("gated delta decode: the shapes do not agree")
    scratch = torch.empty(num, c, dtype=torch.float32)
    out = torch.empty(num, hv * dv, dtype=dtype)
    rc = lib.tern_gated_delta_decode(
        _ptr(mixed), mixed.stride(0), _ptr(z), z.stride(0), _ptr(b), b.stride(0), _ptr(a),
        a.stride(0), _ptr(a_log), _ptr(dt_bias), _ptr(conv_weight), _ptr(conv_states),
        _ptr(recurrent), _ptr(slots), _ptr(fresh), recurrent.size(0), _ptr(norm_weight), eps,
        _ptr(scratch), _ptr(out), num, hk, hv, dk, dv, kernel, int(dtype == torch.bfloat16),
    )  # fmt: skip
    if rc == -2:
        raise ValueError("gated delta decode: a state slot is outside the pools")
    return out


def lora_add_ready() -> bool:
    """Whether `lora_add` can run: the kernels are built and loaded."""
    return load() is not None


def lora_add(
    x: torch.Tensor,
    y: torch.Tensor,
    slots: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    rank: int,
    seg_rows: torch.Tensor,
) -> None:
    """y (M, N) += each row's LoRA adapter's product with x (M, K), in place (lora.py's
    LoraStack): row t on slot s = slots[t] (-1: nothing added) gets, in each projection's block
    of columns, b[s] @ (a[s] @ x[t]) restricted to that projection's rank rows, in float32.

    x and y float32, or bfloat16 (x widened, each y value rounded once), rows with contiguous
    features (any row stride); slots (M,) int32; a (S, nseg * rank, K) and b (S, N, rank) float32
    contiguous; seg_rows (nseg,) int32, the projections' rows, summing to N."""
    lib = load()
    assert lib is not None, "the CPU kernels are not available"
    dtype = _float_dtype(x)
    for t, name in ((x, "x"), (y, "y")):
        if t.dtype != dtype or not t.is_cpu or t.dim() != 2 or t.stride(1) != 1:
            raise ValueError(f"{name} must be (M, n) CPU {dtype} rows with contiguous features")
    _check(slots, torch.int32, "slots")
    _check(a, torch.float32, "a")
    _check(b, torch.float32, "b")
    _check(seg_rows, torch.int32, "seg_rows")
    (m, k), n, nseg = x.shape, y.size(1), seg_rows.numel()
    if (
        rank < 1
        or y.size(0) != m
        or slots.numel() != m
        or a.dim() != 3
        or a.shape[1:] != (nseg * rank, k)
        or tuple(b.shape) != (a.size(0), n, rank)
    ):
        raise ValueError(
            f"lora add: x {tuple(x.shape)}, y {tuple(y.shape)}, {slots.numel()} slots, "
            f"A {tuple(a.shape)}, B {tuple(b.shape)} of rank {rank} in {nseg} segments disagree"
        )
    rc = lib.tern_lora_add(
        _ptr(x), x.stride(0), _ptr(y), y.stride(0), _ptr(slots), m, k, n, _ptr(a), _ptr(b),
        a.size(0), rank, nseg, _ptr(seg_rows), int(dtype == torch.bfloat16),
    )  # fmt: skip
    if rc == -1:
        raise ValueError(
            f"lora add: a slot outside [-1, {a.size(0)}), segments {seg_rows.tolist()} that do "
            f"not sum to {n} rows, or rows that overlap"
        )
    if rc != 0:
        raise MemoryError("lora add: no memory for the scratch rows")


def _float_dtype(x: torch.Tensor) -> torch.dtype:
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"expected a float32 or bfloat16 tensor, got {x.dtype}")
    return x.dtype


def _check_heads(x: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    if x.dtype != dtype or not x.is_cpu or x.dim() != 3:
        raise ValueError(f"{name} must be a (T, heads, D) CPU {dtype} tensor")
    if x.stride(2) != 1 or x.stride(1) != x.size(2):
        raise ValueError(f"{name} needs contiguous heads")


def rotary_neox_(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    interleaved: bool = False,
) -> None:
    """Rotate q (T, H, D) and k (T, Hkv, D), float32 or bfloat16, in place by positions (T,)
    int64: the first 2 * cos_cache.size(1) features of each head (all of them, or a partial
    rotation), neox style (halves) or `interleaved` (pairs)."""
    lib = load()
    assert lib is not None, "the CPU kernels are not available"
    _check_heads(q, _float_dtype(q), "q")
    _check_heads(k, q.dtype, "k")
    _check(positions, torch.int64, "positions")
    _check(cos_cache, torch.float32, "cos_cache")
    _check(sin_cache, torch.float32, "sin_cache")
    t, h, d = q.shape
    r = cos_cache.size(1) * 2
    if k.size(0) != t or k.size(2) != d or positions.numel() != t or r > d:
        raise ValueError("rotary: q, k, positions and the cos/sin tables do not agree")
    rc = _elementwise(lib, "tern_rotary_neox", q.dtype)(
        _ptr(q), q.stride(0), _ptr(k), k.stride(0), _ptr(positions), cos_cache.size(0),
        _ptr(cos_cache), _ptr(sin_cache), t, h, k.size(1), d, r, int(interleaved),
    )  # fmt: skip
    if rc != 0:
        raise ValueError("rotary: a position is past the cos/sin table")


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x (T, 2I) float32 or bfloat16 = [gate | up] -> silu(gate) * up, (T, I)."""
    return _gated(x, "tern_silu_and_mul")


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x (T, 2I) float32 or bfloat16 = [gate | up] -> gelu(gate, tanh approximation) * up."""
    return _gated(x, "tern_gelu_tanh_and_mul")


def sigmoid_gate_(o: torch.Tensor, gate: torch.Tensor) -> None:
    """o (T, n) *= sigmoid(gate (T, n)), in place; float32 or bfloat16, rows with contiguous
    features (any row strides)."""
    lib = load()
    assert lib is not None, "the CPU kernels are not available"
    dtype = _float_dtype(o)
    for t, name in ((o, "o"), (gate, "gate")):
        if t.dtype != dtype or not t.is_cpu or t.dim() != 2 or t.stride(1) != 1:
            raise ValueError(f"{name} must be (T, n) CPU {dtype} rows with contiguous features")
    if gate.shape != o.shape:
        raise ValueError(f"sigmoid gate: gate {tuple(gate.shape)} for o {tuple(o.shape)}")
    _elementwise(lib, "tern_sigmoid_gate", dtype)(
        _ptr(o), o.stride(0), _ptr(gate), gate.stride(0), o.size(0), o.size(1)
    )


def _gated(x: torch.Tensor, name: str) -> torch.Tensor:
    lib = load()
    assert lib is not None, "the CPU kernels are not available"
    _check(x, _float_dtype(x), "x")
    t, two_i = x.shape
    if two_i % 2:
        raise ValueError(f"{name} needs an even width, got {two_i}")
    out = torch.empty(t, two_i // 2, dtype=x.dtype)
    _elementwise(lib, name, x.dtype)(_ptr(x), _ptr(out), t, two_i // 2)
    return out

"""Bindings of paged attention: decode (csrc/attention.c: one query per sequence over its cached
context, float or int8 (workers/quant/kv_int8.py) caches) and prefill (csrc/prefill_attention.c:
a prompt chunk's queries, causal over the cache)."""

from __future__ import annotations

import torch

from workers.kernels.kernel_library import load
from workers.kernels.tensor_args import check, check_heads, float_dtype, ptr
from workers.quant import kv_int8


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
    check(q, float_dtype(q), "q")
    check(block_tables, torch.int32, "block_tables")
    check(context_lens, torch.int32, "context_lens")
    kv_formats = {torch.float32: 0, torch.bfloat16: 1, torch.uint8: 2}  # uint8: kv_int8.py's rows
    if k_cache.dtype not in kv_formats or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"the KV cache must be float32 or bfloat16 (or uint8: int8 rows), not {k_cache.dtype}"
        )
    check(k_cache, k_cache.dtype, "k_cache")
    check(v_cache, k_cache.dtype, "v_cache")
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, cache_dim = k_cache.shape
    row = kv_int8.row_bytes(head_dim) if k_cache.dtype == torch.uint8 else head_dim
    if cache_dim != row or not block_tables.size(0) == context_lens.size(0) == num_seqs:
        raise ValueError("q, the KV cache, block tables and context lengths do not agree")
    k_new = v_new = slots = None
    if new_kv is not None:
        k_new, v_new, slots = new_kv
        new_dtype = q.dtype if k_cache.dtype == torch.uint8 else k_cache.dtype
        check_heads(k_new, new_dtype, "k")
        check_heads(v_new, new_dtype, "v")
        check(slots, torch.int64, "slots")
        shape = (num_seqs, num_kv_heads, head_dim)
        if k_new.shape != shape or v_new.shape != shape or slots.numel() != num_seqs:
            raise ValueError("the new k, v and slots do not fit q and the KV cache")
    if sinks is not None:
        check(sinks, torch.float32, "sinks")
        if sinks.numel() != num_heads:
            raise ValueError(f"{sinks.numel()} attention sinks for {num_heads} heads")
    out = torch.empty_like(q)
    rc = lib.tern_paged_decode_attention(
        ptr(q), ptr(k_cache), ptr(v_cache), ptr(block_tables), block_tables.stride(0),
        ptr(context_lens), ptr(out), num_seqs, num_heads, num_kv_heads, head_dim, block_size,
        scale, kv_formats[k_cache.dtype], int(q.dtype == torch.bfloat16),
        ptr(k_new) if k_new is not None else None, k_new.stride(0) if k_new is not None else 0,
        ptr(v_new) if v_new is not None else None, v_new.stride(0) if v_new is not None else 0,
        ptr(slots) if slots is not None else None, num_blocks * block_size, window or 0,
        softcap or 0.0, ptr(sinks) if sinks is not None else None,
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


def supports_prefill(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether this CPU's kernel build runs prefill attention for these shapes and dtype."""
    lib = load()
    return (
        lib is not None
        and dtype in (torch.float32, torch.bfloat16)
        and bool(lib.tern_prefill_attention_available(int(dtype == torch.bfloat16)))
        and num_heads % num_kv_heads == 0
        and head_dim % 32 == 0
        and head_dim <= 256
    )


def prefill_max_context() -> int | None:
    """The longest context this build's prefill kernel takes (None: any); beyond it torch's
    attention is as fast (csrc/prefill_attention.c)."""
    lib = load()
    longest = int(lib.tern_prefill_attention_max_context()) if lib is not None else 0
    return longest or None


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    q_start: torch.Tensor,
    q_len: torch.Tensor,
    ctx_start: torch.Tensor,
    scale: float,
    window: int | None,
    out: torch.Tensor,
) -> None:
    """Writes into `out` (T, H, D) the rows of B prompt chunks: sequence b's q_len[b] queries
    from flat token q_start[b] (positions ctx_start[b] on) attend causally, within `window` when
    given, to their keys in k_cache / v_cache (num_blocks, block_size, Hkv, D), already holding
    this step's, through block_tables (B, max_blocks) int32. q and out in the cache's dtype with
    contiguous heads; q_start, q_len, ctx_start (B,) int32."""
    lib = load()
    assert lib is not None, "the CPU kernels are not available"
    dtype = float_dtype(q)
    check_heads(q, dtype, "q")
    check_heads(out, dtype, "out")
    check(k_cache, dtype, "k_cache")
    check(v_cache, dtype, "v_cache")
    for t, name in ((block_tables, "block_tables"), (q_start, "q_start"), (q_len, "q_len"),
                    (ctx_start, "ctx_start")):  # fmt: skip
        check(t, torch.int32, name)
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    rc = lib.tern_prefill_attention(
        ptr(q), q.stride(0), ptr(k_cache), ptr(v_cache), ptr(block_tables),
        block_tables.stride(0), ptr(q_start), ptr(q_len), ptr(ctx_start), ptr(out),
        out.stride(0), q_len.numel(), num_heads, num_kv_heads, head_dim, block_size, scale,
        window or 0, int(dtype == torch.bfloat16),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(
            f"prefill attention does not run {num_heads} heads / {num_kv_heads} KV heads of dim "
            f"{head_dim} in {dtype} on this kernel build"
        )

"""Paged attention: the native decode kernel and the padded SDPA path against a per-sequence reference.

The reference attends each sequence's queries over its context read back from the cache through its
block table, one plain `scaled_dot_product_attention` call per sequence. Batches mix prefill chunks
and decodes, block tables are scattered, and the KV cache is float32 or bfloat16.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from workers.kernels import attention_ops, kernel_library
from workers.kernels.kernel_library import runnable_tiers, use_tier
from workers.layers.attention import Attention, build_attention_metadata

HEADS, KV_HEADS, HEAD_DIM = 6, 2, 16
TIERS = [t.name for t in runnable_tiers()] if kernel_library.load() is not None else []


def needs_kernels(test):
    """Runs `test` once per kernel tier this CPU runs (the kernel_tier fixture)."""
    test = pytest.mark.usefixtures("kernel_tier")(test)
    return pytest.mark.skipif(kernel_library.load() is None, reason="no C compiler")(test)


def _batch(
    query_lens: list[int],
    start_pos: list[int],
    block_size: int,
    num_blocks: int,
    seed: int,
    shape: tuple[int, int, int] = (HEADS, KV_HEADS, HEAD_DIM),
) -> tuple[list[list[int]], torch.Tensor]:
    """Scattered block tables for the sequences, and a cache filled with random K/V."""
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = []
    for q, s in zip(query_lens, start_pos):
        tables.append([free.pop() for _ in range(-(-(s + q) // block_size))])
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, num_blocks, block_size, shape[1], shape[2], generator=g)
    return tables, cache


def _reference(
    q: torch.Tensor,
    cache: torch.Tensor,
    tables: list[list[int]],
    query_lens: list[int],
    start_pos: list[int],
    block_size: int,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    out, offset = [], 0
    for table, n, start in zip(tables, query_lens, start_pos):
        ctx = start + n
        slots = torch.tensor(
            [table[p // block_size] * block_size + p % block_size for p in range(ctx)]
        )
        k = cache[0].flatten(0, 1)[slots].float().transpose(0, 1)  # (Hkv, ctx, D)
        v = cache[1].flatten(0, 1)[slots].float().transpose(0, 1)
        mask = torch.arange(ctx)[None, :] <= torch.arange(start, ctx)[:, None]  # (n, ctx)
        if window is not None:  # keys q - window < k <= q
            mask &= torch.arange(ctx)[None, :] > torch.arange(start, ctx)[:, None] - window
        qs = q[offset : offset + n].float().transpose(0, 1)  # (H, n, D)
        if softcap is None:
            o = F.scaled_dot_product_attention(
                qs, k, v, attn_mask=mask, scale=q.size(-1) ** -0.5, enable_gqa=True
            )
        else:  # Gemma 2's eager attention: scores capped before the mask and softmax
            group = qs.size(0) // k.size(0)
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
            scores = qs @ k.transpose(-1, -2) * q.size(-1) ** -0.5
            scores = torch.tanh(scores / softcap) * softcap
            o = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        out.append(o.transpose(0, 1))
        offset += n
    return torch.cat(out)


def _run(
    query_lens: list[int],
    start_pos: list[int],
    *,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    use_kernel: bool,
    seed: int = 0,
    shape: tuple[int, int, int] = (HEADS, KV_HEADS, HEAD_DIM),
    window: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Attention's output, the reference) for one step; the step's own K/V go in first.
    `shape`: (heads, KV heads, head dim)."""
    heads, kv_heads, head_dim = shape
    num_blocks = sum(-(-(s + q) // block_size) for s, q in zip(start_pos, query_lens)) + 3
    tables, cache = _batch(query_lens, start_pos, block_size, num_blocks, seed, shape)
    cache = cache.to(dtype)
    g = torch.Generator().manual_seed(seed + 1)
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(num_tokens, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_tokens, kv_heads, head_dim, generator=g).to(dtype)
    attn = Attention(
        heads, head_dim, kv_heads, head_dim**-0.5, sliding_window=window, softcap=softcap
    )
    attn.has_decode_kernel = use_kernel
    attn.kv_cache = cache
    meta = build_attention_metadata(start_pos, query_lens, tables, block_size, torch.device("cpu"))
    out = attn(q, k, v, meta)
    ref = _reference(q, cache, tables, query_lens, start_pos, block_size, window, softcap)
    return out.float(), ref


@pytest.mark.parametrize("tier", [*TIERS, "off"])
@pytest.mark.parametrize(
    "query_lens,start_pos",
    [
        ([1], [0]),  # a one-token prompt
        ([1], [37]),  # one decode: the kernel splits it by KV head
        ([1] * 9, [0, 3, 4, 5, 16, 17, 30, 63, 100]),  # decodes only: one item per sequence
        ([5, 1, 12, 1, 1], [0, 9, 3, 0, 22]),  # prefill chunks and decodes mixed
        ([7, 1, 3, 12, 9], [0, 9, 0, 5, 0]),  # padded fresh prompts beside a later chunk
        ([6, 6, 6, 1], [0, 0, 0, 4]),  # fresh prompts of one length, contiguous: viewed
    ],
)
def test_matches_per_sequence_reference(
    query_lens: list[int], start_pos: list[int], tier: str
) -> None:
    """Each kernel tier this CPU runs, and the torch path ("off")."""
    with use_tier(tier):
        out, ref = _run(query_lens, start_pos, use_kernel=tier != "off")
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@needs_kernels
@pytest.mark.parametrize("block_size", [1, 16])
def test_kernel_with_bf16_cache_and_other_block_sizes(block_size: int) -> None:
    query_lens, start_pos = [1, 1, 3, 1], [40, 0, 5, 17]
    out, ref = _run(
        query_lens, start_pos, block_size=block_size, dtype=torch.bfloat16, use_kernel=True
    )
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)  # bf16 output rounding
    fallback, _ = _run(
        query_lens, start_pos, block_size=block_size, dtype=torch.bfloat16, use_kernel=False
    )
    torch.testing.assert_close(out, fallback, atol=2e-2, rtol=2e-2)


@needs_kernels
@pytest.mark.parametrize(
    "shape,block_size",
    [
        ((9, 3, 64), 16),  # SmolLM2: 3 query heads per KV head
        ((14, 2, 64), 16),  # Qwen2-0.5B: 7 per KV head, more than are held in registers at once
        ((4, 4, 128), 32),  # no grouping, two 64-feature halves, two 16-token chunks per block
        ((8, 2, 64), 5),  # blocks shorter than a 16-token chunk
    ],
)
def test_bf16_kernel_at_real_models_head_dims(shape: tuple[int, int, int], block_size: int) -> None:
    """Head dims that are multiples of 64 take the kernel's 16-tokens-at-a-time path; contexts
    end mid-chunk and mid-block, and a lone decode splits by KV head."""
    for query_lens, start_pos in ([1, 1, 1, 1], [40, 0, 70, 16]), ([1], [100]):
        out, ref = _run(
            query_lens, start_pos, block_size=block_size, dtype=torch.bfloat16,
            use_kernel=True, shape=shape,
        )  # fmt: skip
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("tier", [*TIERS, "off"])
@pytest.mark.parametrize("window", [1, 5, 16, 200])
def test_sliding_windows(window: int, tier: str) -> None:
    """Decodes (the kernel starts each sequence at its window, mid-block too), padded later chunks
    and fresh prompts longer than the window, on every tier and the torch path; a window longer
    than every context changes nothing."""
    query_lens, start_pos = [1, 1, 1, 7, 12, 1], [0, 3, 40, 9, 0, 100]
    with use_tier(tier):
        for block_size in (4, 16):
            out, ref = _run(query_lens, start_pos, block_size=block_size,
                            use_kernel=tier != "off", window=window)  # fmt: skip
            torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
            if tier != "off":
                out, ref = _run(query_lens, start_pos, block_size=block_size, use_kernel=True,
                                window=window, dtype=torch.bfloat16, shape=(8, 2, 64))  # fmt: skip
                torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("tier", [*TIERS, "off"])
@pytest.mark.parametrize("window", [None, 5])
def test_softcapping(window: int | None, tier: str) -> None:
    """Gemma 2's capped scores (a cap of 2: random scores reach it): decodes through the kernel
    on every tier, prefill chunks through the explicit path, float32 and bfloat16."""
    query_lens, start_pos = [1, 1, 1, 7, 12, 1], [0, 3, 40, 9, 0, 100]
    with use_tier(tier):
        out, ref = _run(query_lens, start_pos, use_kernel=tier != "off", window=window,
                        softcap=2.0)  # fmt: skip
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
        out, ref = _run(query_lens, start_pos, block_size=16, use_kernel=tier != "off",
                        window=window, softcap=2.0, dtype=torch.bfloat16, shape=(8, 2, 64))  # fmt: skip
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


@needs_kernels
def test_kernel_validates_its_inputs() -> None:
    q = torch.randn(2, HEADS, HEAD_DIM)
    cache = torch.zeros(4, 4, KV_HEADS, HEAD_DIM)
    tables = torch.zeros(2, 1, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="int32"):
        attention_ops.paged_decode_attention(q, cache, cache, tables.long(), lens, 1.0)
    with pytest.raises(ValueError, match="do not agree"):
        attention_ops.paged_decode_attention(q, cache, cache, tables[:1], lens, 1.0)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        attention_ops.paged_decode_attention(q, cache.half(), cache.half(), tables, lens, 1.0)
    assert not attention_ops.supports_decode(HEADS, KV_HEADS, 512, 4)  # head_dim beyond the kernel
    k = torch.ones(2, KV_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="outside the KV cache"):  # 4 blocks x 4 = 16 slots
        attention_ops.paged_decode_attention(
            q, cache, cache, tables, lens, 1.0, new_kv=(k, k, torch.tensor([0, 16]))
        )
    assert cache.abs().sum() == 0  # nothing was written


def test_decode_only_metadata_equals_the_general_path() -> None:
    """A step of single-token queries (every decode step) builds its metadata from Python ints;
    the tensors equal those of the general path, block tables of unequal lengths (one sequence
    holding a block beyond its context) included."""
    from workers.layers import attention

    start_pos = [0, 17, 95, 31]
    tables, _ = _batch([1] * 4, start_pos, 16, 40, seed=3)
    tables[1].append(39)  # a block allocated ahead of the context
    cpu = torch.device("cpu")
    fast = build_attention_metadata(start_pos, [1] * 4, tables, 16, cpu)
    general = attention._general_metadata(start_pos, [1] * 4, tables, 16, cpu, None, None)
    for name in ("positions", "slot_mapping", "query_start_loc", "context_lens", "block_tables"):
        want = getattr(general, name)
        assert torch.equal(getattr(fast, name), want) and getattr(fast, name).dtype == want.dtype
    assert fast.groups == general.groups == []
    assert fast.decode is not None and general.decode is not None
    for name in ("q_tokens", "block_tables", "context_lens"):
        got, want = getattr(fast.decode, name), getattr(general.decode, name)
        assert torch.equal(got, want) and got.dtype == want.dtype and got.is_contiguous()
    assert fast.decode.is_whole_batch and fast.decode.block_size == 16
    assert (fast.start_pos_list, fast.query_len_list) == (start_pos, [1] * 4)


def _long_context_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lens: list[int],
    scale: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """q (B, H, D); k, v (B, ctx, Hkv, D) each sequence's context in order -> (B, H, D)."""
    out = []
    group = q.size(1) // k.size(2)
    for b, n in enumerate(lens):
        begin = n - window if window is not None and n > window else 0
        kb = k[b, begin:n].float().repeat_interleave(group, 1).transpose(0, 1)  # (H, n, D)
        vb = v[b, begin:n].float().repeat_interleave(group, 1).transpose(0, 1)
        scores = (kb @ q[b].float()[:, :, None])[..., 0] * scale  # (H, n)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if sinks is not None:  # one more logit per head, with no value
            scores = torch.cat([scores, sinks[:, None]], dim=1)
        p = scores.softmax(-1)[:, : n - begin]
        out.append((p[:, None, :] @ vb)[:, 0])
    return torch.stack(out)


@needs_kernels
@pytest.mark.parametrize(
    "kv,window,softcap,with_sinks",
    [
        ("float32", None, None, False),
        ("float32", 300, None, True),  # the window starts inside a part; the sink counts once
        ("float32", None, 2.0, False),
        ("bfloat16", None, None, False),  # the 16-token AVX512-BF16 loop where the tier has it
        ("bfloat16", 600, None, False),
        ("int8", None, None, True),
    ],
)
def test_long_contexts_are_attended_in_parts(
    kv: str, window: int | None, softcap: float | None, with_sinks: bool
) -> None:
    """Contexts beyond the kernel's 256-token parts (1 to 5 parts; a lone sequence, and four):
    each part is a work item of its own and the parts' softmaxes are merged, equal to one
    softmax over the whole context; a query's result is the same alone and in a batch."""
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    lens = [1000, 257, 256, 700]
    g = torch.Generator().manual_seed(7)
    io = torch.float32 if kv != "bfloat16" else torch.bfloat16
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(io)
    k = torch.randn(len(lens), max(lens), kv_heads, head_dim, generator=g).to(io)
    v = torch.randn(len(lens), max(lens), kv_heads, head_dim, generator=g).to(io)
    per_seq = -(-max(lens) // block_size)
    order = torch.randperm(len(lens) * per_seq, generator=g)  # scattered blocks
    tables = order.view(len(lens), per_seq).to(torch.int32)
    sinks = torch.randn(heads, generator=g) if with_sinks else None
    shape = (len(lens) * per_seq, block_size, kv_heads, head_dim)
    if kv == "int8":
        from workers.quant import kv_int8

        k_cache = torch.zeros(*shape[:3], kv_int8.row_bytes(head_dim), dtype=torch.uint8)
        v_cache = torch.zeros_like(k_cache)
    else:
        k_cache, v_cache = torch.zeros(shape, dtype=io), torch.zeros(shape, dtype=io)
    for b, n in enumerate(lens):
        slots = torch.tensor([int(tables[b, p // block_size]) * block_size + p % block_size
                              for p in range(n)])  # fmt: skip
        if kv == "int8":
            kv_int8.write(k_cache, slots, k[b, :n])
            kv_int8.write(v_cache, slots, v[b, :n])
            k[b, :n] = kv_int8.read(k_cache.flatten(0, 1)[slots], io)  # what the cache holds
            v[b, :n] = kv_int8.read(v_cache.flatten(0, 1)[slots], io)
        else:
            k_cache.view(-1, kv_heads, head_dim)[slots] = k[b, :n]
            v_cache.view(-1, kv_heads, head_dim)[slots] = v[b, :n]
    scale = head_dim**-0.5
    context_lens = torch.tensor(lens, dtype=torch.int32)

    def attend(rows: slice) -> torch.Tensor:
        return attention_ops.paged_decode_attention(
            q[rows].contiguous(), k_cache, v_cache, tables[rows].contiguous(),
            context_lens[rows].contiguous(), scale, window=window, softcap=softcap, sinks=sinks,
        )  # fmt: skip

    out = attend(slice(None))
    ref = _long_context_reference(q, k, v, lens, scale, window, softcap, sinks)
    tol = 2e-2 if io == torch.bfloat16 else 2e-5
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    assert torch.equal(attend(slice(0, 1)), out[:1])  # alone: one sequence, 3 KV-head items


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape,block_size",
    [
        ((9, 3, 64), 16),  # SmolLM2: 3 query heads per KV head, 4 positions a work item
        ((14, 2, 64), 16),  # 7 per KV head: work items cut across positions and heads
        ((4, 4, 128), 32),  # no grouping, 128 features
        ((8, 2, 32), 5),  # blocks shorter than a 16-key group, 32 features
    ],
)
@pytest.mark.parametrize("window", [None, 40])
def test_prefill_kernel_matches_the_reference(
    dtype: torch.dtype, shape: tuple[int, int, int], block_size: int, window: int | None
) -> None:
    """Prompt chunks through the prefill kernel (on builds that have it: AVX2 and AVX-512 for
    float32, AVX512-BF16 for bfloat16): fresh prompts, later chunks over cached context (one past 256
    keys), a one-token prompt beside them and decodes in the same step, scattered blocks, with
    and without a sliding window; against the per-sequence reference and against torch's path."""
    heads, kv_heads, head_dim = shape
    if not attention_ops.supports_prefill(dtype, heads, kv_heads, head_dim):
        tier = kernel_library.active_tier_name()
        assert tier == "baseline" or (dtype == torch.bfloat16 and tier in ("avx2", "avx512"))
        pytest.skip(f"no prefill kernel for {dtype} on this tier")
    query_lens, start_pos = [37, 1, 130, 5, 1, 24], [0, 40, 0, 300, 0, 17]
    attn = Attention(heads, head_dim, kv_heads, head_dim**-0.5, sliding_window=window)
    attn.kv_cache = torch.zeros(2, 4, block_size, kv_heads, head_dim, dtype=dtype)
    assert attn._uses_prefill_kernel
    out, ref = _run(query_lens, start_pos, block_size=block_size, dtype=dtype,
                    use_kernel=True, shape=shape, window=window)  # fmt: skip
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    torch_path, _ = _run(query_lens, start_pos, block_size=block_size, dtype=dtype,
                         use_kernel=False, shape=shape, window=window)  # fmt: skip
    torch.testing.assert_close(out, torch_path, atol=tol, rtol=tol)
    longest = attention_ops.prefill_max_context()
    if longest is not None:  # a build whose kernel stops short: longer contexts take torch's path
        out, ref = _run([3, 9], [longest, 0], block_size=block_size, dtype=dtype,
                        use_kernel=True, shape=shape, window=window)  # fmt: skip
        torch.testing.assert_close(out, ref, atol=tol, rtol=tol)

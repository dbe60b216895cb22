"""tern's LoRA kernel (csrc/lora.c through lora_ops.lora_add) on every kernel tier this CPU runs:
each row's adapter product against a float64 reference (float32 within 1e-5 of the largest value,
bfloat16 within its rounding), rows without an adapter untouched, a row's result the same bits
alone as inside any batch and at any thread count, and misuse refused with ValueError."""

from __future__ import annotations

import pytest
import torch

from workers.kernels import kernel_library, lora_ops
from workers.layers.lora import LoraBatch, LoraStack

# Every test runs once per kernel tier this CPU runs (the kernel_tier fixture).
pytestmark = [
    pytest.mark.skipif(kernel_library.load() is None, reason="no C compiler"),
    pytest.mark.usefixtures("kernel_tier"),
]

K, RANK, NUM_SLOTS = 96, 8, 3
SEGMENTS = [40, 24, 33]  # three projections (qkv), none a multiple of a vector


def _adapters(
    k: int = K, segments: list[int] = SEGMENTS, rank: int = RANK, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """a (S, nseg * rank, k), b (S, N, rank) float32 and seg_rows (nseg,) int32."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(NUM_SLOTS, len(segments) * rank, k, generator=g)
    b = torch.randn(NUM_SLOTS, sum(segments), rank, generator=g)
    return a, b, torch.tensor(segments, dtype=torch.int32)


def _slots(m: int, seed: int = 0) -> torch.Tensor:
    """m slots mixing -1 (no adapter) and each of the adapters."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randint(-1, NUM_SLOTS, (m,), generator=g, dtype=torch.int32)
    head = torch.tensor([0, -1, 2, 1], dtype=torch.int32)[:m]
    slots[: head.numel()] = head
    return slots


def _reference(
    x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> torch.Tensor:
    """y + each row's adapter product, in float64."""
    rank = b.size(2)
    out = y.double().clone()
    start = 0
    for i, n in enumerate(SEGMENTS):
        for t, s in enumerate(slots.tolist()):
            if s >= 0:
                shrunk = a[s, i * rank : (i + 1) * rank].double() @ x[t].double()
                out[t, start : start + n] += b[s, start : start + n].double() @ shrunk
        start += n
    return out


@pytest.mark.parametrize("m", [1, 3, 17, 64])
def test_float32_matches_a_float64_reference(m: int) -> None:
    a, b, seg_rows = _adapters()
    g = torch.Generator().manual_seed(m)
    x, y = torch.randn(m, K, generator=g), torch.randn(m, sum(SEGMENTS), generator=g)
    slots = _slots(m, seed=m)
    expected = _reference(x, y, slots, a, b)
    out = y.clone()
    lora_ops.lora_add(x, out, slots, a, b, RANK, seg_rows)
    assert (out.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
    idle = slots < 0
    assert torch.equal(out[idle], y[idle])


@pytest.mark.parametrize("m", [1, 3, 17, 64])
def test_bfloat16_rounds_once_after_the_float32_sum(m: int) -> None:
    a, b, seg_rows = _adapters()
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, K, generator=g).bfloat16()
    y = torch.randn(m, sum(SEGMENTS), generator=g).bfloat16()
    slots = _slots(m, seed=m)
    expected = _reference(x.float(), y.float(), slots, a, b)
    out = y.clone()
    lora_ops.lora_add(x, out, slots, a, b, RANK, seg_rows)
    # round(y + delta) within one bfloat16 step (2^-7 relative) of the exact sum
    torch.testing.assert_close(out.double(), expected, rtol=2**-7, atol=1e-6)
    idle = slots < 0
    assert torch.equal(out[idle], y[idle])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_bits_alone_as_in_any_batch(dtype: torch.dtype) -> None:
    """Rows on one adapter are tiled together and work is split by rows and columns: none of it
    may change a row's arithmetic (the fused decode layer relies on it)."""
    a, b, seg_rows = _adapters()
    g = torch.Generator().manual_seed(1)
    m = 23
    x = torch.randn(m, K, generator=g).to(dtype)
    y = torch.randn(m, sum(SEGMENTS), generator=g).to(dtype)
    slots = _slots(m, seed=1)
    batch = y.clone()
    lora_ops.lora_add(x, batch, slots, a, b, RANK, seg_rows)
    for t in range(m):
        alone = y[t : t + 1].clone()
        lora_ops.lora_add(x[t : t + 1], alone, slots[t : t + 1], a, b, RANK, seg_rows)
        assert torch.equal(alone, batch[t : t + 1]), t
    order = torch.randperm(m, generator=g)[:9]  # another batch: other neighbours, other groups
    part = y[order].clone()
    lora_ops.lora_add(x[order], part, slots[order].contiguous(), a, b, RANK, seg_rows)
    assert torch.equal(part, batch[order])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_thread_count_does_not_change_the_bits(dtype: torch.dtype) -> None:
    """Large enough for the parallel path (csrc/lora.c: LORA_PARALLEL_MIN_FMAS)."""
    k, segments, rank = 576, [576, 192, 192], 16
    a, b, seg_rows = _adapters(k, segments, rank)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, k, generator=g).to(dtype)
    y = torch.randn(40, sum(segments), generator=g).to(dtype)
    slots = torch.arange(40, dtype=torch.int32) % (NUM_SLOTS + 1) - 1
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in sorted({1, 2, threads}):
            torch.set_num_threads(n)
            outs.append(y.clone())
            lora_ops.lora_add(x, outs[-1], slots, a, b, rank, seg_rows)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    assert not torch.equal(outs[0], y)


def test_strided_rows_and_rows_without_adapters() -> None:
    a, b, seg_rows = _adapters()
    g = torch.Generator().manual_seed(3)
    wide_x, wide_y = torch.randn(5, K + 7, generator=g), torch.randn(5, sum(SEGMENTS) + 3)
    x, y = wide_x[:, :K], wide_y[:, 1 : 1 + sum(SEGMENTS)]  # rows of views: strides K + 7, N + 3
    slots = _slots(5)
    expected = y.clone()
    lora_ops.lora_add(x.contiguous(), expected, slots, a, b, RANK, seg_rows)
    before = wide_y.clone()
    lora_ops.lora_add(x, y, slots, a, b, RANK, seg_rows)
    assert torch.equal(y, expected)
    assert torch.equal(wide_y[:, 0], before[:, 0]) and torch.equal(wide_y[:, -2:], before[:, -2:])
    none = y.clone()
    lora_ops.lora_add(x, none, torch.full((5,), -1, dtype=torch.int32), a, b, RANK, seg_rows)
    assert torch.equal(none, y)


def test_lora_stack_uses_the_kernel_and_agrees_with_its_torch_path() -> None:
    batch = LoraBatch()
    stack = LoraStack(batch, num_slots=NUM_SLOTS, rank=RANK, input_size=K, segment_rows=SEGMENTS)
    g = torch.Generator().manual_seed(4)
    for slot in range(NUM_SLOTS):
        for i, rows in enumerate(SEGMENTS):
            r = RANK - i  # ranks below the stack's: zero-padded
            a, b = torch.randn(r, K, generator=g), torch.randn(rows, r, generator=g)
            stack.set_segment(slot, i, a, b)
    x, y = torch.randn(6, K, generator=g), torch.randn(6, sum(SEGMENTS), generator=g)
    batch.slots = _slots(6)
    out, expected = y.clone(), y.clone()
    stack.add_(x, out)
    stack._add_torch(x, expected, batch.slots)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    assert not torch.equal(out, y)


def test_misuse_is_refused() -> None:
    a, b, seg_rows = _adapters()
    x, y, slots = torch.randn(4, K), torch.randn(4, sum(SEGMENTS)), _slots(4)

    def add(**changed: object) -> None:
        args = {"x": x, "y": y.clone(), "slots": slots, "a": a, "b": b, "rank": RANK,
                "seg_rows": seg_rows} | changed  # fmt: skip
        lora_ops.lora_add(**args)

    bad = [
        {"x": x.double()},
        {"y": y.bfloat16()},  # x float32
        {"x": x.bfloat16(), "y": y.bfloat16(), "a": a.bfloat16()},
        {"slots": slots.long()},
        {"slots": slots[:3]},
        {"slots": torch.tensor([0, 3, -1, 1], dtype=torch.int32)},  # slot 3 of 3
        {"slots": torch.tensor([0, -2, -1, 1], dtype=torch.int32)},
        {"a": a.transpose(1, 2).contiguous().transpose(1, 2)},  # not contiguous
        {"a": a[:, :, :-1].contiguous()},  # K 95
        {"b": b[:2].contiguous()},  # 2 slots of b, 3 of a
        {"b": b[:, 1:].contiguous()},  # N 96 for y's 97
        {"seg_rows": torch.tensor([40, 24, 32], dtype=torch.int32)},  # sums to 96
        {"seg_rows": torch.tensor([40, 57], dtype=torch.int32)},  # 2 segments of a's 3
        {"rank": RANK + 1},
        {"y": y.t().contiguous().t()},  # features not contiguous
        {"x": x[:1].expand(4, K)},  # rows overlap (stride 0)
    ]
    for changed in bad:
        with pytest.raises(ValueError):
            add(**changed)
    add()  # the unchanged arguments are fine

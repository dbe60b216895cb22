"""tern's float32 few-row linear kernel (decode steps) against F.linear, and when it is used."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.kernels import kernel_library, linear_ops
from workers.layers import linear

# Every test runs once per kernel tier this CPU runs (the kernel_tier fixture).
pytestmark = [
    pytest.mark.skipif(kernel_library.load() is None, reason="no C compiler"),
    pytest.mark.usefixtures("kernel_tier"),
]


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 32, 63])
@pytest.mark.parametrize("out_features,in_features", [(13, 20), (96, 64), (61, 33)])
def test_matches_f_linear(rows: int, out_features: int, in_features: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g)
    torch.testing.assert_close(linear_ops.f32_linear(x, w, b), F.linear(x, w, b))
    torch.testing.assert_close(linear_ops.f32_linear(x, w, None), F.linear(x, w))


def test_dense_linear_routes_only_what_the_kernel_handles(monkeypatch) -> None:
    calls = []
    real = linear_ops.f32_linear
    monkeypatch.setattr(linear_ops, "f32_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    w = torch.randn(8, 16)
    for x in (
        torch.randn(3, 16),  # kernel
        torch.randn(64, 16),  # BLAS: many rows
        torch.randn(3, 16).bfloat16(),  # BLAS: not float32
        torch.randn(16, 3).t(),  # BLAS: not contiguous
    ):
        y = linear.dense_linear(x, w.to(x.dtype), None)
        torch.testing.assert_close(y, F.linear(x, w.to(x.dtype)), atol=1e-2, rtol=1e-2)
    assert calls == [torch.Size([3, 16])]
    with pytest.raises(ValueError, match="does not fit"):
        linear_ops.f32_linear(torch.randn(2, 5), w, None)


@pytest.mark.parametrize("out_features,in_features", [(13, 20), (96, 64), (61, 33), (960, 576)])
@pytest.mark.parametrize("rows", [1, 2])
def test_bf16_few_row_kernel_matches_f_linear(
    rows: int, out_features: int, in_features: int
) -> None:
    g = torch.Generator().manual_seed(out_features)
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g).bfloat16()
    if linear_ops.bf16_gemv_max_rows() == 0:  # a tier without AVX512-BF16 says so, and refuses
        with pytest.raises(ValueError, match="not a supported shape"):
            linear_ops.bf16_gemv(x, w, b)
        return
    # float32 accumulation in another order: one bfloat16 rounding step apart at most
    torch.testing.assert_close(
        linear_ops.bf16_gemv(x, w, b), F.linear(x, w, b), atol=0.02, rtol=0.01
    )
    torch.testing.assert_close(
        linear_ops.bf16_gemv(x, w, None), F.linear(x, w), atol=0.02, rtol=0.01
    )
    with pytest.raises(ValueError, match="does not fit"):
        linear_ops.bf16_gemv(x[:, 1:].contiguous(), w, None)
    with pytest.raises(ValueError, match="rows"):
        linear_ops.bf16_gemv(x.repeat(3, 1), w, None)


@pytest.mark.parametrize("rows", [3, 8, 16, 17, 32])  # 17+: a second tile of x's rows
@pytest.mark.parametrize("out_features,in_features", [(48, 64), (960, 576), (576, 1536)])
def test_bf16_amx_kernel_matches_f_linear(rows: int, out_features: int, in_features: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g).bfloat16()
    ref = F.linear(x.float(), w.float(), b.float()).bfloat16()
    if (
        linear_ops.bf16_amx_max_rows() == 0
    ):  # a tier (or CPU, or OS) without AMX says so, and refuses
        assert not linear_ops.amx_fits(rows, out_features, in_features)
        with pytest.raises(ValueError, match="not a supported shape"):
            linear_ops.bf16_amx_linear(x, w, b)
        return
    torch.testing.assert_close(linear_ops.bf16_amx_linear(x, w, b), ref, atol=0.05, rtol=0.01)
    packed = linear.pack_weight(w)  # dense_linear routes these rows here
    torch.testing.assert_close(
        linear.dense_linear(x, w, b, packed), linear_ops.bf16_amx_linear(x, w, b)
    )
    with pytest.raises(ValueError, match="not a supported shape"):
        linear_ops.bf16_amx_linear(x[:, :-16].contiguous(), w[:, :-16].contiguous(), None)  # K % 32


def test_packed_bf16_weights_give_f_linear() -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 24, generator=g).bfloat16()
    packed = linear.pack_weight(w)
    if packed is None:
        pytest.skip("no oneDNN bfloat16 on this CPU")
    assert linear.pack_weight(w.float()) is None and linear.pack_weight(w[:0]) is None
    for rows in (1, 5, 300):
        x = torch.randn(rows, 24, generator=g).bfloat16()
        torch.testing.assert_close(
            linear.dense_linear(x, w, None, packed), F.linear(x, w), atol=0.02, rtol=0.01
        )

"""tern's decode-step kernels for RMSNorm (+ residual add), rotary embedding (whole, partial and
interleaved) and the SiLU / GELU gates against the torch code paths they replace (the modules with the kernels switched off)."""

from __future__ import annotations

import pytest
import torch

from workers.kernels import elementwise_ops, kernel_library
from workers.layers.activation import GeluTanhAndMul, SiluAndMul
from workers.layers.norm import RMSNorm
from workers.layers.rotary import RopeParams, RotaryEmbedding

# Every test runs once per kernel tier this CPU runs (the kernel_tier fixture).
pytestmark = [
    pytest.mark.skipif(kernel_library.load() is None, reason="no C compiler"),
    pytest.mark.usefixtures("kernel_tier"),
]


@pytest.fixture
def torch_only(monkeypatch):
    """Runs a module's pure-torch path: the kernels report themselves unusable."""

    def run(fn):
        with monkeypatch.context() as m:
            m.setattr(elementwise_ops, "usable", lambda *tensors: False)
            return fn()

    return run


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 576), (5, 64), (40, 100), (3, 7)])
def test_rms_norm_with_and_without_residual(
    rows: int, dim: int, dtype: torch.dtype, torch_only
) -> None:
    g = torch.Generator().manual_seed(rows)
    norm = RMSNorm(dim, eps=1e-5).to(dtype)
    norm.weight.data = torch.randn(dim, generator=g).to(dtype)
    x = torch.randn(rows, dim, generator=g).to(dtype)
    res = torch.randn(rows, dim, generator=g).to(dtype)
    torch.testing.assert_close(norm(x), torch_only(lambda: norm(x)))
    out, summed = norm(x, res)
    ref_out, ref_summed = torch_only(lambda: norm(x, res))
    assert torch.equal(summed, ref_summed)
    torch.testing.assert_close(out, ref_out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 20])
@pytest.mark.parametrize("head_dim", [16, 64])  # 64: the bfloat16 kernel's 16-wide loop
@pytest.mark.parametrize(
    "factor,interleaved", [(1.0, False), (0.5, False), (0.5, True)],
    ids=["whole", "partial", "partial_pairs"],
)  # fmt: skip
def test_rotary_in_place_on_views_of_the_qkv_projection(
    tokens: int, head_dim: int, factor: float, interleaved: bool, dtype: torch.dtype, torch_only
) -> None:
    """Whole heads, half of each (Phi-4-mini, Qwen3.5), half in pairs (GLM-4)."""
    heads, kv_heads = 4, 2
    params = RopeParams(theta=10000.0, partial_rotary_factor=factor)
    rope = RotaryEmbedding(head_dim, 64, params, interleaved=interleaved)
    g = torch.Generator().manual_seed(tokens)
    positions = torch.randint(0, 64, (tokens,), generator=g)

    def qkv_views():
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g.manual_seed(7))
        qkv = qkv.to(dtype)
        q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        return q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)

    ref_q, ref_k = torch_only(lambda: rope(positions, *qkv_views()))
    q, k = rope(positions, *qkv_views())
    # bfloat16: the kernel rounds after each product and sum, as the torch path does.
    assert torch.equal(q, ref_q) if dtype == torch.bfloat16 else torch.allclose(q, ref_q)
    assert torch.equal(k, ref_k) if dtype == torch.bfloat16 else torch.allclose(k, ref_k)
    with pytest.raises(ValueError, match="past the cos/sin table"):
        elementwise_ops.rotary_neox_(*qkv_views(), positions + 64, rope.cos_cache, rope.sin_cache)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 48), (4, 48), (5, 51), (64, 48), (100, 1536)])
@pytest.mark.parametrize("act", [SiluAndMul(), GeluTanhAndMul()], ids=["silu", "gelu_tanh"])
def test_gated_activations(rows: int, width: int, dtype: torch.dtype, act, torch_only) -> None:
    x = torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(rows)) * 4
    x = torch.cat((x, torch.tensor([[-200.0, 200.0] * width]))).to(dtype)  # exp's far ends
    torch.testing.assert_close(act(x), torch_only(lambda: act(x)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_gate_on_strided_rows(dtype: torch.dtype) -> None:
    """Qwen3.5's output gate, o *= sigmoid(gate), against torch's two ops; the gate read from
    rows of a wider projection, as the fused layer reads it."""
    g = torch.Generator().manual_seed(3)
    o = (torch.randn(5, 48, generator=g) * 3).to(dtype)
    wide = (torch.randn(5, 80, generator=g) * 6).to(dtype)
    gate = wide[:, 16:64]
    expected = o * torch.sigmoid(gate)
    elementwise_ops.sigmoid_gate_(o, gate)
    if dtype == torch.bfloat16:  # both round the sigmoid, then the product
        torch.testing.assert_close(o, expected, atol=1e-2, rtol=1e-2)
    else:
        torch.testing.assert_close(o, expected)

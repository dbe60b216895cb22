"""The mixture-of-experts layer's three ways through the experts (workers/layers/moe.py): grouped
by expert (prefill, large batches), token by token (a decode of a few tokens), and that in one
native call (float32, SiLU): the native call is bit for bit the token-by-token path on every kernel tier this CPU runs, with and
without expert biases and with a rank holding only some of the experts; both equal the grouped
path."""

from __future__ import annotations

import pytest
import torch

from workers.distributed import ParallelContext
from workers.kernels import kernel_library
from workers.layers.moe import FEW_PAIRS, FusedExperts, MoESpec


def _experts(bias: bool) -> FusedExperts:
    spec = MoESpec(8, 2, 48, norm_topk_prob=True, expert_bias=bias)
    experts = FusedExperts(spec, 64, "silu", ParallelContext.single())
    torch.manual_seed(0)
    for p in experts.parameters():
        p.data.normal_(0, 0.2)
    return experts


@pytest.mark.skipif(kernel_library.load() is None, reason="no C compiler")
@pytest.mark.usefixtures("kernel_tier")
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rank_experts", [(0, 8), (4, 4)])
def test_native_few_pairs_path_is_the_token_by_token_path(bias, rank_experts, monkeypatch):
    experts = _experts(bias)
    experts.first_expert, experts.local_experts = rank_experts
    experts.gate_up_proj.data = experts.gate_up_proj.data[: rank_experts[1]].contiguous()
    experts.down_proj.data = experts.down_proj.data[: rank_experts[1]].contiguous()
    if bias:
        experts.gate_up_proj_bias.data = experts.gate_up_proj_bias.data[: rank_experts[1]].clone()
        experts.down_proj_bias.data = experts.down_proj_bias.data[: rank_experts[1]].clone()
    for tokens in (1, 2, 4):
        x = torch.randn(tokens, 64)
        routes = torch.stack([torch.randperm(8)[:2] for _ in range(tokens)])
        weights = torch.rand(tokens, 2)
        assert routes.numel() <= FEW_PAIRS
        fast = experts(x, routes, weights)
        with monkeypatch.context() as m:
            m.setattr(FusedExperts, "_native_few", lambda self, x, w: False)
            slow = experts(x, routes, weights)
            m.setattr("workers.layers.moe.FEW_PAIRS", 0)
            grouped = experts(x, routes, weights)
        assert torch.equal(fast, slow)
        torch.testing.assert_close(grouped, slow, atol=1e-6, rtol=0)


def test_transposed_checkpoints_load_as_a_live_models_tensors() -> None:
    """Qwen3-VL-MoE's layout: the released checkpoint's stacked, transposed experts ((E, H, 2I),
    (E, I, H)) and a live Hugging Face model's ((E, 2I, H), (E, H, I)) load the same weights."""
    torch.manual_seed(0)
    gate_up, down = torch.randn(8, 96, 64), torch.randn(8, 64, 48)  # Hugging Face's orientation
    spec = MoESpec(8, 2, 48, norm_topk_prob=True, layout="transposed")
    for given in ((gate_up, down), (gate_up.transpose(1, 2), down.transpose(1, 2))):
        experts = FusedExperts(spec, 64, "silu", ParallelContext.single())
        experts.gate_up_proj.weight_loader(experts.gate_up_proj, given[0].contiguous())
        experts.down_proj.weight_loader(experts.down_proj, given[1].contiguous())
        assert torch.equal(experts.gate_up_proj, gate_up) and torch.equal(experts.down_proj, down)
    hf_layout = FusedExperts(MoESpec(8, 2, 48, norm_topk_prob=True), 64, "silu",
                             ParallelContext.single())  # fmt: skip
    with pytest.raises(ValueError):  # other families take Hugging Face's orientation only
        hf_layout.down_proj.weight_loader(hf_layout.down_proj, down.transpose(1, 2).contiguous())

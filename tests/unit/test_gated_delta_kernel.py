"""The native Gated DeltaNet decode step (csrc/gated_delta_net.c) against the layer's torch path, on
every kernel tier this CPU runs: outputs and both states after several steps, float32 and
bfloat16, with sequences starting fresh (one-token prompts) beside ones that continue."""

from __future__ import annotations

import pytest
import torch

from workers.distributed import ParallelContext
from workers.kernels import gated_delta_ops, kernel_library
from workers.kernels.kernel_library import runnable_tiers, use_tier
from workers.layers.attention import build_attention_metadata
from workers.layers.gated_delta_net import GatedDeltaNet

TIERS = [t.name for t in runnable_tiers()] if kernel_library.load() is not None else []
SLOTS = 6


def _layer(dtype: torch.dtype) -> GatedDeltaNet:
    torch.manual_seed(0)
    with torch.device("cpu"):
        layer = GatedDeltaNet(64, 2, 4, 16, 24, 4, 1e-6, ParallelContext.single())
    for p in layer.parameters():
        p.data = torch.randn_like(p) * 0.3
    layer.A_log.data = torch.randn(layer.v_heads) * 0.5
    layer.to(dtype)
    c = sum(layer.local_sizes)
    layer.conv_states = torch.randn(SLOTS, c, 3).to(dtype)
    layer.recurrent_states = torch.randn(SLOTS, 4, 16, 24) * 0.1
    return layer


def _steps(layer: GatedDeltaNet, use_kernel: bool, dtype: torch.dtype) -> list[torch.Tensor]:
    layer._uses_kernel = lambda mixed: use_kernel  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(1)
    outs = []
    starts = [5, 0, 9, 17]  # the second sequence is a one-token prompt: fresh states
    slots = torch.tensor([4, 0, 2, 5])
    for step in range(3):
        x = torch.randn(4, 64, generator=g).to(dtype)
        pos = [s + step if s or step else 0 for s in starts]
        meta = build_attention_metadata(pos, [1] * 4, [[0]] * 4, 64, torch.device("cpu"))
        meta.state_slots = slots
        outs.append(layer(x, meta).float())
    return [*outs, layer.conv_states.float().clone(), layer.recurrent_states.clone()]


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_torch_path(tier: str, dtype: torch.dtype) -> None:
    expected = _steps(_layer(dtype), False, dtype)
    with use_tier(tier):
        got = _steps(_layer(dtype), True, dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@pytest.mark.skipif(not TIERS, reason="no CPU kernels")
def test_a_slot_outside_the_pool_is_refused() -> None:
    layer = _layer(torch.float32)
    mixed = torch.randn(1, sum(layer.local_sizes))
    with pytest.raises(ValueError, match="outside the pools"):
        gated_delta_ops.gated_delta_decode(
            mixed, torch.randn(1, 96), torch.randn(1, 4), torch.randn(1, 4), layer.A_log,
            layer.dt_bias, layer.conv1d.weight, layer.conv_states, layer.recurrent_states,
            torch.tensor([SLOTS]), torch.zeros(1, dtype=torch.uint8), layer.norm.weight, 1e-6, (2, 4, 16, 24),
        )  # fmt: skip

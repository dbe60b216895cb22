"""Gated activation of Llama-style MLPs: silu(gate) * up over the fused gate_up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.layers import native


class SiluAndMul(nn.Module):
    """tern's kernel at every row count (one pass instead of torch's three ops, and the same
    arithmetic as the fused decode layer's), torch where the kernels are off."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, 2I) -> (T, I)
        if x.dim() == 2 and x.is_contiguous() and native.usable(x):
            return native.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

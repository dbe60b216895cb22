"""Gated activations of Llama-style MLPs over the fused gate_up projection: act(gate) * up."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.kernels import elementwise_ops


class SiluAndMul(nn.Module):
    """tern's kernel at every row count (one pass instead of torch's three ops, and the same
    arithmetic as the fused decode layer's), torch where the kernels are off."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, 2I) -> (T, I)
        if x.dim() == 2 and x.is_contiguous() and elementwise_ops.usable(x):
            return elementwise_ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """gelu(gate, tanh approximation) * up: Gemma's `gelu_pytorch_tanh`; tern's kernel (the fused
    decode layer's arithmetic) where it runs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, 2I) -> (T, I)
        if x.dim() == 2 and x.is_contiguous() and elementwise_ops.usable(x):
            return elementwise_ops.gelu_tanh_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


# config.json's hidden_act / hidden_activation -> the gated activation.
GATED_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "silu": SiluAndMul,
    "swish": SiluAndMul,
    "gelu_pytorch_tanh": GeluTanhAndMul,
    "gelu_tanh": GeluTanhAndMul,
}

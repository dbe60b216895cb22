"""RMSNorm as Hugging Face Llama computes it, with the residual add optionally fused in.

The normalisation runs in float32 and the result is cast back before the weight multiply, exactly as
`LlamaRMSNorm`, so fp32 runs match Hugging Face and bf16 runs round the same way. Float32 rows on the CPU go to
tern's kernel (one call for the add and the norm, same order of operations).
"""

from __future__ import annotations

import torch
from torch import nn

from workers.layers import native
from workers.layers.linear import default_weight_loader


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or with a residual: (norm(x + residual), x + residual)."""
        if native.usable(x, residual) and x.dim() == 2 and _contiguous(x, residual):
            out, summed = native.rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, summed)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


def _contiguous(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or t.is_contiguous() for t in tensors)

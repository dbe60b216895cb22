"""Binding of the Gated DeltaNet decode step (csrc/gated_delta_net.c)."""

from __future__ import annotations

import torch

from workers.kernels.kernel_library import load
from workers.kernels.tensor_args import check, float_dtype, ptr


def gated_delta_decode(
    mixed: torch.Tensor,
    z: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_states: torch.Tensor,
    recurrent: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    heads: tuple[int, int, int, int],
) -> torch.Tensor:
    """A Gated DeltaNet decode step of G sequences (see csrc/gated_delta_net.c), updating their
    conv and recurrent states in place -> the gated norm's output (G, Hv * dv) for out_proj.

    mixed (G, C), z (G, Hv * dv), b and a (G, Hv): rows of the input projections (any row
    stride), float32 or bfloat16, as a_log and dt_bias (Hv,), conv_weight (C, 1, K), conv_states
    (slots, C, K - 1) and norm_weight (dv,); recurrent (slots, Hv, dk, dv) float32; slots (G,)
    int64; fresh (G,) uint8, 1 where a sequence's states start from zeros. heads: (Hk, Hv, dk,
    dv) on this rank."""
    lib = load()
    assert lib is not None, "the CPU kernels are not available"
    dtype = float_dtype(mixed)
    hk, hv, dk, dv = heads
    num, c = mixed.shape
    for t, name in ((mixed, "mixed"), (z, "z"), (b, "b"), (a, "a")):
        if t.dtype != dtype or not t.is_cpu or t.dim() != 2 or t.stride(1) != 1 or t.size(0) != num:
            raise ValueError(f"{name} must be (G, n) CPU {dtype} rows with contiguous features")
    for t, name in ((conv_weight, "conv_weight"), (conv_states, "conv_states"),
                    (norm_weight, "norm_weight"), (a_log, "A_log"), (dt_bias, "dt_bias")):  # fmt: skip
        check(t, dtype, name)
    check(recurrent, torch.float32, "recurrent")
    check(slots, torch.int64, "slots")
    check(fresh, torch.uint8, "fresh")
    kernel = conv_weight.size(-1)
    if (
        c != 2 * hk * dk + hv * dv
        or z.size(1) != hv * dv
        or b.size(1) != hv
        or a.size(1) != hv
        or a_log.numel() != hv
        or dt_bias.numel() != hv
        or conv_weight.shape != (c, 1, kernel)
        or conv_states.shape[1:] != (c, kernel - 1)
        or recurrent.shape[1:] != (hv, dk, dv)
        or recurrent.size(0) != conv_states.size(0)
        or slots.numel() != num
        or fresh.numel() != num
        or norm_weight.numel() != dv
    ):
        raise ValueError("gated delta decode: the shapes do not agree")
    scratch = torch.empty(num, c, dtype=torch.float32)
    out = torch.empty(num, hv * dv, dtype=dtype)
    rc = lib.tern_gated_delta_decode(
        ptr(mixed), mixed.stride(0), ptr(z), z.stride(0), ptr(b), b.stride(0), ptr(a),
        a.stride(0), ptr(a_log), ptr(dt_bias), ptr(conv_weight), ptr(conv_states),
        ptr(recurrent), ptr(slots), ptr(fresh), recurrent.size(0), ptr(norm_weight), eps,
        ptr(scratch), ptr(out), num, hk, hv, dk, dv, kernel, int(dtype == torch.bfloat16),
    )  # fmt: skip
    if rc == -2:
        raise ValueError("gated delta decode: a state slot is outside the pools")
    return out

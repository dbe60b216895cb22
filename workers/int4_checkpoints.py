"""GPTQ and AWQ checkpoints kept 4-bit: their packed tensors read as tern's INT4_ZP blocks.

A layer of such a checkpoint is stored as `qweight` (int4 values packed eight to an int32),
`qzeros` (the groups' zero points, packed the same way), `scales` (one per group of `group_size`
input features and output feature) and, for GPTQ, `g_idx` (each input feature's group). Each
value is scale * (q - zero). The layouts (config.json's `quantization_config`):
- GPTQ: qweight (K / 8, N), packed along K, value j of an int32 in bits 4j..4j+3; qzeros
  (K / G, N / 8) packed along N; `checkpoint_format` "gptq" (v1, the default) stores zero - 1.
  `desc_act` (act-order) checkpoints number their groups in another order than the features':
  those layers are dequantized to float at load (one log line), for now.
- AWQ (`version` "gemm"): qweight (K, N / 8) and qzeros (K / G, N / 8) packed along N, the eight
  values of an int32 in AWQ's interleaved order (column 8c + AWQ_ORDER[j] in bits 4j..4j+3).
Each layer becomes INT4_ZP blocks (workers/layers/int4_blocks.py: a group of 128 is four blocks
with its scale and zero) that the block kernels multiply as stored; the rest of the checkpoint
(embeddings, norms, an unquantized LM head) loads as it is.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from workers.layers import int4_blocks
from workers.layers.gguf_blocks import GGUFBlocks

logger = logging.getLogger(__name__)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
PACKED = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class Int4Format:
    method: str  # "gptq" | "awq"
    group_size: int  # -1: one group over all input features
    act_order: bool
    zero_offset: int  # what the stored zero points lack (GPTQ v1: 1)


def int4_format(model_dir: str | Path) -> Int4Format | None:
    """The checkpoint's GPTQ / AWQ layout, None for an unquantized one; a ValueError naming any
    other quantization (tern would misread it)."""
    config_file = Path(model_dir) / "config.json"
    if not config_file.is_file():
        return None
    qc = json.loads(config_file.read_text()).get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method not in ("gptq", "awq"):
        raise ValueError(f"{model_dir}: quantization {method!r} is not supported (GPTQ, AWQ)")
    if qc.get("bits", 4) != 4:
        raise ValueError(f"{model_dir}: {method} with {qc.get('bits')} bits (tern takes 4)")
    if method == "awq" and qc.get("version", "gemm").lower() != "gemm":
        raise ValueError(f"{model_dir}: AWQ version {qc.get('version')!r} (tern reads 'gemm')")
    if method == "awq" and not qc.get("zero_point", True):
        raise ValueError(f"{model_dir}: AWQ without zero points is not supported")
    if method == "gptq" and qc.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
        raise ValueError(f"{model_dir}: GPTQ format {qc.get('checkpoint_format')!r}")
    group = int(qc.get("group_size", 128) if method == "gptq" else qc.get("q_group_size",
                qc.get("group_size", 128)))  # fmt: skip
    v1 = method == "gptq" and qc.get("checkpoint_format", "gptq") == "gptq"
    return Int4Format(method, group, bool(qc.get("desc_act", False)), 1 if v1 else 0)


def _unpack_rows(packed: np.ndarray, order: tuple[int, ...] = tuple(range(8))) -> np.ndarray:
    """(R, C) int32 -> (R, 8C) nibbles, int32 c's value j at column 8c + order[j]."""
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    values = (packed.astype(np.uint32)[:, :, None] >> shifts) & 0xF  # (R, C, 8) by bit position
    out = np.empty_like(values)
    out[:, :, list(order)] = values
    return out.reshape(packed.shape[0], -1).astype(np.uint8)


def unpack(
    fmt: Int4Format, tensors: dict[str, torch.Tensor]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(q (N, K), scale (N, G) float32, zero (N, G), g_idx (K,)) of one layer's packed tensors."""
    qweight = tensors["qweight"].numpy().view(np.int32)
    qzeros = tensors["qzeros"].numpy().view(np.int32)
    scales = tensors["scales"].float().numpy()
    if fmt.method == "gptq":
        q = _unpack_rows(qweight.T).T  # packed along K: unpack qweight.T's rows
        zero = _unpack_rows(qzeros)
    else:
        q = _unpack_rows(qweight, AWQ_ORDER)
        zero = _unpack_rows(qzeros, AWQ_ORDER)
    k, n = q.shape
    zero = zero.astype(np.int32) + fmt.zero_offset
    if zero.max(initial=0) > 15:
        raise ValueError(f"zero points above 15 in a 4-bit {fmt.method} layer")
    if scales.shape != zero.shape or scales.shape[1] != n:
        raise ValueError(f"{fmt.method}: scales {scales.shape} / zeros {zero.shape} for {k}x{n}")
    group = k if fmt.group_size == -1 else fmt.group_size
    g_idx = np.arange(k) // group
    if "g_idx" in tensors:
        g_idx = tensors["g_idx"].numpy().astype(np.int64)
    return q.T.copy(), scales.T.copy(), zero.T.astype(np.uint8), g_idx


def to_weight(fmt: Int4Format, tensors: dict[str, torch.Tensor]) -> torch.Tensor | GGUFBlocks:
    """One layer as INT4_ZP blocks, or (groups not in feature order: act-order) its float32
    weight scale[g] * (q - zero[g])."""
    q, scale, zero, g_idx = unpack(fmt, tensors)
    k = q.shape[1]
    group = k // scale.shape[1]
    if np.array_equal(g_idx, np.arange(k) // group) and group % int4_blocks.BLOCK == 0:
        blocks = int4_blocks.from_groups(q, scale, zero)
        return GGUFBlocks(torch.from_numpy(blocks), "INT4_ZP", k)
    values = scale[:, g_idx] * (q.astype(np.float32) - zero[:, g_idx].astype(np.float32))
    return torch.from_numpy(values.astype(np.float32))


def quantized_layers(names: Iterable[str]) -> list[str]:
    """The layers (name prefixes) a checkpoint's tensor names store packed."""
    return sorted({n.rpartition(".")[0] for n in names if n.endswith(".qweight")})


def iter_int4(
    weights: Iterable[tuple[str, object]], fmt: Int4Format
) -> Iterator[tuple[str, object]]:
    """The checkpoint's tensors with each packed layer's as one `<layer>.weight` (to_weight)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    needed = {"qweight", "qzeros", "scales"} | ({"g_idx"} if fmt.act_order else set())
    dequantized = 0
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if leaf not in PACKED:
            yield name, tensor
            continue
        if leaf == "g_idx" and not fmt.act_order:
            continue  # groups in feature order: the index says nothing more
        parts = pending.setdefault(prefix, {})
        parts[leaf] = tensor.materialize() if hasattr(tensor, "materialize") else tensor
        if needed <= parts.keys():
            weight = to_weight(fmt, pending.pop(prefix))
            dequantized += isinstance(weight, torch.Tensor)
            yield f"{prefix}.weight", weight
    if pending:
        missing = {p: sorted(needed - parts.keys()) for p, parts in pending.items()}
        raise ValueError(f"incomplete {fmt.method} layers: {dict(list(missing.items())[:4])}")
    if dequantized:
        logger.info("%d act-order %s layers dequantized to float at load", dequantized, fmt.method)

"""Hugging Face quantized checkpoints: GPTQ, AWQ and compressed-tensors W4A16 kept 4-bit (their
packed tensors read as tern's INT4_ZP blocks), compressed-tensors W8A8 / W8A16 int8 served as
int8 layers, FP8 block-quantized checkpoints dequantized at load.

A layer of such a checkpoint is stored as `qweight` (int4 values packed eight to an int32),
`qzeros` (the groups' zero points, packed the same way), `scales` (one per group of `group_size`
input features and output feature) and, for GPTQ, `g_idx` (each input feature's group). Each
value is scale * (q - zero). The layouts (config.json's `quantization_config`):
- GPTQ: qweight (K / 8, N), packed along K, value j of an int32 in bits 4j..4j+3; qzeros
  (K / G, N / 8) packed along N; `checkpoint_format` "gptq" (v1, the default) stores zero - 1.
  `desc_act` (act-order) checkpoints number their groups in another order than the features':
  a layer's features are sorted by group (its groups then whole blocks) and the layer permutes
  its input the same way before the product; where it cannot (a row-parallel layer at --tp > 1,
  whose input features are split across ranks, or fused projections grouped differently) the
  layer is dequantized to float at load (one log line).
- AWQ (`version` "gemm"): qweight (K, N / 8) and qzeros (K / G, N / 8) packed along N, the eight
  values of an int32 in AWQ's interleaved order (column 8c + AWQ_ORDER[j] in bits 4j..4j+3).
- compressed-tensors "pack-quantized" (llm-compressor's W4A16): weight_packed (N, K / 8) packed
  along K, each value stored as q + 8 (symmetric int4), weight_scale (N, K / G); every value
  scale * (stored - 8). Asymmetric int4 is refused.
Each layer becomes INT4_ZP blocks (workers/quant/int4_blocks.py: a group of 128 is four blocks
with its scale and zero) that the block kernels multiply as stored; the rest of the checkpoint
(embeddings, norms, an unquantized LM head) loads as it is.
- compressed-tensors "int-quantized" int8 weights (W8A8, W8A16: weight (N, K) int8, weight_scale
  per output channel): each weight arrives as its float values q * scale and the layers store int8
  with per-row scales (as --quantization int8): llm-compressor's scale is the row's largest |w| /
  127, so the stored int8 are the checkpoint's and the scales equal within a float32 rounding. The
  activations stay float (weight-only: the reference's dequantized weights, not its int8 inputs).
- FP8 (`quant_method` "fp8", DeepSeek / Qwen3 style): weight float8_e4m3fn (N, K) and
  weight_scale_inv per 128 x 128 block; dequantized to float at load (one log line), then kept as
  --dtype / --quantization ask (bfloat16, or int8 with --quantization int8).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from workers.quant import int4_blocks
from workers.quant.gguf_blocks import GGUFBlocks

logger = logging.getLogger(__name__)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Each method's tensors of one layer: (what must arrive, what is read if it does).
LAYER_TENSORS = {
    "gptq": ({"qweight", "qzeros", "scales"}, set()),  # + g_idx with act-order
    "awq": ({"qweight", "qzeros", "scales"}, set()),
    "ct_int4": ({"weight_packed", "weight_scale"}, {"weight_shape"}),
    "ct_int8": ({"weight", "weight_scale"}, set()),
    "fp8": ({"weight", "weight_scale_inv"}, set()),
}
# Activation quantization parameters: tern keeps activations float (weight-only), so unread.
ACTIVATION_TENSORS = {"input_scale", "input_zero_point", "output_scale"}
# The tensor whose presence marks a layer as quantized.
MARKER = {"gptq": "qweight", "awq": "qweight", "ct_int4": "weight_packed",
          "ct_int8": "weight_scale", "fp8": "weight_scale_inv"}  # fmt: skip


@dataclass(frozen=True)
class Quantized:
    """A checkpoint's quantization (config.json's `quantization_config`), as tern reads it."""

    method: str  # a key of LAYER_TENSORS
    group_size: int = 128  # int4 methods; -1: one group over all input features
    act_order: bool = False  # GPTQ desc_act
    zero_offset: int = 0  # what stored zero points lack (GPTQ v1: 1)
    block: tuple[int, int] = (128, 128)  # fp8's weight blocks

    @property
    def keeps_int4(self) -> bool:
        """Its layers become INT4_ZP blocks (act-order GPTQ: those whose input can be permuted,
        weight_loader.act_order_layers)."""
        return self.method in ("gptq", "awq", "ct_int4")

    @property
    def int8_layers(self) -> bool:
        return self.method == "ct_int8"


def _compressed_tensors(model_dir: str | Path, qc: dict) -> Quantized:
    schemes = {
        json.dumps(g.get("weights"), sort_keys=True) for g in qc.get("config_groups", {}).values()
    }
    if len(schemes) != 1:
        raise ValueError(f"{model_dir}: compressed-tensors with {len(schemes)} weight schemes "
                         "(tern reads one)")  # fmt: skip
    w = json.loads(schemes.pop()) or {}
    fmt, bits, kind = qc.get("format"), w.get("num_bits"), w.get("type", "int")
    if kind != "int" or not w.get("symmetric", True):
        raise ValueError(f"{model_dir}: compressed-tensors {kind} weights, symmetric "
                         f"{w.get('symmetric')} (tern reads symmetric int4 and int8)")  # fmt: skip
    if fmt == "pack-quantized" and bits == 4:
        strategy = w.get("strategy", "group")
        group = int(w.get("group_size") or -1) if strategy == "group" else -1
        return Quantized("ct_int4", group)
    if fmt in ("int-quantized", "naive-quantized") and bits == 8:
        if w.get("strategy", "channel") != "channel":
            raise ValueError(f"{model_dir}: int8 weights with a {w.get('strategy')} scale "
                             "(tern reads per-channel)")  # fmt: skip
        return Quantized("ct_int8")
    raise ValueError(f"{model_dir}: compressed-tensors format {fmt!r} with {bits}-bit weights "
                     "is not supported (pack-quantized int4, int-quantized int8)")  # fmt: skip


def checkpoint_quantization(model_dir: str | Path) -> Quantized | None:
    """The checkpoint's quantization, None for an unquantized one; a ValueError naming any other
    (tern would misread it)."""
    config_file = Path(model_dir) / "config.json"
    if not config_file.is_file():
        return None
    qc = json.loads(config_file.read_text()).get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method == "mxfp4":  # gpt-oss's experts: weight_loader.dequantize_mxfp4 reads them
        return None
    if method == "compressed-tensors":
        return _compressed_tensors(model_dir, qc)
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3" or qc.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(f"{model_dir}: fp8 {qc.get('fmt')} with {qc.get('activation_scheme')} "
                             "activations (tern reads e4m3, dynamic)")  # fmt: skip
        block = qc.get("weight_block_size") or [128, 128]
        return Quantized("fp8", block=(int(block[0]), int(block[1])))
    if method not in ("gptq", "awq"):
        raise ValueError(f"{model_dir}: quantization {method!r} is not supported "
                         "(GPTQ, AWQ, compressed-tensors, fp8)")  # fmt: skip
    if qc.get("bits", 4) != 4:
        raise ValueError(f"{model_dir}: {method} with {qc.get('bits')} bits (tern takes 4)")
    if method == "awq" and qc.get("version", "gemm").lower() != "gemm":
        raise ValueError(f"{model_dir}: AWQ version {qc.get('version')!r} (tern reads 'gemm')")
    if method == "awq" and not qc.get("zero_point", True):
        raise ValueError(f"{model_dir}: AWQ without zero points is not supported")
    if method == "gptq" and qc.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
        raise ValueError(f"{model_dir}: GPTQ format {qc.get('checkpoint_format')!r}")
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    v1 = method == "gptq" and qc.get("checkpoint_format", "gptq") == "gptq"
    act_order = method == "gptq" and bool(qc.get("desc_act", False))
    return Quantized(method, group, act_order, 1 if v1 else 0)


def _unpack_rows(packed: np.ndarray, order: tuple[int, ...] = tuple(range(8))) -> np.ndarray:
    """(R, C) int32 -> (R, 8C) nibbles, int32 c's value j at column 8c + order[j]."""
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    values = (packed.astype(np.uint32)[:, :, None] >> shifts) & 0xF  # (R, C, 8) by bit position
    out = np.empty_like(values)
    out[:, :, list(order)] = values
    return out.reshape(packed.shape[0], -1).astype(np.uint8)


def unpack_int4(
    q: Quantized, tensors: dict[str, torch.Tensor]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(values (N, K), scale (N, G) float32, zero (N, G), g_idx (K,)) of one int4 layer."""
    if q.method == "ct_int4":
        values = _unpack_rows(tensors["weight_packed"].numpy().view(np.int32))
        if "weight_shape" in tensors:  # K padded to whole int32s
            values = values[:, : int(tensors["weight_shape"].flatten()[1])]
        scale = tensors["weight_scale"].float().numpy()
        zero = np.full(scale.shape, 8, dtype=np.int32)  # symmetric int4 stored as q + 8
    else:
        scales = tensors["scales"].float().numpy()
        qweight = tensors["qweight"].numpy().view(np.int32)
        qzeros = tensors["qzeros"].numpy().view(np.int32)
        if q.method == "gptq":
            values = _unpack_rows(qweight.T)  # packed along K: qweight.T's rows are N
            zero = _unpack_rows(qzeros).T
        else:
            values = _unpack_rows(qweight, AWQ_ORDER).T
            zero = _unpack_rows(qzeros, AWQ_ORDER).T
        scale, zero = scales.T, zero.astype(np.int32) + q.zero_offset
    n, k = values.shape
    if zero.max(initial=0) > 15:
        raise ValueError(f"zero points above 15 in a 4-bit {q.method} layer")
    if scale.shape != zero.shape or scale.shape[0] != n:
        raise ValueError(f"{q.method}: scales {scale.shape} / zeros {zero.shape} for {n}x{k}")
    group = k if q.group_size == -1 else q.group_size
    g_idx = np.arange(k) // group
    if "g_idx" in tensors:
        g_idx = tensors["g_idx"].numpy().astype(np.int64)
    return values, np.ascontiguousarray(scale), np.ascontiguousarray(zero, np.uint8), g_idx


def permutable_groups(g_idx: np.ndarray) -> bool:
    """Whether sorting the features by group (GPTQ act-order) gives groups of equal size in
    whole INT4_ZP blocks."""
    k, groups = len(g_idx), int(g_idx.max(initial=0)) + 1
    if k % groups or (k // groups) % int4_blocks.BLOCK:
        return False
    return bool(np.array_equal(np.sort(g_idx), np.arange(k) // (k // groups)))


def _int4_weight(
    q: Quantized, tensors: dict[str, torch.Tensor], permute: bool
) -> torch.Tensor | GGUFBlocks:
    """One int4 layer as INT4_ZP blocks; with groups not in feature order (act-order), blocks of
    its features sorted by group when `permute` (the layer permutes its input alike), else its
    float32 weight scale[g] * (q - zero[g])."""
    values, scale, zero, g_idx = unpack_int4(q, tensors)
    k = values.shape[1]
    group = k // scale.shape[1]
    if np.array_equal(g_idx, np.arange(k) // group) and group % int4_blocks.BLOCK == 0:
        blocks = int4_blocks.from_groups(values, scale, zero)
        return GGUFBlocks(torch.from_numpy(blocks), "INT4_ZP", k)
    if permute and permutable_groups(g_idx):
        perm = np.argsort(g_idx, kind="stable")
        blocks = int4_blocks.from_groups(np.ascontiguousarray(values[:, perm]), scale, zero)
        return GGUFBlocks(torch.from_numpy(blocks), "INT4_ZP", k, torch.from_numpy(perm))
    floats = scale[:, g_idx] * (values.astype(np.float32) - zero[:, g_idx].astype(np.float32))
    return torch.from_numpy(floats.astype(np.float32))


def _fp8_weight(q: Quantized, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    w, scale = tensors["weight"].float(), tensors["weight_scale_inv"].float()
    bn, bk = q.block
    full = scale.repeat_interleave(bn, 0)[: w.size(0)].repeat_interleave(bk, 1)[:, : w.size(1)]
    return w * full


def _layer_weight(
    q: Quantized, tensors: dict[str, torch.Tensor], permute: bool = False
) -> torch.Tensor | GGUFBlocks:
    if q.method == "fp8":
        return _fp8_weight(q, tensors)
    if q.method == "ct_int8":  # per-channel: int8 values times their row's scale
        return tensors["weight"].float() * tensors["weight_scale"].float().reshape(-1, 1)
    return _int4_weight(q, tensors, permute)


def quantized_layers(q: Quantized, names: Iterable[str]) -> list[str]:
    """The layers (name prefixes) the checkpoint stores quantized."""
    marker = "." + MARKER[q.method]
    return sorted({n.removesuffix(marker) for n in names if n.endswith(marker)})


def iter_quantized(
    weights: Iterable[tuple[str, object]],
    q: Quantized,
    layers: Iterable[str],
    permuted: Iterable[str] = (),
) -> Iterator[tuple[str, object]]:
    """The checkpoint's tensors with each quantized layer's (`layers`) as one `<layer>.weight`:
    INT4_ZP blocks (GGUFBlocks; act-order layers in `permuted` with their features sorted by
    group) or float values."""
    permuted = set(permuted)
    needed, optional = LAYER_TENSORS[q.method]
    if q.act_order:
        needed = needed | {"g_idx"}
    layers = set(layers)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    as_float = 0
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if prefix in layers and (leaf in ACTIVATION_TENSORS or leaf == "g_idx" and not q.act_order):
            continue  # act-order off: the groups are in feature order, the index says no more
        if prefix not in layers or leaf not in needed | optional:
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[leaf] = tensor.materialize() if hasattr(tensor, "materialize") else tensor
        if needed | optional <= parts.keys():
            weight = _layer_weight(q, pending.pop(prefix), prefix in permuted)
            as_float += isinstance(weight, torch.Tensor)
            yield f"{prefix}.weight", weight
    for prefix, parts in list(pending.items()):  # optional tensors that never came
        if not needed <= parts.keys():
            raise ValueError(
                f"incomplete {q.method} layer {prefix}: {sorted(needed - parts.keys())}"
            )
        weight = _layer_weight(q, parts, prefix in permuted)
        as_float += isinstance(weight, torch.Tensor)
        yield f"{prefix}.weight", weight
    if as_float and q.method != "ct_int8":
        logger.info("%d %s layers dequantized to float at load%s", as_float, q.method,
                    " (act-order)" if q.act_order else "")  # fmt: skip

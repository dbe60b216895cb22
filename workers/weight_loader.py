"""Loads Hugging Face checkpoint tensors into a tern model through each parameter's weight_loader.

`load_weights(model, weights)` is the one loop, used at start-up and for weight updates: it maps
Hugging Face names onto tern's fused parameters (q/k/v_proj -> qkv_proj shards "q"/"k"/"v",
gate/up_proj -> gate_up_proj shards 0/1; checkpoints that store them fused are split first) and lets
the parameter copy in its tensor-parallel shard. Mixture-of-experts layers (workers/layers/moe.py)
hold their experts stacked under transformers 5's names (`mlp.experts.gate_up_proj`, `.down_proj`),
which a live Hugging Face model's tensors carry; released checkpoints store each expert apart
(`mlp.experts.N.gate_proj.weight`; Mixtral's `block_sparse_moe.experts.N.w1.weight`), loaded as
shard ("gate" | "up" | "down", N) of the stacked parameter. gpt-oss's released experts are MXFP4
(`_blocks` and `_scales` tensors): dequantized as they arrive.
`load_checkpoint` feeds it every tensor of the *.safetensors files as a `LazyWeight` (a safetensors
slice: the parameter's loader narrows it to its shard and only that shard is read), and then checks
that nothing is missing. Under pipeline parallelism the model's `local_weight_name` drops the tensors
of other stages before anything is read. Unknown names, missing weights and shape mismatches raise
ValueError.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from torch import nn

from workers.quant.gguf_blocks import block_values
from workers.quant.gguf_weights import GGUFCheckpoint, gguf_file_of, iter_gguf
from workers.quant.quantized_checkpoints import (
    Quantized,
    checkpoint_quantization,
    iter_quantized,
    permutable_groups,
    quantized_layers,
)

logger = logging.getLogger(__name__)

# Hugging Face projection name -> (tern's fused parameter, shard id).
_PACKED: dict[str, tuple[str, object]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# Fused projections some checkpoints store (split by `_unfused`).
_FUSED_IN_CHECKPOINT = ("qkv_proj", "gate_up_proj")
# The LM head's names (a multimodal checkpoint's too): skipped when the embedding is tied to it.
_LM_HEADS = ("lm_head.", "language_model.lm_head.")
# Checkpoint tensors that carry no parameter (RoPE tables some exporters save).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# One expert's projection in a checkpoint -> (the stacked parameter, its shard kind); Mixtral's
# w1 / w3 / w2 are gate / up / down.
_EXPERT_PROJ: dict[str, tuple[str, str]] = {
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
    "down_proj": ("down_proj", "down"),
    "w1": ("gate_up_proj", "gate"),
    "w3": ("gate_up_proj", "up"),
    "w2": ("down_proj", "down"),
}
_STACKED_EXPERTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def _safetensors_files(model_dir: str | Path) -> Iterator[Any]:
    """Each of the checkpoint's *.safetensors files, open (a safe_open handle)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt")
        except Exception as e:  # noqa: BLE001 - SafetensorError (truncated, corrupt) or OSError
            raise ValueError(f"cannot read {file} (truncated or not safetensors?): {e}") from e
        with handle as f:
            yield f


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint's *.safetensors files, one at a time."""
    for f in _safetensors_files(model_dir):
        for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
            yield name, f.get_tensor(name)


class LazyWeight:
    """A checkpoint tensor not read yet: `narrow` reads one slice, `materialize` the whole tensor.

    Offers the part of the torch.Tensor API weight loaders use (shape, size, dim, narrow).
    """

    def __init__(self, tensor_slice: Any) -> None:  # a safetensors PySafeSlice
        self._slice = tensor_slice
        self.shape = torch.Size(tensor_slice.get_shape())

    def size(self, dim: int | None = None) -> int | torch.Size:
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        dim = dim % self.dim()
        if not 0 <= start <= start + length <= self.shape[dim]:
            raise ValueError(f"slice [{start}, {start + length}) outside dim {dim} of {self.shape}")
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._slice[index]

    def materialize(self) -> torch.Tensor:
        return self._slice[:]


def iter_safetensors_lazy(model_dir: str | Path) -> Iterator[tuple[str, LazyWeight]]:
    """Every tensor of the checkpoint, unread: each loader reads only the slice it keeps."""
    for f in _safetensors_files(model_dir):
        for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
            yield name, LazyWeight(f.get_slice(name))


def _is_tied(model: nn.Module) -> bool:
    args = getattr(model, "args", None)
    return bool(getattr(args, "tie_word_embeddings", False))


def _canonical(name: str) -> str:
    """Mixtral's names as the other families': its MLP `mlp`, its experts' projections
    gate_proj / up_proj / down_proj; gpt-oss's router as the others' `gate`, its attention sinks
    where tern's attention holds them."""
    name = name.replace(".block_sparse_moe.", ".mlp.").replace(".mlp.router.", ".mlp.gate.")
    if name.endswith(".self_attn.sinks"):
        return name.removesuffix("sinks") + "attn.sinks"
    parts = name.split(".")
    if len(parts) >= 4 and parts[-4] == "experts" and parts[-2] in ("w1", "w2", "w3"):
        parts[-2] = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}[parts[-2]]
        return ".".join(parts)
    return name


def _expert_of(parts: list[str]) -> bool:
    return len(parts) >= 4 and parts[-4] == "experts" and parts[-3].isdigit()


# Modules that keep Hugging Face's layout whole (the image encoder, workers/vision/): their
# q/k/v and MLP projections are not fused, so their names map to themselves.
_VERBATIM_PREFIXES = ("vision.",)


def _map_name(name: str) -> tuple[str, object]:
    """Hugging Face name -> (tern parameter name, shard id or None)."""
    if name.startswith(_VERBATIM_PREFIXES):
        return name, None
    parts = name.split(".")
    if _expert_of(parts) and parts[-2] in _EXPERT_PROJ and parts[-1] == "weight":
        stacked, kind = _EXPERT_PROJ[parts[-2]]
        return ".".join([*parts[:-3], stacked]), (kind, int(parts[-3]))
    if len(parts) >= 2 and parts[-2] in _PACKED:
        fused, shard_id = _PACKED[parts[-2]]
        return ".".join(parts[:-2] + [fused, parts[-1]]), shard_id
    return name, None


def _unfused(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor | LazyWeight]]
) -> Iterator[tuple[str, torch.Tensor | LazyWeight]]:
    """Checkpoints that store q/k/v as one `qkv_proj` or gate/up as one `gate_up_proj` (Phi-3,
    GLM-4) as Hugging Face's separate projections, which map onto tern's fused parameters."""
    args = getattr(model, "args", None)
    for name, tensor in weights:
        parts = name.split(".")
        if args is None or len(parts) < 2 or parts[-2] not in _FUSED_IN_CHECKPOINT:
            yield name, tensor
            continue
        if parts[-2] == "qkv_proj":
            q, kv = (
                args.num_attention_heads * args.head_dim,
                args.num_key_value_heads * args.head_dim,
            )
            pieces = [("q_proj", q), ("k_proj", kv), ("v_proj", kv)]
        else:
            pieces = [("gate_proj", args.intermediate_size), ("up_proj", args.intermediate_size)]
        total = sum(n for _, n in pieces)
        if tensor.shape[0] != total:
            raise ValueError(f"checkpoint weight {name!r} has {tensor.shape[0]} rows, not {total}")
        start = 0
        for proj, rows in pieces:
            yield ".".join([*parts[:-2], proj, parts[-1]]), tensor.narrow(0, start, rows)
            start += rows


# MXFP4 (gpt-oss's released experts): 4-bit e2m1 values, two per byte (low nibble first), in
# blocks of 32 sharing one power-of-two scale (a uint8 exponent biased by 127).
_FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks (..., G, 16) uint8 and scales (..., G) uint8 -> float32 (..., G * 32)."""
    if blocks.shape[:-1] != scales.shape or blocks.size(-1) != 16:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)}"
        )
    lut = torch.tensor(_FP4_VALUES, dtype=torch.float32)
    values = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1)
    values = values.flatten(-2)  # (..., G, 32): low nibble, high nibble, ...
    exponents = scales.to(torch.int32) - 127
    return torch.ldexp(values, exponents.unsqueeze(-1)).flatten(-2)


def _dequantized(
    weights: Iterable[tuple[str, torch.Tensor | LazyWeight]],
) -> Iterator[tuple[str, torch.Tensor | LazyWeight]]:
    """gpt-oss's MXFP4 experts (`X_blocks` beside `X_scales`) as the float tensors `X` a
    transformers model holds: (E, rows, columns / 32, 16) dequantized to (E, rows, columns), then
    transposed as its parameters are; everything else as it is."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    logged = False
    for name, tensor in weights:
        base, _, kind = name.rpartition("_")
        if kind not in ("blocks", "scales") or ".experts." not in name:
            yield name, tensor
            continue
        parts = pending.setdefault(base, {})
        parts[kind] = tensor.materialize() if isinstance(tensor, LazyWeight) else tensor
        if len(parts) == 2:
            del pending[base]
            if not logged:
                logger.info("experts stored in MXFP4: dequantized as they load")
                logged = True
            yield base, dequantize_mxfp4(parts["blocks"], parts["scales"]).transpose(1, 2)
    if pending:
        raise ValueError(f"MXFP4 blocks without their scales (or scales alone): {sorted(pending)}")


@torch.no_grad()
def load_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor | LazyWeight]]
) -> set[str]:
    """Copy (Hugging Face name, full tensor) pairs into `model`; returns the names loaded (as this
    pipeline stage names them: a tied embedding loaded into a later stage's LM head is lm_head)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = _is_tied(model)
    local_name = getattr(model, "local_weight_name", None)
    # A model that keeps Hugging Face's projections apart (Whisper) names its parameters as the
    # checkpoint does: nothing is fused.
    verbatim = getattr(model, "verbatim_weight_names", False)
    loaded: set[str] = set()
    for name, tensor in _unfused(model, _dequantized(weights)):
        name = _canonical(name)
        if name.endswith(_IGNORED_SUFFIXES) or (tied and name.startswith(_LM_HEADS)):
            continue
        if local_name is not None:
            name = local_name(name)
            if name is None:  # another pipeline stage holds it
                continue
        param_name, shard_id = (name, None) if verbatim else _map_name(name)
        param = params.get(param_name)
        if param is None:
            raise ValueError(f"checkpoint weight {name!r} matches no parameter of the model")
        try:
            param.weight_loader(param, tensor, shard_id)
        except ValueError as e:
            raise ValueError(f"cannot load {name!r}: {e}") from None
        loaded.update(_per_expert_names(name, param) if shard_id is None else [name])
    return loaded


def _per_expert_names(name: str, param: nn.Parameter) -> list[str]:
    """A stacked experts tensor's name as the per-expert names it stands for (the names a
    checkpoint's completeness is checked by); any other name as itself."""
    parts = name.split(".")
    if len(parts) < 2 or parts[-2] != "experts" or parts[-1] not in _STACKED_EXPERTS:
        return [name]
    return [
        ".".join([*parts[:-1], str(e), proj, "weight"])
        for e in range(getattr(param, "num_experts", param.size(0)))
        for proj in _STACKED_EXPERTS[parts[-1]]
    ]


def expected_weight_names(model: nn.Module) -> set[str]:
    """The Hugging Face names a full checkpoint of `model` must contain."""
    inverse: dict[str, list[str]] = {}
    for hf_proj, (fused, _) in _PACKED.items():
        inverse.setdefault(fused, []).append(hf_proj)
    names = set()
    for name, param in model.named_parameters():  # tied weights appear once, as the embedding
        if len(experts := _per_expert_names(name, param)) > 1:
            names.update(experts)
            continue
        parts = name.split(".")
        for proj in inverse.get(parts[-2], [parts[-2]]) if len(parts) >= 2 else [None]:
            names.add(".".join(parts[:-2] + [proj, parts[-1]]) if proj else name)
    return names


def _local_param(model: nn.Module, hf_name: str) -> tuple[str, object] | None:
    """(parameter name, shard id) of checkpoint tensor `hf_name` on this pipeline stage, or None
    when another stage holds it."""
    name = _canonical(hf_name)
    local_name = getattr(model, "local_weight_name", None)
    if local_name is not None and (name := local_name(name)) is None:
        return None
    return _map_name(name)


def _shard_order(item: tuple[object, str]) -> int:
    """Shard ids (q, k, v; 0, 1, ...; None for an unfused layer) in the order of their rows."""
    shard_id = item[0]
    return {"q": 0, "k": 1, "v": 2, None: 0}.get(shard_id, shard_id)  # type: ignore[arg-type]


def keep_gguf_blocks(model: nn.Module, types: dict[str, str], quantize_x: bool = False) -> int:
    """Switch the unquantized linear layers whose every checkpoint tensor is of a block type the
    kernels take (`types`: Hugging Face name -> block type, or "int8": int8 storage with per-row
    scales) to that storage (a fused layer's projections each in its own block type where they
    differ); before the checkpoint loads. Returns how many layers switch."""
    from workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    from workers.layers.linear import LinearBase

    shards: dict[str, dict[object, str]] = {}
    for hf_name, block_type in types.items():
        if (local := _local_param(model, hf_name)) is not None:
            param_name, shard_id = local
            shards.setdefault(param_name, {})[shard_id] = block_type
    expected = {"qkv_proj": 3, "gate_up_proj": 2}
    kept = 0
    for param_name, by_shard in shards.items():
        module_name, _, leaf = param_name.rpartition(".")
        module = model.get_submodule(module_name) if leaf == "weight" else None
        if not isinstance(module, (LinearBase, VocabParallelEmbedding)) or module.quant is not None:
            continue
        if len(by_shard) != expected.get(module_name.rpartition(".")[2], 1):
            continue
        # NOTE: a shard's columns must start at block boundaries (input_size is this rank's).
        block_types = [t for _, t in sorted(by_shard.items(), key=_shard_order)]
        cols = module.input_size if isinstance(module, LinearBase) else module.embedding_dim
        if "int8" in block_types:  # an int8 checkpoint's layer: int8 storage, whole layers only
            if set(block_types) != {"int8"} or not isinstance(module, LinearBase):
                continue
            block_types = ["int8"]
        elif any(cols % block_values(t) for t in block_types):
            continue
        elif len(set(block_types)) > 1 and not isinstance(module, LinearBase):
            continue
        tied = []  # LM heads sharing an embedding's rows share its new ones
        if not isinstance(module, ParallelLMHead):
            tied = [
                h
                for h in model.modules()
                if isinstance(h, ParallelLMHead) and h.weight is module.weight
            ]
        if block_types == ["int8"]:
            module.store_int8()
        else:
            module.keep_gguf_blocks(
                block_types if len(block_types) > 1 else block_types[0], quantize_x
            )
        kept += 1
        for head in tied:
            head.tie_to(module)
    return kept


def act_order_layers(model: nn.Module, model_dir: str | Path, layers: list[str]) -> set[str]:
    """The act-order GPTQ layers (name prefixes) that keep INT4_ZP blocks with their input
    permuted: groups that sort into whole blocks, every projection of a fused layer grouped
    alike, and the whole input on this rank (not a row-parallel layer at --tp > 1)."""
    from workers.layers.linear import RowParallelLinear

    wanted = {f"{p}.g_idx" for p in layers}
    g_idx = {
        name.removesuffix(".g_idx"): w.materialize().numpy()
        for name, w in iter_safetensors_lazy(model_dir)
        if name in wanted
    }
    by_param: dict[str, list[str]] = {}
    for prefix in g_idx:
        if (local := _local_param(model, f"{prefix}.weight")) is not None:
            by_param.setdefault(local[0], []).append(prefix)
    kept = set()
    for param_name, prefixes in by_param.items():
        module = model.get_submodule(param_name.rpartition(".")[0])
        first = g_idx[prefixes[0]]
        if isinstance(module, RowParallelLinear) and module.ctx.tp_size > 1:
            continue
        if not permutable_groups(first) or any(
            not np.array_equal(g_idx[p], first) for p in prefixes
        ):
            continue
        kept.update(prefixes)
    return kept


def keep_blocks_everywhere(model: nn.Module, block_type: str, quantize_x: bool = False) -> int:
    """Every unquantized linear layer whose input features split into blocks, but mixture-of-experts
    routers, keeps `block_type` blocks, filled as the weights arrive (quantized on arrival:
    --quantization int4); before the checkpoint loads. Returns how many layers keep blocks."""
    from workers.layers.linear import LinearBase

    kept = 0
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase) or module.quant is not None:
            continue
        if name.endswith(".gate") or module.input_size % block_values(block_type):
            continue
        module.keep_gguf_blocks(block_type, quantize_x)
        kept += 1
    return kept


def _gguf_weights(model: nn.Module, checkpoint: GGUFCheckpoint) -> Iterable[tuple[str, object]]:
    """The file's tensors: blocks where the model's layers keep blocks, else float values."""
    keeps = any(getattr(m, "quant", None) == "gguf" for m in model.modules())
    return iter_gguf(checkpoint, keep_blocks=keeps)


def _quantized_layers(checkpoint_quant: Quantized, model_dir: str | Path) -> list[str]:
    names = (name for name, _ in iter_safetensors_lazy(model_dir))
    return quantized_layers(checkpoint_quant, names)


def checkpoint_weights(model: nn.Module, model_dir: str | Path) -> Iterable[tuple[str, object]]:
    """A checkpoint directory's tensors under Hugging Face's names, for the model's layers as they
    store their weights now (an update from disk): a GGUF file's blocks where layers keep blocks,
    a quantized checkpoint's layers as INT4_ZP blocks or float values, plain tensors otherwise."""
    if gguf_file_of(model_dir) is not None:
        return _gguf_weights(model, GGUFCheckpoint.open(model_dir))
    checkpoint_quant = checkpoint_quantization(model_dir)
    if checkpoint_quant is None:
        return iter_safetensors_lazy(model_dir)
    layers = _quantized_layers(checkpoint_quant, model_dir)
    return iter_quantized(iter_safetensors_lazy(model_dir), checkpoint_quant, layers)


def load_checkpoint(model: nn.Module, model_dir: str | Path, quantize_x: bool = False) -> None:
    """Load a whole checkpoint (safetensors, or the GGUF file a prepared directory names); every
    parameter must be covered. A GGUF file's linear layers keep the block types the kernels
    multiply as stored, and a GPTQ / AWQ / compressed-tensors int4 checkpoint's keep their groups
    as INT4_ZP blocks (`quantize_x`: the fast path, activations quantized per block), unless the
    model quantizes its weights itself (--quantization); other quantized checkpoints arrive as
    float values (quantized_checkpoints.py)."""
    quantized = any(getattr(m, "quant", None) is not None for m in model.modules())
    checkpoint_quant = checkpoint_quantization(model_dir)
    weights: Iterable[tuple[str, object]]
    if gguf_file_of(model_dir) is not None:
        checkpoint = GGUFCheckpoint.open(model_dir)  # once: parsing a file takes seconds
        if not quantized:
            keep_gguf_blocks(model, checkpoint.block_types(), quantize_x)
        weights = _gguf_weights(model, checkpoint)
    elif checkpoint_quant is not None:
        layers = _quantized_layers(checkpoint_quant, model_dir)
        permuted: set[str] = set()
        if not quantized and checkpoint_quant.act_order:
            permuted = act_order_layers(model, model_dir, layers)
            storage = dict.fromkeys((f"{p}.weight" for p in permuted), "INT4_ZP")
            keep_gguf_blocks(model, storage, quantize_x)
        elif not quantized and (checkpoint_quant.keeps_int4 or checkpoint_quant.int8_layers):
            kind = "INT4_ZP" if checkpoint_quant.keeps_int4 else "int8"
            keep_gguf_blocks(
                model, dict.fromkeys((f"{p}.weight" for p in layers), kind), quantize_x
            )
        weights = iter_quantized(
            iter_safetensors_lazy(model_dir), checkpoint_quant, layers, permuted
        )
    else:
        weights = iter_safetensors_lazy(model_dir)
    loaded = load_weights(model, weights)
    missing = expected_weight_names(model) - loaded
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks weights: {sorted(missing)[:8]}")

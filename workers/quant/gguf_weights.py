"""The tensors of a GGUF file under Hugging Face's names, one at a time.

A GGUF model directory (frontend/gguf_model.py prepares it) holds the file's config and tokenizer
as Hugging Face files and `gguf_source.json`, which names the GGUF file itself; the weights stay
in that file. llama.cpp's tensor names (`blk.N.attn_q.weight`, ...) map to Hugging Face's through
transformers' own GGUF tables (the names of a meta-device Hugging Face model of the same config),
and its per-architecture processors undo what llama.cpp's converter did (Llama's q/k rotary
permutation, Gemma's norm offset, MoE experts stacked as `ffn_*_exps`). The block types tern's
kernels multiply as stored (Q8_0, Q4_0, Q4_1: workers/quant/gguf_blocks.py) arrive as their rows
of blocks for the linear layers that keep them; every other block type is dequantized to float32
by the `gguf` package as its tensor is read, with one log line naming the types.
"""

from __future__ import annotations

import functools
import json
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from unittest import mock

import numpy as np
import torch

from enginecore.config import GGUF_SOURCE_FILE
from workers.kernels.linear_ops import BLOCK_TYPES
from workers.quant.gguf_blocks import GGUFBlocks

if TYPE_CHECKING:  # the gguf package is imported where a GGUF file is read
    from workers.quant.gguf_file import GGUFFile

logger = logging.getLogger(__name__)

# Tensor types read as they are stored, not counted as dequantized.
FLOAT_TYPES = ("F32", "F16", "BF16")


def gguf_file_of(model_dir: str | Path) -> Path | None:
    """The GGUF file a prepared directory serves, or None for a safetensors checkpoint."""
    source = Path(model_dir) / GGUF_SOURCE_FILE
    if not source.is_file():
        return None
    return Path(json.loads(source.read_text())["path"])


def _weights_map(config, processor) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name, from a meta-device model of the same config.

    NOTE: transformers' get_gguf_hf_weights_map recurses into every submodule and builds gguf's
    TensorNameMap (every name of the architecture, for every layer) anew in each: 6 s of the
    default model's load (30 layers, ~400 modules). While it runs, one map per architecture and
    layer count serves every call (a map is only read)."""
    import gguf
    import transformers
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    one_map = functools.cache(gguf.get_tensor_name_map)
    with mock.patch.object(gguf, "get_tensor_name_map", one_map):
        return get_gguf_hf_weights_map(model, processor)


@dataclass(frozen=True)
class GGUFCheckpoint:
    """A prepared directory's GGUF file, opened once, the architecture's tensor processor, GGUF
    name -> Hugging Face name, and the config."""

    file: GGUFFile
    processor: Any
    names: dict[str, str]
    config: Any

    @classmethod
    def open(cls, model_dir: str | Path) -> GGUFCheckpoint:
        import transformers
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

        from workers.quant.gguf_file import GGUFFile

        path = gguf_file_of(model_dir)
        if path is None:
            raise ValueError(f"{model_dir} is not a GGUF model directory (no {GGUF_SOURCE_FILE})")
        file = GGUFFile(path)
        architecture = file.metadata["general.architecture"]
        config = transformers.AutoConfig.from_pretrained(model_dir)
        processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
        return cls(file, processor, _weights_map(config, processor), config)

    def block_types(self) -> dict[str, str]:
        """Hugging Face name -> block type of the 2-D tensors tern multiplies as stored."""
        return {
            self.names[t.name]: t.tensor_type.name
            for t in self.file.tensors
            if t.tensor_type.name in BLOCK_TYPES and len(t.shape) == 2 and t.name in self.names
        }


def iter_gguf(
    checkpoint: GGUFCheckpoint, keep_blocks: bool = False
) -> Iterator[tuple[str, torch.Tensor | GGUFBlocks]]:
    """Every tensor of the GGUF file as (Hugging Face name, float tensor); with `keep_blocks`,
    2-D tensors of the block types the kernels take as GGUFBlocks (their rows permuted by the
    processor as the float ones are)."""
    from gguf import dequantize

    file, processor, names = checkpoint.file, checkpoint.processor, checkpoint.names
    # Processors that stack tensors (MoE experts) assemble them here.
    parsed: dict = {"tensors": {}, "config": checkpoint.config.to_dict()}
    dequantized: Counter[str] = Counter()
    for tensor in file.tensors:
        kind = tensor.tensor_type.name
        kept = keep_blocks and kind in BLOCK_TYPES and len(tensor.shape) == 2
        if kind not in FLOAT_TYPES and not kept:
            dequantized[kind] += 1
        # NOTE: a block tensor's rows are rows of bytes: the processors' row permutations apply.
        weights = tensor.data if kept else dequantize(tensor.data, tensor.tensor_type)
        result = processor.process(
            weights=weights, name=tensor.name, tensor_key_mapping=names, parsed_parameters=parsed
        )
        if result.name is None or result.name not in names:
            continue
        value = torch.tensor(np.asarray(result.weights))
        if kept:
            yield names[result.name], GGUFBlocks(value, kind, int(tensor.shape[0]))
        else:
            yield names[result.name], value
    # NOTE: stacked experts are assembled from several GGUF tensors (gate and up apart).
    for name, value in parsed["tensors"].items():
        yield name, value if isinstance(value, torch.Tensor) else torch.from_numpy(value)
    if dequantized:
        kinds = ", ".join(f"{k} ({n} tensors)" for k, n in sorted(dequantized.items()))
        logger.info("%s: dequantized to float32 at load: %s", file.path, kinds)

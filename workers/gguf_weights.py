"""The tensors of a GGUF file under Hugging Face's names, one at a time.

A GGUF model directory (frontend/gguf_model.py prepares it) holds the file's config and tokenizer
as Hugging Face files and `gguf_source.json`, which names the GGUF file itself; the weights stay
in that file. llama.cpp's tensor names (`blk.N.attn_q.weight`, ...) map to Hugging Face's through
transformers' own GGUF tables (the names of a meta-device Hugging Face model of the same config),
and its per-architecture processors undo what llama.cpp's converter did (Llama's q/k rotary
permutation, Gemma's norm offset, MoE experts stacked as `ffn_*_exps`). Quantized blocks are
dequantized to float32 by the `gguf` package as each tensor is read, with one log line naming the
block types: the model's parameters then take them in their own dtype.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from enginecore.config import GGUF_SOURCE_FILE

logger = logging.getLogger(__name__)

# Block types kept as they are (the float ones are read as stored).
FLOAT_TYPES = ("F32", "F16", "BF16")


def gguf_file_of(model_dir: str | Path) -> Path | None:
    """The GGUF file a prepared directory serves, or None for a safetensors checkpoint."""
    source = Path(model_dir) / GGUF_SOURCE_FILE
    if not source.is_file():
        return None
    return Path(json.loads(source.read_text())["path"])


def _weights_map(config, processor) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name, from a meta-device model of the same config."""
    import transformers
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return get_gguf_hf_weights_map(model, processor)


def iter_gguf(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the directory's GGUF file as (Hugging Face name, float tensor)."""
    import transformers
    from gguf import GGUFReader, dequantize
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        read_field,
    )

    path = gguf_file_of(model_dir)
    if path is None:
        raise ValueError(f"{model_dir} is not a GGUF model directory (no {GGUF_SOURCE_FILE})")
    reader = GGUFReader(path)
    architecture = read_field(reader, "general.architecture")[0]
    config = transformers.AutoConfig.from_pretrained(model_dir)
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    names = _weights_map(config, processor)
    # Processors that stack tensors (MoE experts) assemble them here.
    parsed: dict = {"tensors": {}, "config": config.to_dict()}
    dequantized: Counter[str] = Counter()
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in FLOAT_TYPES:
            dequantized[kind] += 1
        weights = dequantize(tensor.data, tensor.tensor_type)
        result = processor.process(
            weights=weights, name=tensor.name, tensor_key_mapping=names, parsed_parameters=parsed
        )
        if result.name is not None and result.name in names:
            yield names[result.name], torch.tensor(np.asarray(result.weights))
    # NOTE: stacked experts are assembled from several GGUF tensors (gate and up apart).
    for name, value in parsed["tensors"].items():
        yield name, value if isinstance(value, torch.Tensor) else torch.from_numpy(value)
    if dequantized:
        kinds = ", ".join(f"{k} ({n} tensors)" for k, n in sorted(dequantized.items()))
        logger.info("%s: dequantized to float32 at load: %s", path.name, kinds)

"""Writes a GGUF file from a tiny Hugging Face checkpoint, as llama.cpp's converter lays one out.

For tests and benchmarks of GGUF serving: the checkpoint's tensors under llama.cpp's names (Llama's
q/k rows permuted as its converter does), its hyper-parameters under `{arch}.*` keys, and the
tokenizer and chat template copied from the default model's GGUF file (the checkpoint's vocabulary
must be that tokenizer's: 49152 tokens). 2-D weights whose rows split into blocks are stored in
the block type asked for (the `gguf` package quantizes Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and BF16,
tern's kquants.py Q4_K, Q5_K and Q6_K);
norms and biases stay F32, as llama.cpp keeps them.

    python scripts/make_tiny_gguf.py MODEL_DIR OUT.gguf [--type Q8_0]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Hugging Face model_type -> llama.cpp architecture name.
ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Llama q/k row order: each head's rotary halves interleaved."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@functools.cache
def _tokenizer_fields(tokenizer_gguf: Path) -> list[tuple[str, list, object]]:
    import gguf
    from transformers.modeling_gguf_pytorch_utils import read_field

    reader = gguf.GGUFReader(tokenizer_gguf)
    return [
        (key, read_field(reader, key), field.types[0])
        for key, field in reader.fields.items()
        if key.startswith("tokenizer.")
    ]


def _copy_tokenizer(writer, tokenizer_gguf: Path) -> None:
    import gguf

    for key, value, kind in _tokenizer_fields(tokenizer_gguf):
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value[0], kind)


def _block_type(types: dict[str, str], name: str) -> str:
    """The block type of GGUF tensor `name`: the first key of `types` it contains, else "*"'s."""
    return next((t for key, t in types.items() if key != "*" and key in name), types["*"])


def write_gguf(model_dir: Path, out: Path, block_types: str | dict[str, str] = "Q8_0") -> Path:
    """The checkpoint in model_dir as a GGUF file at out, its weights in one block type, or in
    several as a Q4_K_M file mixes them: {GGUF name fragment ("attn_v", "ffn_down", ...): type,
    "*": the rest's}."""
    import gguf
    from safetensors.numpy import load_file

    from frontend.model_prep import find_gguf
    from workers.quant.kquants import quantize_k

    config = json.loads((model_dir / "config.json").read_text())
    arch = ARCHS[config["model_type"]]
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head
    writer = gguf.GGUFWriter(out, arch)
    writer.add_name(f"tiny {arch}")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(config["vocab_size"])
    _copy_tokenizer(writer, find_gguf())

    types = {"*": block_types} if isinstance(block_types, str) else block_types
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config["num_hidden_layers"])
    tensors: dict[str, np.ndarray] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(file))
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    for hf_name, w in sorted(tensors.items()):
        base, suffix = hf_name.rsplit(".", 1)
        name = names.get_name(base)
        if name is None:
            raise ValueError(f"{hf_name}: no GGUF name for {arch}")
        w = w.astype(np.float32)
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):
            w = _permute(w, n_head if base.endswith("q_proj") else n_kv)
        qtype = gguf.GGMLQuantizationType[_block_type(types, name)]
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        if w.ndim == 2 and w.shape[1] % block == 0 and qtype != gguf.GGMLQuantizationType.F32:
            if qtype.name.endswith("_K"):
                blocks = quantize_k(w, qtype.name)
            else:
                blocks = gguf.quants.quantize(w, qtype)
            writer.add_tensor(f"{name}.{suffix}", blocks, raw_dtype=qtype)
        else:
            writer.add_tensor(f"{name}.{suffix}", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--type", default="Q8_0", help="the block type of every 2-D weight")
    args = parser.parse_args()
    print(write_gguf(args.model_dir, args.out, args.type))


if __name__ == "__main__":
    main()

"""A GGUF file as a model: `tern launch --model path/to/file.gguf`.

The file's metadata becomes a small Hugging Face directory under TERN_HOME/models/gguf/ (config,
generation config, tokenizer and chat template, all read by transformers' own GGUF support, no
hand-written tokenizer), with `gguf_source.json` naming the file: the weights are read from the
GGUF file itself when the workers load (workers/quant/gguf_weights.py), never copied. The directory is
keyed by the file's path, size and modification time, and prepared once (under a lock, as the
default model is).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from enginecore.config import GGUF_SOURCE_FILE, tern_home
from frontend.model_prep import (
    fix_eos,
    fix_tokenizer_config,
    offline_env,
    one_parse_per_file,
    prepare_once,
)

# NOTE: bump when what a prepared directory holds changes, so existing ones are redone.
FORMAT_VERSION = 1
_REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    GGUF_SOURCE_FILE,
)


def is_gguf(path: Path) -> bool:
    return path.suffix.lower() == ".gguf" and path.is_file()


def _source(gguf: Path) -> dict:
    stat = gguf.stat()
    return {
        "path": str(gguf),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "format_version": FORMAT_VERSION,
    }


def prepared_dir(gguf: Path) -> Path:
    """Where the metadata directory of `gguf` is (or will be)."""
    key = hashlib.sha256(json.dumps(_source(gguf), sort_keys=True).encode()).hexdigest()[:16]
    return tern_home() / "models" / "gguf" / f"{gguf.stem}-{key}"


def _complete(target: Path) -> bool:
    return all((target / name).is_file() for name in _REQUIRED_FILES)


def prepare_gguf(gguf: Path) -> Path:
    """The model directory serving `gguf`, prepared from its metadata on first use."""
    gguf = gguf.expanduser().resolve()
    return prepare_once(prepared_dir(gguf), lambda out: _write(gguf, out), _complete)


def _architecture_of(model_type: str) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if name is None:
        raise ValueError(f"GGUF architecture {model_type!r} has no causal-LM class in transformers")
    return name


def _fill_in_head_dim(config, gguf: Path) -> None:
    """transformers maps `{arch}.attention.key_length` to head_dim for some families only (not
    Qwen3's, whose heads are wider than hidden_size / heads): taken from the file for all."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import read_field

    reader = GGUFReader(gguf)
    arch = read_field(reader, "general.architecture")[0]
    key_length = read_field(reader, f"{arch}.attention.key_length")
    if key_length:
        config.head_dim = int(key_length[0])


def _write(gguf: Path, out: Path) -> None:
    with offline_env(), one_parse_per_file():
        import transformers

        try:
            config = transformers.AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        except (ValueError, KeyError, OSError) as e:
            raise ValueError(f"{gguf}: cannot read its GGUF metadata: {e}") from None
        config.architectures = [_architecture_of(config.model_type)]
        _fill_in_head_dim(config, gguf)
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        generation = transformers.GenerationConfig.from_model_config(config)
        if tokenizer.eos_token_id is not None:
            fix_eos(generation, tokenizer)
        config.save_pretrained(out)
        generation.save_pretrained(out)
        tokenizer.save_pretrained(out)
    fix_tokenizer_config(out / "tokenizer_config.json")
    # NOTE: written last: its presence (with the others) means the directory is complete.
    (out / GGUF_SOURCE_FILE).write_text(json.dumps(_source(gguf), indent=2) + "\n")
    for path in out.iterdir():
        os.chmod(path, 0o644)

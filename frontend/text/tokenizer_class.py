"""A model directory's Hugging Face tokenizer, as AutoTokenizer loads it, without AutoTokenizer's
import on a start that has loaded the directory before.

AutoTokenizer picks the class (per-family rules over tokenizer_config.json and config.json) with
transformers' configuration machinery, which imports torch: ~2 s of the frontend's start, which
is its critical path (the engine core is ready first on a small model). The pick depends only on
the directory's files and the transformers version, so the class it made is remembered in
TERN_HOME and made directly next time (the tokenizer modules import no torch).
"""

from __future__ import annotations

import hashlib
import importlib
from pathlib import Path
from typing import Any

import transformers

from enginecore.home_cache import read_remembered, remember

CACHE_FILE = "tokenizer_classes.json"
MAX_ENTRIES = 256  # the most recent kept: a cache, not a record
# What AutoTokenizer reads to pick a class (and from_pretrained to build it).
_INPUTS = (
    "tokenizer_config.json",
    "config.json",
    "tokenizer.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "added_tokens.json",
)


def auto_tokenizer(path: Path) -> Any:
    """AutoTokenizer.from_pretrained(path)'s tokenizer: the remembered class's when the directory's
    files and transformers are as they were when AutoTokenizer picked it."""
    key = _key(path)
    cls = _class(read_remembered(CACHE_FILE).get(key))
    if cls is not None:
        return cls.from_pretrained(str(path))
    from transformers import AutoTokenizer  # imports torch: only the first start of a directory

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    kind = type(tokenizer)
    if kind.__module__.startswith("transformers."):  # not a checkpoint's own code
        _remember(key, [kind.__module__, kind.__qualname__])
    return tokenizer


def _key(path: Path) -> str:
    parts = [transformers.__version__, str(path.resolve())]
    for name in _INPUTS:
        try:
            st = (path / name).stat()
        except OSError:
            continue
        parts.append(f"{name}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _class(entry: object) -> type | None:
    if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(e, str) for e in entry)):
        return None
    try:
        return getattr(importlib.import_module(entry[0]), entry[1])
    except (ImportError, AttributeError):
        return None  # transformers moved it: AutoTokenizer picks again


def _remember(key: str, entry: list[str]) -> None:
    """Adds the entry, the most recent MAX_ENTRIES kept."""
    entries = read_remembered(CACHE_FILE)
    entries.pop(key, None)
    entries[key] = entry
    remember(CACHE_FILE, dict(list(entries.items())[-MAX_ENTRIES:]))

"""Facts remembered between starts in TERN_HOME, one JSON object per file: what a start would
otherwise work out again (the tokenizer class AutoTokenizer picks for a directory, the memory's
read bandwidth). A file is written to a temporary name and renamed, so a reader never sees half of
one; two starts writing at once may drop each other's entry, which is then worked out again. A
TERN_HOME that cannot be read or written remembers nothing."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from enginecore.config import tern_home


def read_remembered(name: str) -> dict[str, Any]:
    """TERN_HOME/name's entries; empty if it is missing or unreadable."""
    try:
        entries = json.loads((tern_home() / name).read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def remember(name: str, entries: dict[str, Any]) -> None:
    """Writes TERN_HOME/name (all its entries); nothing where TERN_HOME cannot be written."""
    home = tern_home()
    tmp: str | None = None
    try:
        home.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=home, prefix=f".{name}.")
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f, indent=1)
        os.replace(tmp, home / name)
    except OSError:
        if tmp is not None:
            with contextlib.suppress(OSError):
                Path(tmp).unlink()

"""The shared-memory files that carry pulled KV blocks to the worker ranks.

A producer's rank writes the blocks a consumer on its host asked for into one such file (no copy
through a socket); a consumer's engine core writes the blocks that came over TCP into one. The
rank that loads a file deletes it; whoever drops a pull before it is loaded deletes its files.
"""

from __future__ import annotations

import os
import socket
import tempfile
import uuid

FILE_PREFIX = "tern-kv-"


def shm_dir() -> str:
    """/dev/shm where there is one (memory, not disk), else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def new_path() -> str:
    return os.path.join(shm_dir(), f"{FILE_PREFIX}{uuid.uuid4().hex}")


def host_name() -> str:
    """What a pull names as its host: a producer on the same host answers with a file."""
    return socket.gethostname()


def remove(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

"""Hugging Face functions that cannot be reached by import on a server without torchvision
(classes whose module or decorator requires it: transformers' video processors,
PixtralProcessor), taken from their source files as they are, to check tern's stand-ins against."""

from __future__ import annotations

import ast
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from transformers.video_utils import VideoMetadata

HF_MODELS = Path(transformers.__file__).parent / "models"


def hf_functions(path: Path, names: tuple[str, ...]) -> dict[str, Any]:
    """The functions (module level, or methods of a class: call them with a stand-in `self`)
    called `names` in a transformers source file, compiled undecorated."""
    tree = ast.parse(path.read_text())
    found = [
        node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name in names
    ]
    for node in found:
        node.decorator_list = []
    module = ast.Module(body=found, type_ignores=[])
    namespace: dict[str, Any] = {"math": math, "np": np, "torch": torch, "Any": Any}
    namespace.update(logger=logging.getLogger("hf"), VideoMetadata=VideoMetadata, SizeDict=dict)
    exec(compile(ast.fix_missing_locations(module), str(path), "exec"), namespace)
    missing = set(names) - set(namespace)
    if missing:
        raise LookupError(f"{path.name} has no {sorted(missing)}")
    return {name: namespace[name] for name in names}

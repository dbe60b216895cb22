"""`tern launch` flags of LoRA adapters: whether they are served, the adapters loaded at start-up
(vLLM's, SGLang's and LMDeploy's spellings) and the limits on adapters per batch, rank and kept
loaded. Builds the LoraConfig."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from enginecore.config import LoraConfig


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LoRA adapters")
    group.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters (PEFT's format) beside the base model",
    )
    group.add_argument(
        "--lora-modules",
        "--lora-paths",
        "--adapters",
        nargs="+",
        default=[],
        metavar="ADAPTER",
        help="adapters served from start-up: name=path, vLLM's JSON "
        '\'{"name": ..., "path": ...}\', or a path (named after its directory); SGLang\'s '
        "--lora-paths and LMDeploy's --adapters are the same flag (and enable LoRA)",
    )
    group.add_argument(
        "--max-loras", type=int, default=4, help="distinct adapters in one batch (default 4)"
    )
    group.add_argument(
        "--max-lora-rank",
        type=int,
        default=16,
        help="the largest adapter rank served (default 16; at most 256)",
    )
    group.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="adapters kept loaded (least recently used evicted beyond; default --max-loras)",
    )


def lora_config_from_args(args: argparse.Namespace) -> LoraConfig:
    modules = tuple(_lora_module(spec) for spec in args.lora_modules)
    names = [name for name, _ in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules names an adapter twice: {names}")
    return LoraConfig(
        enabled=args.enable_lora or bool(modules),
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        modules=modules,
    )


def _lora_module(spec: str) -> tuple[str, str]:
    """(name, absolute path) of one --lora-modules entry: name=path, vLLM's JSON object, or a
    path (named after its directory)."""
    if spec.lstrip().startswith("{"):
        try:
            entry = json.loads(spec)
            name, path = str(entry["name"]), str(entry["path"])
        except (ValueError, KeyError, TypeError):
            raise ValueError(
                f'--lora-modules {spec!r}: JSON entries are {{"name": ..., "path": ...}}'
            ) from None
    else:
        name, sep, path = spec.partition("=")
        if not sep:
            path, name = spec, Path(spec.rstrip("/")).name
    if not name or not path:
        raise ValueError(f"--lora-modules {spec!r}: give name=path")
    return name, str(Path(path).resolve())

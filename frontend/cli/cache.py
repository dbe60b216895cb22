"""`tern launch` flags of the KV cache: its block size, its memory (GiB, or vLLM's fraction of the
memory free at start-up), its dtype (or LMDeploy's --quant-policy), prefix caching and hybrid
models' state checkpoints. Builds the CacheConfig.

It knows the parallel layout only to share a node's free memory among its workers.
"""

from __future__ import annotations

import argparse

from enginecore.config import CacheConfig, ParallelConfig

DEFAULT_KV_CACHE_GIB = 1.0


class _VllmBoolean(argparse.Action):
    """--enable-X sets True, --no-enable-X sets False (vLLM's pairs of boolean flags)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)  # type: ignore[arg-type]

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, not (option_string or "").startswith("--no-"))


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("KV cache")
    group.add_argument("--block-size", type=int, default=16)
    _add_memory_args(group)
    group.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="disable automatic prefix caching",
    )
    group.add_argument(
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
        dest="enable_prefix_caching",
        action=_VllmBoolean,
        default=True,
        help="vLLM's spelling of the prefix-caching switch (on by default)",
    )
    group.add_argument(
        "--state-checkpoint-interval",
        type=int,
        default=None,
        metavar="TOKENS",
        help="hybrid models (Qwen3.5): keep linear-attention states for the prefix cache every "
        "this many tokens, a multiple of --block-size (default: where one checkpoint costs the "
        "KV cache of the tokens since the last); prompts also keep one at their last block",
    )
    group.add_argument("--num-gpu-blocks-override", type=int, default=None, help=argparse.SUPPRESS)


def _add_memory_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--kv-cache-memory",
        type=float,
        default=None,
        metavar="GiB",
        help=f"memory for the KV cache, in GiB (default: {DEFAULT_KV_CACHE_GIB})",
    )
    group.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="auto (the activations' dtype) or int8: each token's keys and values per head as "
        "int8 with a float32 scale per 16 values, 62%% of bfloat16's bytes (vLLM's flag; "
        "LMDeploy's --quant-policy 8)",
    )
    group.add_argument(
        "--quant-policy",
        type=int,
        choices=[0, 8],
        default=None,
        help="LMDeploy's spelling: 8 is --kv-cache-dtype int8, 0 auto",
    )
    group.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        metavar="FRACTION",
        help="vLLM's spelling: the KV cache takes this fraction of the memory free at start-up "
        "(of each GPU; on CPU, of the available system memory, shared by the local workers); "
        "instead of --kv-cache-memory",
    )


def cache_config_from_args(args: argparse.Namespace, parallel: ParallelConfig) -> CacheConfig:
    if args.num_gpu_blocks_override is not None and args.num_gpu_blocks_override < 1:
        raise ValueError("--num-gpu-blocks-override must be positive")
    return CacheConfig(
        block_size=args.block_size,
        kv_cache_memory_gib=_kv_cache_gib(args, parallel),
        enable_prefix_caching=args.enable_prefix_caching,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        state_checkpoint_interval=args.state_checkpoint_interval,
        kv_cache_dtype=_kv_cache_dtype(args),
    )


def _kv_cache_dtype(args: argparse.Namespace) -> str:
    """--kv-cache-dtype, or LMDeploy's --quant-policy (8: int8)."""
    if args.quant_policy is None:
        return args.kv_cache_dtype
    policy = "int8" if args.quant_policy == 8 else "auto"
    if args.kv_cache_dtype not in ("auto", policy):
        raise ValueError("--quant-policy and --kv-cache-dtype disagree")
    return policy


def _kv_cache_gib(args: argparse.Namespace, parallel: ParallelConfig) -> float:
    """--kv-cache-memory, or --gpu-memory-utilization's fraction of the memory free now: of the
    first GPU's (each rank has its own device), or of the available system memory on CPU, where
    this node's workers share it (each gets its part)."""
    fraction = args.gpu_memory_utilization
    if fraction is None:
        return DEFAULT_KV_CACHE_GIB if args.kv_cache_memory is None else args.kv_cache_memory
    if args.kv_cache_memory is not None:
        raise ValueError("give --kv-cache-memory or --gpu-memory-utilization, not both")
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], not {fraction}")
    free_bytes, sharers = _free_memory(parallel.num_local_workers)
    return fraction * free_bytes / sharers / 2**30


def _free_memory(ranks_per_node: int) -> tuple[int, int]:
    """(bytes free for the KV caches, how many workers share them)."""
    import torch  # noqa: PLC0415 - torch is slow to import and only needed here

    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(0)
        return free, 1
    import psutil  # noqa: PLC0415

    return psutil.virtual_memory().available, ranks_per_node

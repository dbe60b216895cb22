"""Command-line arguments of `tern launch`, and the one Config they build.

Names follow `vllm serve` where the two overlap, so that scripts carry over.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from enginecore.config import CacheConfig, Config, ModelConfig, SchedulerConfig, ServerConfig


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tern", description="tern: an OpenAI-compatible LLM inference server"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    launch = sub.add_parser("launch", help="serve a model over HTTP (OpenAI-compatible API)")
    launch.add_argument(
        "--model",
        default=None,
        help="Hugging Face model directory (default: SmolLM2-135M-Instruct, prepared on first use)",
    )
    launch.add_argument("--host", default="127.0.0.1")
    launch.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    launch.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    launch.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length (default: the model's, at most 32768)",
    )
    launch.add_argument("--max-num-seqs", type=int, default=64)
    launch.add_argument("--max-num-batched-tokens", type=int, default=2048)
    launch.add_argument("--block-size", type=int, default=16)
    launch.add_argument(
        "--kv-cache-memory",
        type=float,
        default=1.0,
        metavar="GiB",
        help="memory for the KV cache, in GiB",
    )
    launch.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="disable automatic prefix caching",
    )
    launch.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients use (default: --model as given)",
    )
    launch.add_argument("--seed", type=int, default=0)
    launch.add_argument("--num-gpu-blocks-override", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def config_from_args(args: argparse.Namespace) -> Config:
    """Builds the Config; raises ValueError (with a message for the user) on bad arguments.

    Without --model the default model is prepared (converted once, then cached).
    """
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], not {args.port}")
    if args.model is None:
        from frontend.model_prep import MODEL_NAME, ensure_default_model

        model_path = ensure_default_model()
        served_name = args.served_model_name or MODEL_NAME
    else:
        model_path = Path(args.model).expanduser()
        if not (model_path / "config.json").is_file():
            raise ValueError(f"--model {args.model}: not a model directory (no config.json)")
        served_name = args.served_model_name or args.model
    if args.num_gpu_blocks_override is not None and args.num_gpu_blocks_override < 1:
        raise ValueError("--num-gpu-blocks-override must be positive")
    return Config(
        model=ModelConfig(
            path=str(model_path.resolve()),
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            served_model_name=served_name,
            seed=args.seed,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory_gib=args.kv_cache_memory,
            enable_prefix_caching=args.enable_prefix_caching,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
        ),
        server=ServerConfig(host=args.host, port=args.port),
    )

"""The `tern launch` (or `tern serve MODEL`) command line: each concern's flags, in one argparse
group per config module beside it, composed into the parser, and the one Config every process
gets built from them. Names follow `vllm serve` where the two overlap, so that scripts carry over.

The FrontendConfig (HTTP-only settings) is built by frontend.cli.server.frontend_config_from_args.
"""

from __future__ import annotations

import argparse

from enginecore.config import Config
from frontend.cli import (
    cache,
    disaggregation,
    lora,
    media,
    model,
    output,
    parallel,
    scheduler,
    server,
    speculative,
)

# Their argparse groups, in --help's order.
CLI_MODULES = (
    model,
    server,
    scheduler,
    cache,
    output,
    lora,
    speculative,
    parallel,
    media,
    disaggregation,
)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tern", description="tern: an OpenAI-compatible LLM inference server"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    # `tern serve MODEL` is vLLM's spelling of `tern launch --model MODEL`.
    launch = sub.add_parser(
        "launch", aliases=["serve"], help="serve a model over HTTP (OpenAI-compatible API)"
    )
    for module in CLI_MODULES:
        module.add_cli_args(launch)
    return parser


def config_from_args(args: argparse.Namespace) -> Config:
    """Builds the Config; raises ValueError (with a message for the user) on bad arguments.

    Without --model the default model is prepared (converted once, then cached).
    """
    server_config = server.server_config_from_args(args)
    model_config = model.model_config_from_args(args)
    parallel_config = parallel.parallel_config_from_args(args)
    return Config(
        model=model_config,
        cache=cache.cache_config_from_args(args, parallel_config),
        scheduler=scheduler.scheduler_config_from_args(args),
        parallel=parallel_config,
        server=server_config,
        structured_output=output.structured_output_config_from_args(args),
        lora=lora.lora_config_from_args(args),
        speculative=speculative.speculative_config_from_args(args),
        kv_transfer=disaggregation.kv_transfer_config_from_args(args),
    )

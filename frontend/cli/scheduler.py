"""`tern launch` flags of the scheduler: how many sequences and tokens one engine step takes.
Builds the SchedulerConfig."""

from __future__ import annotations

import argparse

from enginecore.config import SchedulerConfig


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("scheduler")
    group.add_argument("--max-num-seqs", type=int, default=64)
    group.add_argument("--max-num-batched-tokens", type=int, default=2048)


def scheduler_config_from_args(args: argparse.Namespace) -> SchedulerConfig:
    return SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )

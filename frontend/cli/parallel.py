"""`tern launch` flags of parallelism: tensor, pipeline, expert and data parallel sizes, the
torch.distributed backend and timeout, and the nodes of a multi-host server. Builds the
ParallelConfig."""

from __future__ import annotations

import argparse

from enginecore.config import RAY_PLACEMENT_STRATEGIES, ParallelConfig


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("parallelism")
    group.add_argument("--tensor-parallel-size", "--tp", "-tp", type=int, default=1, dest="tp")
    group.add_argument("--pipeline-parallel-size", "--pp", "-pp", type=int, default=1, dest="pp")
    group.add_argument(
        "--enable-expert-parallel",
        "-ep",
        action="store_true",
        help="mixture-of-experts models: each tensor-parallel rank holds num_experts / tp whole "
        "experts (vLLM's flag), instead of a share of every expert's features",
    )
    group.add_argument(
        "--data-parallel-size",
        "--dp",
        "-dp",
        type=int,
        default=1,
        dest="dp",
        help="engine replicas, each with its own tp x pp workers, behind this one frontend",
    )
    group.add_argument(
        "--distributed-backend",
        choices=["gloo", "nccl"],
        default=None,
        help="torch.distributed backend (default: nccl on GPU, gloo on CPU)",
    )
    group.add_argument(
        "--distributed-timeout",
        type=float,
        default=None,
        help="seconds after which a stuck collective fails (default: 60, or TERN_DIST_TIMEOUT)",
    )
    _add_node_args(group)
    _add_ray_args(group)


def _add_ray_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--distributed-executor-backend",
        choices=["mp", "ray"],
        default="mp",
        help="mp: the ranks are child processes of the engine core; ray: each rank is a Ray "
        "actor in a placement group, on any node of a Ray cluster (docs/ray.md)",
    )
    group.add_argument(
        "--ray-placement-strategy",
        choices=list(RAY_PLACEMENT_STRATEGIES),
        default="PACK",
        help="how the ray backend's placement group lays the ranks out over nodes",
    )
    group.add_argument(
        "--ray-address",
        default=None,
        help="the Ray cluster to join (default: $RAY_ADDRESS, a cluster running on this host, "
        "else a new local one)",
    )


def _add_node_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--nnodes", type=int, default=1)
    group.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="this host's index; nodes other than 0 only run their workers",
    )
    group.add_argument(
        "--dist-init-addr", default=None, help="host:port of node 0 (needed with --nnodes > 1)"
    )


def parallel_config_from_args(args: argparse.Namespace) -> ParallelConfig:
    if args.distributed_executor_backend == "ray" and args.nnodes > 1:
        raise ValueError(
            "Ray places the nodes' ranks itself: use --distributed-executor-backend ray "
            "without --nnodes"
        )
    timeout = (
        {}
        if args.distributed_timeout is None
        else {"distributed_timeout_s": args.distributed_timeout}
    )
    return ParallelConfig(
        tensor_parallel_size=args.tp,
        pipeline_parallel_size=args.pp,
        enable_expert_parallel=args.enable_expert_parallel,
        data_parallel_size=args.dp,
        distributed_backend=args.distributed_backend,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        dist_init_addr=args.dist_init_addr,
        distributed_executor_backend=args.distributed_executor_backend,
        ray_placement_strategy=args.ray_placement_strategy,
        ray_address=args.ray_address,
        **timeout,
    )

"""--distributed-executor-backend ray: the worker ranks as Ray actors in a placement group.

Everything after placement is MultiprocExecutor's: one broadcast per step, replies on one socket,
the same worker entry point. What differs is where the ranks run and how their death is seen:

- Placement. The engine core joins the Ray cluster (--ray-address, $RAY_ADDRESS, a cluster running
  on this host, else a new local one) and makes a placement group of one bundle per rank
  ({"CPU": 1}, plus {"GPU": 1} when the cluster has GPUs) with --ray-placement-strategy, or uses the
  placement group it was given (a Ray Serve replica's: frontend/ray_serve/). Ranks are assigned to
  bundles host by host, this host first: a tensor-parallel group stays on one host, and the ranks
  on the engine core's host are the first ones, which read the broadcast from shared memory and
  reply on the IPC socket; the ranks on other hosts read it over ZMQ and reply over TCP, as with
  --nnodes. Each rank's actor is named `tern-worker-<instance>-<rank>` in namespace "tern".
- Health. A rank is alive while its actor's `run` call has not ended: the worker exits the actor
  when it stops, and a killed actor or a lost node ends the call with an error. check_health looks
  at every poll interval, so a dead rank fails the step with WorkerDied as a dead process does.
- Shutdown. The workers are asked to stop as with mp, then every actor is killed, the placement
  group removed (when this executor made it) and the engine core leaves the cluster (stopping it
  when it started it). If the engine core itself dies, Ray removes the actors and the placement
  group it owned.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
from collections.abc import Sequence
from typing import Any

import psutil

from enginecore.config import Config
from enginecore.executor import MultiprocExecutor, free_port, worker_env

logger = logging.getLogger("tern.executor")

RAY_NAMESPACE = "tern"
# The exit code a rank reports when its actor ended: Ray does not say how a process exited.
ACTOR_ENDED = -1


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise RuntimeError(
            "--distributed-executor-backend ray needs Ray: pip install 'tern[ray]'"
        ) from e
    return ray


class RankActor:
    """One rank's actor, with the face of a worker process (what MultiprocExecutor watches)."""

    def __init__(self, name: str, actor: Any, run_ref: Any, pid: int | None) -> None:
        self.name = name
        self.actor = actor
        self.run_ref = run_ref
        self.pid = pid  # only when on this host: MultiprocExecutor checks for SIGSTOP by pid

    def is_alive(self) -> bool:
        import ray

        done, _ = ray.wait([self.run_ref], timeout=0)
        return not done

    @property
    def exitcode(self) -> int | None:
        return None if self.is_alive() else ACTOR_ENDED

    def join(self, timeout: float | None = None) -> None:
        import ray

        ray.wait([self.run_ref], timeout=timeout)

    def terminate(self) -> None:
        self.kill()

    def kill(self) -> None:
        _kill(self.actor)


def _kill(actor: Any) -> None:
    import ray

    with contextlib.suppress(Exception):  # gone already
        ray.kill(actor, no_restart=True)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where each rank runs: bundle_of[rank], host_of[rank] (node IPs), this host's IP."""

    bundle_of: list[int]
    host_of: list[str]
    engine_host: str

    @property
    def hosts(self) -> list[str]:
        return list(dict.fromkeys(self.host_of))  # in rank order: this host first

    @property
    def num_local_ranks(self) -> int:
        return sum(host == self.engine_host for host in self.host_of)


def assign_ranks(
    bundles: Sequence[int], host_of_bundle: dict[int, str], engine_host: str
) -> Placement:
    """Ranks to bundles host by host, this host first, so that ranks of one host are consecutive
    (a tensor-parallel group shares a host) and the first ones read shared memory. Hosts must hold
    as many ranks each (the workers' node layout: ParallelConfig.nnodes)."""
    order = sorted(
        range(len(bundles)),
        key=lambda i: (host_of_bundle[bundles[i]] != engine_host, host_of_bundle[bundles[i]], i),
    )
    bundle_of = [bundles[i] for i in order]
    host_of = [host_of_bundle[b] for b in bundle_of]
    counts = {host: host_of.count(host) for host in host_of}
    if len(set(counts.values())) > 1:
        raise ValueError(
            "the placement group put the ranks unevenly on hosts "
            f"({', '.join(f'{h}: {n}' for h, n in counts.items())}); tern needs as many ranks on "
            "each host: use --ray-placement-strategy STRICT_PACK, or a cluster whose nodes fit "
            "equal shares"
        )
    return Placement(bundle_of, host_of, engine_host)


class RayExecutor(MultiprocExecutor):
    """MultiprocExecutor with the ranks placed by Ray (see the module docstring)."""

    asks_workers_to_stop = False

    def __init__(self, config: Config) -> None:
        self._placement_group: Any = None
        self._owns_placement_group = False
        self._placement: Placement | None = None
        self._actors: list[Any] = []
        self._ray_connected = False
        super().__init__(config)

    def _place_ranks(self, config: Config) -> tuple[str, int]:
        ray = _import_ray()
        parallel = config.parallel
        # NOTE: ray.init installs its own SIGTERM/SIGINT handlers (an abort): the engine core's
        # own ones must stay, or a stop would skip the shutdown below and leave the cluster up.
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        ray.init(
            address=parallel.ray_address,
            namespace=RAY_NAMESPACE,
            ignore_reinit_error=True,
            log_to_driver=False,
            configure_logging=False,
        )
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        self._ray_connected = True
        group, bundles = self._placement_group_and_bundles(ray, config)
        table = ray.util.placement_group_table(group)
        ips = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
        host_of_bundle = {b: ips[table["bundles_to_node_id"][b]] for b in bundles}
        placement = assign_ranks(bundles, host_of_bundle, ray.util.get_node_ip_address())
        self._placement = placement
        logger.info(
            "Ray placed %d ranks: %s",
            len(bundles),
            ", ".join(
                f"rank {r} in bundle {b} on {h}"
                for r, (b, h) in enumerate(zip(placement.bundle_of, placement.host_of))
            ),
        )
        # Other hosts reach this one (the broadcast, the replies, the store) at its node IP.
        remote = placement.num_local_ranks < len(bundles)
        return (placement.engine_host if remote else "127.0.0.1"), placement.num_local_ranks

    def _placement_group_and_bundles(self, ray: Any, config: Config) -> tuple[Any, list[int]]:
        from ray.util.placement_group import PlacementGroup, placement_group

        parallel = config.parallel
        world = parallel.world_size
        if parallel.ray_placement_group is not None:
            from ray._raylet import PlacementGroupID

            group = PlacementGroup(PlacementGroupID.from_hex(parallel.ray_placement_group))
            bundles = list(parallel.ray_bundle_indices or range(world))
        else:
            bundle: dict[str, float] = {"CPU": 1.0}
            if ray.cluster_resources().get("GPU", 0) > 0:
                bundle["GPU"] = 1.0
            group = placement_group([bundle] * world, strategy=parallel.ray_placement_strategy)
            self._owns_placement_group = True
            bundles = list(range(world))
        self._placement_group = group
        try:
            ray.get(group.ready(), timeout=config.startup_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"Ray could not place {world} ranks ({parallel.ray_placement_strategy}) within "
                f"{config.startup_timeout_s:.0f} s; the cluster has {ray.cluster_resources()}, "
                f"of which {ray.available_resources()} are free"
            ) from None
        return group, bundles

    def _with_store(self, config: Config, host: str) -> Config:
        """The store on rank 0's host (this one); ranks on other hosts reply over TCP."""
        assert self._placement is not None
        parallel = config.parallel
        if self._placement.num_local_ranks < parallel.world_size:
            port = self._replies.bind_to_random_port(f"tcp://{host}")
            self._remote_reply_addr = f"tcp://{host}:{port}"
        store_addr = f"{host}:{free_port(host)}"
        return config.replace(parallel=dataclasses.replace(parallel, dist_init_addr=store_addr))

    def _start_workers(self, config: Config) -> None:
        """One actor per rank in its bundle, each running the worker entry point; waits until every
        rank reads the broadcast."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from workers.ray_worker import RayWorker

        placement = self._placement
        assert placement is not None and self._mq is not None
        hosts = placement.hosts
        specs = self._placement_group.bundle_specs
        actor_cls = ray.remote(RayWorker)
        names = [f"tern-worker-{config.instance_id}-{r}" for r in range(len(placement.bundle_of))]
        for name, bundle in zip(names, placement.bundle_of):
            self._actors.append(
                actor_cls.options(
                    name=name,
                    num_cpus=1,
                    num_gpus=1 if specs[bundle].get("GPU", 0) > 0 else 0,
                    max_restarts=0,
                    runtime_env={"env_vars": worker_env()},
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self._placement_group, placement_group_bundle_index=bundle
                    ),
                ).remote()
            )
        pids = ray.get(
            [actor.pid.remote() for actor in self._actors], timeout=config.startup_timeout_s
        )
        for rank, (actor, host) in enumerate(zip(self._actors, placement.host_of)):
            # The workers' node layout: a host is a node (thread counts, shared-memory collectives).
            node_config = config.replace(
                parallel=dataclasses.replace(
                    config.parallel, nnodes=len(hosts), node_rank=hosts.index(host)
                )
            )
            local = host == placement.engine_host
            reply_addr = self._reply_addr if local else self._remote_reply_addr
            run_ref = actor.run.remote(node_config, rank, self._mq.export_handle(), reply_addr)
            name = f"{names[rank]} (Ray actor)"
            self.procs.append(RankActor(name, actor, run_ref, pids[rank] if local else None))
        self._mq.wait_until_ready(timeout=config.startup_timeout_s)

    def shutdown(self) -> None:
        if getattr(self, "_closed", False):
            return
        # The actors are killed (Ray's way to end an actor: an exit of its own reads as a crash
        # in Ray's logs), those whose run never started too; the rest is MultiprocExecutor's.
        for actor in self._actors:
            _kill(actor)
        super().shutdown()
        if not self._ray_connected:
            return
        import ray
        from ray.util.placement_group import remove_placement_group

        if self._owns_placement_group and self._placement_group is not None:
            try:
                remove_placement_group(self._placement_group)
            except Exception:  # noqa: BLE001 - the cluster is gone
                logger.warning("could not remove the placement group", exc_info=True)
        # A cluster this engine core started is its children (GCS, raylet, idle workers):
        # ray.shutdown stops it, and what lingers is reaped here rather than orphaned.
        cluster = psutil.Process().children(recursive=True)
        ray.shutdown()
        self._ray_connected = False
        _, lingering = psutil.wait_procs(cluster, timeout=3.0)
        for proc in lingering:
            with contextlib.suppress(psutil.Error):
                proc.kill()

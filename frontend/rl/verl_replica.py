"""verl's rollout backend "tern": `rollout.name=tern` in a verl config runs tern as the rollout.

Importing this module registers two classes with verl (0.9's registries, as its vLLM and SGLang
backends are registered):

- `TernReplica` (verl.workers.rollout.replica.RolloutReplica, name "tern"): one replica is one
  `tern launch` in a named Ray actor (`TernRolloutActor`, "tern_server_<replica>_0"), started by
  `init_standalone()`. Its flags come from the RolloutConfig (tensor/pipeline/data parallel sizes,
  max_model_len, max_num_seqs, dtype, seed, enable_prefix_caching) and `engine_kwargs.tern`
  (any `tern launch` flag, snake_case; one tern has not is an error). `server_handle.generate`
  is verl's token-in-token-out call (a TokenOutput); `server_address` is the OpenAI server.
  Hybrid and colocated modes put the rollout inside verl's trainer processes; tern runs its own
  processes, so those modes are refused with an error that says so, as is a replica spanning nodes.
- `TernServerAdapter` (verl.workers.rollout.base.BaseRollout, ("tern", "async")): what verl's
  trainer and checkpoint-engine workers call to push weights (`update_weights` from a generator,
  streamed in buckets over HTTP and committed once) and to release/resume memory.

verl pins transformers<5.11 and GPU-only packages, so scripts/setup_env installs it with --no-deps
beside the few packages its rollout interfaces import.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable
from typing import Any

import ray
import torch
from verl.workers.rollout import base as verl_rollout_base
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import (
    RolloutMode,
    RolloutReplica,
    RolloutReplicaRegistry,
    TokenOutput,
)

from frontend.client.trainer import TrainerClient
from frontend.ray_serve.llm_config import TernLLMConfig, engine_argv
from frontend.rl.rollout_server import VerlRolloutServer

NAME = "tern"
# Tern's sleep level for verl's sleep(): the weights stay (in host memory), as a standalone
# rollout is not handed its weights again on wake-up.
SLEEP_LEVEL = 1


def server_actor_name(replica_rank: int) -> str:
    return f"tern_server_{replica_rank}_0"  # verl's <backend>_server_<replica>_<node> (one node)


def max_model_len(config: Any) -> int:
    """The context a RolloutConfig asks for: max_model_len, else prompt plus response length."""
    return config.max_model_len or config.prompt_length + config.response_length


def launch_args(config: Any, model_config: Any) -> list[str]:
    """`tern launch` flags for a verl RolloutConfig and HFModelConfig."""
    defaults = {
        "tensor_parallel_size": config.tensor_model_parallel_size,
        "pipeline_parallel_size": config.pipeline_model_parallel_size,
        "max_model_len": max_model_len(config),
        "max_num_seqs": config.max_num_seqs,
        "dtype": config.dtype,
        "seed": config.seed,
        "enable_prefix_caching": config.enable_prefix_caching,
    }
    model = model_config.local_path or model_config.path
    tern_kwargs = dict((config.engine_kwargs or {}).get(NAME) or {})
    argv = engine_argv(TernLLMConfig(model_id=model, model_source=model, engine_kwargs=tern_kwargs),
                       defaults)  # fmt: skip
    if config.data_parallel_size > 1:
        argv += ["--data-parallel-size", str(config.data_parallel_size)]
    return argv[1:]  # less "launch"


class TernRolloutActor(VerlRolloutServer):
    """One tern server, with the methods verl's RolloutReplica and agent loop call on a server
    actor (those of verl's vLLMHttpServer)."""

    def __init__(self, config: Any, model_config: Any) -> None:
        super().__init__(launch_args(config, model_config))
        self.config = config
        self.global_steps: int | None = None

    def get_server_address(self) -> tuple[str, int]:
        host, port = self.base_url.removeprefix("http://").rsplit(":", 1)
        return host, int(port)

    def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: list[Any] | None = None,
        video_data: list[Any] | None = None,
        audio_data: list[Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        priority: int = 0,
    ) -> TokenOutput:
        if image_data or video_data or audio_data or mm_processor_kwargs:
            raise ValueError("tern's verl rollout takes text prompts only (no multimodal data)")
        if priority:
            raise ValueError("tern does not schedule by priority")
        params = dict(sampling_params)
        room = max_model_len(self.config) - len(prompt_ids)
        if room < 1:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room to generate")
        # verl's rule: max_tokens (or SGLang's max_new_tokens), else the response length.
        max_tokens = params.pop("max_tokens", params.pop("max_new_tokens", None))
        if max_tokens is None:
            max_tokens = min(self.config.response_length,
                             self.config.prompt_length + self.config.response_length - len(prompt_ids))  # fmt: skip
        params["max_tokens"] = max(1, min(max_tokens, room))
        params.setdefault("ignore_eos", bool(self.config.ignore_eos))
        params.setdefault("repetition_penalty", self.config.repetition_penalty)
        params["logprobs"] = 0 if params.pop("logprobs", False) else None
        out = self.complete(prompt_ids, params, request_id)
        return TokenOutput(
            token_ids=out["token_ids"],
            log_probs=out.get("logprobs"),
            stop_reason="aborted" if out["finish_reason"] == "abort" else "completed",
            extra_fields={"global_steps": self.global_steps},
        )

    def wake_up(self, tags: list[str] | None = None) -> None:
        if self.config.free_cache_engine:
            self.client.wake_up(list(tags) if tags else None)
            self.client.reset_prefix_cache()

    def sleep(self) -> None:
        if self.config.free_cache_engine:
            self.client.sleep(level=SLEEP_LEVEL)

    def clear_kv_cache(self) -> None:
        self.client.reset_prefix_cache()

    def release_kv_cache(self) -> None:
        """Frees the KV cache, keeping the weights (for the duration of a weight sync)."""
        if self.config.free_cache_engine:
            self.client.sleep(level=1)
            self.client.wake_up(["weights"])

    def resume_kv_cache(self) -> None:
        if self.config.free_cache_engine:
            self.client.wake_up(["kv_cache"])
            self.client.reset_prefix_cache()

    def abort_all_requests(
        self, reset_prefix_cache: bool = True, reject_request: bool = False
    ) -> dict[str, Any]:
        if reject_request:
            raise ValueError("tern holds requests that arrive while paused; it cannot reject them")
        aborted = super().abort_all_requests()
        if reset_prefix_cache:
            self.client.reset_prefix_cache()
        return aborted

    def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict[str, Any]:
        r = self.client.post("/abort_request", {"request_id": request_id})
        if reset_prefix_cache:
            self.client.reset_prefix_cache()
        return {"aborted": bool(r["aborted"]), "request_id": request_id}

    def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    def start_profile(self, **kwargs: Any) -> None:
        raise NotImplementedError("tern has no profiler hooks for verl (start_profile)")

    def stop_profile(self) -> None:
        raise NotImplementedError("tern has no profiler hooks for verl (stop_profile)")


class TernReplica(RolloutReplica):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.server_class = ray.remote(TernRolloutActor)

    async def init_hybrid(self, worker_group: Any) -> None:
        raise NotImplementedError(_SEPARATE_PROCESSES)

    async def init_hybrid_colocated(self, worker_group: Any, resource_pool: Any) -> None:
        raise NotImplementedError(_SEPARATE_PROCESSES)

    async def init_colocated(self, resource_pool: Any) -> None:
        raise NotImplementedError(_SEPARATE_PROCESSES)

    async def init_standalone(self) -> None:
        """The server's ranks are tern's own worker processes in the actor's node: no verl
        worker group (whose workers ask for GPUs) is made."""
        self.rollout_mode = RolloutMode.STANDALONE
        await self.launch_servers()

    async def launch_servers(self) -> None:
        if self.nnodes != 1:
            raise NotImplementedError(
                f"a tern replica runs on one node ({self.world_size} ranks over "
                f"{self.gpus_per_node} per node); across nodes, set engine_kwargs.tern "
                "distributed_executor_backend: ray"
            )
        server = self.server_class.options(
            name=server_actor_name(self.replica_rank),
            num_cpus=self.world_size,
            max_concurrency=self.max_concurrency,
        ).remote(self.config, self.model_config)
        host, port = await server.get_server_address.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"{host}:{port}"

    async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
        """verl's {"aborted_count", "request_ids"} (the base class returns nothing)."""
        (server,) = self.servers
        return await server.abort_all_requests.remote(reject_request=reject_request)


_SEPARATE_PROCESSES = (
    "tern runs the rollout in processes of its own, not inside verl's trainer workers: use "
    "init_standalone (a standalone rollout)"
)


class TernServerAdapter(BaseRollout):
    """Trainer side: pushes weights to and releases/resumes the replica's tern server (found by
    its actor name). Only rollout rank 0 of a replica talks to the server, as in verl's vLLM
    adapter; the other ranks' calls do nothing."""

    def __init__(
        self, config: Any, model_config: Any, device_mesh: Any, replica_rank: int = -1
    ) -> None:
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", "0"))
        world = (self.config.tensor_model_parallel_size * self.config.data_parallel_size
                 * self.config.pipeline_model_parallel_size)  # fmt: skip
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.is_rank_zero = rank % world == 0
        self._server: Any = None

    @property
    def server(self) -> Any:
        if self._server is None:
            self._server = ray.get_actor(server_actor_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]) -> None:
        if self.is_rank_zero:
            await self.server.wake_up.remote(list(tags))

    async def release(self) -> None:
        if self.is_rank_zero:
            await self.server.sleep.remote()

    async def update_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        wire_format: str = "named_tensors",
        global_steps: int | None = None,
        **kwargs: Any,
    ) -> None:
        if wire_format != "named_tensors":
            raise NotImplementedError(f"tern takes named tensors, not {wire_format!r}")
        if kwargs:
            raise TypeError(f"unexpected arguments: {sorted(kwargs)}")
        if not self.is_rank_zero:
            for _ in weights:  # the generator may gather across ranks: drain it in step
                pass
            return
        host, port = await self.server.get_server_address.remote()
        client = TrainerClient(f"http://{host}:{port}")
        # The generator is read a bucket at a time as the buckets are sent (no full copy).
        await asyncio.to_thread(client.update_weights_from_tensors, weights)
        await self.server.clear_kv_cache.remote()
        if global_steps is not None:
            await self.server.set_global_steps.remote(global_steps)


def _load_replica() -> type[RolloutReplica]:
    return TernReplica


RolloutReplicaRegistry.register(NAME, _load_replica)
verl_rollout_base._ROLLOUT_REGISTRY[(NAME, "async")] = f"{__name__}.TernServerAdapter"

"""The RL framework adapters of frontend/rl against real tern servers: the OpenRLHF-style rollout
engine as a Ray actor (the test process is the trainer, rank 0 of the weight-update group, and
broadcasts each tensor as OpenRLHF's trainer does), and the verl-style server adapter
(update_weights from a generator, release/resume). The oracle is Hugging Face greedy on the
checkpoint the server was updated to."""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest
import torch.distributed as dist
from safetensors.torch import load_file

from enginecore.executor import free_port
from frontend.rl.rollout_server import OpenRLHFRolloutEngine, VerlRolloutServer
from tests.unit.test_engine_inproc import hf_greedy
from workers.weight_sync import init_weights_update_group

ray = pytest.importorskip("ray")

N = 8
PROMPTS = [[101, 2024, 318, 257], [464, 3290, 286, 4881, 318, 6342, 11, 290]]
GREEDY = {"max_tokens": N, "temperature": 0, "ignore_eos": True}


def server_args(model: Path) -> list[str]:
    return ["--model", str(model), "--dtype", "float32", "--kv-cache-memory", "0.25"]


def state_dict(model_dir: Path) -> dict:
    return load_file(next(model_dir.glob("*.safetensors")))


def gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    _, alive = psutil.wait_procs([p for p in map(_proc, pids) if p], timeout=timeout)
    return [p.pid for p in alive if p.status() != psutil.STATUS_ZOMBIE]


def _proc(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


@pytest.fixture(scope="module")
def ray_cluster() -> Any:
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=256 * 2**20,
             runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})  # fmt: skip
    yield
    ray.shutdown()


def test_openrlhf_actor_weight_broadcast(
    ray_cluster: Any, tiny_llama: Path, tiny_llama_perturbed: Path
):
    original = hf_greedy(tiny_llama, PROMPTS, N)
    perturbed = hf_greedy(tiny_llama_perturbed, PROMPTS, N)
    actor = ray.remote(num_cpus=0)(OpenRLHFRolloutEngine).remote(server_args(tiny_llama))
    pids: list[int] = []
    try:
        pids = [*ray.get(actor.pids.remote(), timeout=300),
                ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)]  # fmt: skip

        def generate() -> list[list[int]]:
            refs = [actor.generate.remote(p, GREEDY) for p in PROMPTS]
            return [out["token_ids"] for out in ray.get(refs, timeout=60)]

        assert generate() == original

        # The trainer (this process) is rank 0, the server's one worker rank 1, as in OpenRLHF.
        port = free_port()
        joined = actor.init_process_group.remote("127.0.0.1", port, 1, 2, "openrlhf", None, False)
        group = init_weights_update_group("127.0.0.1", port, 0, 2, "openrlhf", None, 60.0)
        ray.get(joined, timeout=60)
        try:
            for name, tensor in state_dict(tiny_llama_perturbed).items():
                ref = actor.update_weight.remote(name, tensor.dtype, tuple(tensor.shape))
                dist.broadcast(tensor.contiguous(), src=0, group=group)
                ray.get(ref, timeout=60)
        finally:
            dist.destroy_process_group(group)
        ray.get(actor.reset_prefix_cache.remote(), timeout=30)
        assert generate() == perturbed

        ray.get(actor.sleep.remote(1), timeout=60)
        with pytest.raises(ray.exceptions.RayTaskError, match="503"):
            ray.get(actor.generate.remote(PROMPTS[0], GREEDY), timeout=60)
        ray.get(actor.wake_up.remote(), timeout=60)
        ray.get(actor.reset_prefix_cache.remote(), timeout=30)
        assert generate() == perturbed
        with pytest.raises(ray.exceptions.RayTaskError, match="unsupported sampling"):
            ray.get(actor.generate.remote(PROMPTS[0], {"best_of": 2}), timeout=60)
    finally:
        ray.kill(actor)  # no shutdown(): the server goes with the actor's process
    assert pids and gone(pids, timeout=30) == []


def test_verl_adapter_update_from_generator_and_release(
    tiny_llama: Path, tiny_llama_perturbed: Path
):
    original = hf_greedy(tiny_llama, PROMPTS, N)
    perturbed = hf_greedy(tiny_llama_perturbed, PROMPTS, N)
    server = VerlRolloutServer(server_args(tiny_llama))
    pids: list[int] = []
    try:
        pids = server.pids()

        def generate() -> list[list[int]]:
            return [server.generate(p, GREEDY, request_id=None)["token_ids"] for p in PROMPTS]

        assert generate() == original
        server.update_weights(iter(state_dict(tiny_llama_perturbed).items()), bucket_bytes=1 << 20)
        assert generate() == perturbed

        # verl's hybrid-engine cycle: release, weights back, new weights, then the KV cache.
        server.release()
        server.resume(["weights"])
        server.update_weights(kv for kv in state_dict(tiny_llama).items())
        server.resume(["kv_cache"])
        assert generate() == original

        # A long request in flight is aborted (and says so); generation then waits for resume.
        with ThreadPoolExecutor(1) as pool:
            long = pool.submit(
                server.generate, PROMPTS[0], {"max_tokens": 1500, "ignore_eos": True}, "long-1"
            )
            deadline = time.monotonic() + 60
            aborted = {"aborted_count": 0}
            while not aborted["aborted_count"] and time.monotonic() < deadline:
                time.sleep(0.2)
                aborted = server.abort_all_requests()
                if not aborted["aborted_count"]:
                    server.resume_generation()
            assert aborted["aborted_count"] == 1, aborted
            assert long.result(timeout=60)["finish_reason"] == "abort"
        server.resume_generation()
        assert generate() == original
    finally:
        server.shutdown()
    assert gone(pids) == []


def test_verl_replica_registered_as_tern(
    ray_cluster: Any, tiny_llama: Path, tiny_llama_perturbed: Path
):
    """verl's own classes drive tern: the replica verl builds for `rollout.name=tern`, its
    token-in-token-out server handle, the OpenAI address, and the server adapter verl's trainer
    pushes weights through."""
    pytest.importorskip("verl")
    from verl.workers.config import HFModelConfig, RolloutConfig
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import get_rollout_replica_class

    from frontend.rl.verl_replica import TernReplica, TernServerAdapter

    assert get_rollout_replica_class("tern") is TernReplica
    assert get_rollout_class("tern", "async") is TernServerAdapter
    original = hf_greedy(tiny_llama, PROMPTS, N)
    perturbed = hf_greedy(tiny_llama_perturbed, PROMPTS, N)
    config = RolloutConfig(name="tern", tensor_model_parallel_size=1, prompt_length=64,
                           response_length=N, max_model_len=2048, max_num_seqs=8, dtype="float32",
                           ignore_eos=True, engine_kwargs={"tern": {"kv_cache_memory": 0.25}})  # fmt: skip
    model_config = HFModelConfig(path=str(tiny_llama))
    replica = get_rollout_replica_class("tern")(0, config, model_config, gpus_per_node=1)
    with pytest.raises(NotImplementedError, match="standalone"):
        asyncio.run(replica.init_hybrid(None))
    asyncio.run(replica.init_standalone())
    server = replica.server_handle
    pids: list[int] = []
    try:
        pids = [*ray.get(server.pids.remote(), timeout=60),
                ray.get(server.__ray_call__.remote(lambda self: os.getpid()), timeout=30)]  # fmt: skip

        def generate(params: dict[str, Any] | None = None) -> list[Any]:
            refs = [server.generate.remote(prompt_ids=p, sampling_params=dict(params or {"temperature": 0.0}),
                                           request_id=f"verl-{i}") for i, p in enumerate(PROMPTS)]  # fmt: skip
            return ray.get(refs, timeout=60)

        outs = generate()
        assert [o.token_ids for o in outs] == original
        assert {o.stop_reason for o in outs} == {"completed"}
        (logprobs, _) = generate({"temperature": 0.0, "logprobs": True})
        assert len(logprobs.log_probs) == N and all(lp <= 0 for lp in logprobs.log_probs)

        # verl's chat/completions clients use server_address as an OpenAI server.
        client = openai.OpenAI(base_url=f"http://{replica.server_address}/v1", api_key="none")
        done = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPTS[1],
                                         max_tokens=N, temperature=0,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
        assert done.choices[0].model_extra["token_ids"] == original[1]

        # The trainer side: weights from a generator, committed once; the steps are reported.
        adapter = get_rollout_class("tern", "async")(config, model_config, None, replica_rank=0)
        weights = state_dict(tiny_llama_perturbed)
        asyncio.run(adapter.update_weights((kv for kv in weights.items()), global_steps=3))
        outs = generate()
        assert [o.token_ids for o in outs] == perturbed
        assert outs[0].extra_fields["global_steps"] == 3

        # A weight sync with the KV cache freed, then release/resume through the adapter.
        asyncio.run(replica.release_kv_cache())
        asyncio.run(replica.resume_kv_cache())
        asyncio.run(adapter.release())
        asyncio.run(adapter.resume(["weights"]))
        asyncio.run(adapter.update_weights(iter(state_dict(tiny_llama).items())))
        asyncio.run(adapter.resume(["kv_cache"]))
        assert [o.token_ids for o in generate()] == original

        # Partial rollout: abort what is in flight (it says "aborted"), resume, generate again.
        long = server.generate.remote(prompt_ids=PROMPTS[0], request_id="verl-long",
                                      sampling_params={"max_tokens": 1500})  # fmt: skip
        deadline = time.monotonic() + 60
        aborted = {"aborted_count": 0}
        while not aborted["aborted_count"] and time.monotonic() < deadline:
            time.sleep(0.2)
            aborted = asyncio.run(replica.abort_all_requests())
            if not aborted["aborted_count"]:
                asyncio.run(replica.resume_generation())
        assert aborted["aborted_count"] == 1, aborted
        assert ray.get(long, timeout=60).stop_reason == "aborted"
        asyncio.run(replica.resume_generation())
        assert [o.token_ids for o in generate()] == original
    finally:
        ray.kill(server)  # the server goes with the actor's process
    assert pids and gone(pids, timeout=30) == []

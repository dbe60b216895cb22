"""Thin rollout-engine adapters over a tern server, for RL frameworks that run on Ray.

`TernRolloutServer` owns one `tern launch` process (LaunchedServer, on a free port) and speaks to it
through TrainerClient. Two faces over it:

- `OpenRLHFRolloutEngine`: OpenRLHF's rollout-engine methods (openrlhf/trainer/ray/vllm_engine.py,
  LLMRayActor): init_process_group(master_address, master_port, rank_offset, world_size,
  group_name, backend, use_ray), update_weight(name, dtype, shape, empty_cache=False),
  reset_prefix_cache(), pause_generation(), resume_generation(), sleep(level=1),
  wake_up(tags=None), generate(prompt_token_ids, sampling_params). Wrap it with `ray.remote`.
  OpenRLHF itself needs vLLM and deepspeed (GPU wheels), so it is not installed here: this class
  follows its documented interface, with `sampling_params` as a dict of vLLM SamplingParams
  fields (max_tokens, temperature, top_p, top_k, seed, stop, ignore_eos, repetition_penalty,
  logprobs).
- `VerlRolloutServer`: the server-adapter methods of verl's vLLM/SGLang async servers
  (verl/workers/rollout/vllm_rollout/vllm_async_server.py): update_weights(weights) from a
  generator of (name, tensor), release() (sleep), resume(tags), abort_all_requests(),
  resume_generation(), generate(prompt_ids, sampling_params, request_id). verl's own
  RolloutReplica and server adapter, registered as "tern", are in frontend/rl/verl_replica.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import httpx
import torch

from frontend.client.launched_server import LaunchedServer
from frontend.client.trainer import DEFAULT_BUCKET_BYTES, TrainerClient

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos",
                   "repetition_penalty", "logprobs")  # fmt: skip


class TernRolloutServer:
    """Launches a tern server (`args`: `tern launch` flags) and stops it, with its children."""

    def __init__(self, args: Sequence[str], ready_timeout: float = 300.0) -> None:
        # The server gets SIGKILL when its parent dies, so a killed Ray actor leaves no server.
        self.server = LaunchedServer(list(args), wrapper=("setpriv", "--pdeathsig", "KILL"))
        try:
            self.server.wait_ready(timeout=ready_timeout)
        except BaseException:
            self.server.shut_down()
            raise
        self.client = TrainerClient(self.server.base_url)
        self.model = self.client.get("/v1/models")["data"][0]["id"]

    @property
    def base_url(self) -> str:
        return self.server.base_url

    def pids(self) -> list[int]:
        """The server's process and its descendants (for checks that none survives)."""
        self.server.record_descendants()
        return [self.server.proc.pid, *self.server.descendants]

    def complete(
        self,
        prompt_token_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str | None = None,
    ) -> dict:
        unknown = set(sampling_params) - set(SAMPLING_FIELDS)
        if unknown:
            raise ValueError(f"unsupported sampling params: {sorted(unknown)}")
        params = {k: v for k, v in sampling_params.items() if v is not None}
        body = {"model": self.model, "prompt": list(prompt_token_ids), "return_token_ids": True,
                "request_id": request_id, **params}  # fmt: skip
        r = httpx.post(f"{self.base_url}/v1/completions", json=body, timeout=self.client.timeout)
        if r.status_code != 200:
            raise RuntimeError(f"generate failed ({r.status_code}): {r.text}")
        choice = r.json()["choices"][0]
        out = {"token_ids": choice["token_ids"], "text": choice["text"],
               "finish_reason": choice["finish_reason"]}  # fmt: skip
        if "logprobs" in params:  # the sampled tokens' logprobs
            out["logprobs"] = choice["logprobs"]["token_logprobs"]
        return out

    def shutdown(self) -> None:
        """Stops the server; RuntimeError if any of its processes survives."""
        survivors = self.server.shut_down()
        if survivors:
            raise RuntimeError(f"tern server processes survived: {[p.pid for p in survivors]}")


class OpenRLHFRolloutEngine(TernRolloutServer):
    def init_process_group(
        self, master_address, master_port, rank_offset, world_size, group_name, backend, use_ray
    ) -> None:
        if use_ray:
            raise ValueError("use_ray=True (a ray.util.collective group) is not supported by tern")
        self.client.post("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port,
            "rank_offset": rank_offset, "world_size": world_size, "group_name": group_name,
            "backend": backend})  # fmt: skip
        self._group_name = group_name

    def update_weight(self, name, dtype, shape, empty_cache=False) -> None:
        """Receives one tensor broadcast by the trainer (rank 0) and loads it (committed)."""
        dtype_name = str(dtype).removeprefix("torch.")
        self.client.post("/update_weights_from_distributed", {
            "names": [name], "dtypes": [dtype_name], "shapes": [list(shape)],
            "group_name": self._group_name})  # fmt: skip

    def reset_prefix_cache(self) -> None:
        self.client.reset_prefix_cache()

    def pause_generation(self) -> None:
        self.client.pause(mode="keep")

    def resume_generation(self) -> None:
        self.client.resume()

    def sleep(self, level=1) -> None:
        self.client.sleep(level=level)

    def wake_up(self, tags=None) -> None:
        self.client.wake_up(tags)

    def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None) -> dict:
        if multi_modal_data:
            raise ValueError("multi_modal_data is not supported by this adapter")
        return self.complete(prompt_token_ids, dict(sampling_params))


class VerlRolloutServer(TernRolloutServer):
    def update_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> dict[str, Any]:
        """Loads (name, tensor) pairs from a generator, read and sent a bucket at a time; one
        commit at the end (a failure leaves the old weights)."""
        return self.client.update_weights_from_tensors(weights, bucket_bytes=bucket_bytes)

    def release(self, level: int = 2) -> None:
        """Sleeps: level 2 (verl's default for a hybrid engine) also drops the weights, so a
        resume(["weights"]) is followed by update_weights before resume(["kv_cache"])."""
        self.client.sleep(level=level)

    def resume(self, tags: list[str]) -> None:
        self.client.wake_up(list(tags))

    def abort_all_requests(self) -> dict[str, Any]:
        """Aborts what is in flight (each ends with finish_reason "abort") and holds new requests
        until resume_generation: verl's {"aborted_count", "request_ids"}."""
        aborted = self.client.post("/abort_request", {"abort_all": True})["aborted"]
        self.client.pause(mode="abort")  # and whatever arrived in between
        return {"aborted_count": len(aborted), "request_ids": aborted}

    def resume_generation(self) -> None:
        self.client.resume()

    def generate(self, prompt_ids, sampling_params, request_id=None) -> dict:
        return self.complete(prompt_ids, dict(sampling_params), request_id)

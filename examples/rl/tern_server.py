"""The trainer's side of tern: start (or attach to) a server, sample rollouts with token ids and
logprobs, push weights (a torch.distributed broadcast or /dev/shm files) or only a LoRA adapter
(the same broadcast, or safetensors over HTTP), sleep and wake.

Everything goes through frontend/client/trainer.py and the public HTTP API, as an external
trainer would; the server runs as a subprocess (frontend/client/launched_server.py).
"""

from __future__ import annotations

import contextlib
import os
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from frontend.client.launched_server import LaunchedServer, free_port
from frontend.client.trainer import TrainerClient

# Rollouts are a few dozen short sequences: a small KV cache leaves RAM to the trainer.
KV_CACHE_GIB = 0.25


def launch(
    model: str,
    dtype: str,
    seed: int,
    quantization: str | None = None,
    max_lora_rank: int | None = None,
    batch_invariant: bool = False,
) -> LaunchedServer:
    """A tern server for the rollouts, owned by this script (stop it with shut_down());
    `max_lora_rank`: it serves LoRA adapters up to that rank; `batch_invariant`: each rollout's
    logprobs independent of the rest of the batch (--batch-invariant)."""
    args = ["--model", model, "--dtype", dtype, "--seed", str(seed),
            "--kv-cache-memory", str(KV_CACHE_GIB)]  # fmt: skip
    if quantization is not None:
        args += ["--quantization", quantization]
    if max_lora_rank is not None:
        args += ["--enable-lora", "--max-lora-rank", str(max_lora_rank)]
    if batch_invariant:
        args.append("--batch-invariant")
    return LaunchedServer(args, log_prefix="tern-rl-server-")


@dataclass
class Rollout:
    """One sampled completion: tern's token ids and their logprobs under the serving weights."""

    prompt_index: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    text: str


def sample(
    client: TrainerClient,
    model_name: str,
    prompts: list[list[int]],
    n: int,
    max_tokens: int,
    seed: int,
) -> tuple[list[Rollout], dict[str, str]]:
    """n samples of each prompt at temperature 1 with no top-k/top-p/min-p, so that the returned
    logprobs (tern's raw logprobs) are those of the distribution the tokens were drawn from; and
    the versions they ran on: weight_version, and lora_version when `model_name` is an adapter."""
    body = {
        "model": model_name, "prompt": prompts, "n": n, "max_tokens": max_tokens,
        "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "seed": seed,
        "logprobs": 0, "return_token_ids": True,
    }  # fmt: skip
    response = client.post("/v1/completions", body)
    rollouts = []
    for choice in sorted(response["choices"], key=lambda c: c["index"]):
        i = choice["index"] // n  # vLLM's order: prompt index x n + sample index
        token_ids, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
        assert len(token_ids) == len(logprobs), (len(token_ids), len(logprobs))
        rollouts.append(Rollout(i, prompts[i], token_ids, logprobs, choice["text"]))
    versions = {k: response[k] for k in ("weight_version", "lora_version") if k in response}
    return rollouts, versions


def greedy(
    client: TrainerClient, model_name: str, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    body = {"model": model_name, "prompt": prompts, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    choices = sorted(client.post("/v1/completions", body)["choices"], key=lambda c: c["index"])
    return [c["token_ids"] for c in choices]


class WeightSync:
    """Pushes the trainer's weights: "distributed" broadcasts over a process group the trainer
    joins as rank 0; "shm" writes safetensors files to /dev/shm that the server loads. A LoRA
    adapter goes over the same group with "distributed", as safetensors bytes over HTTP with
    "shm" (tern loads adapters from a path or from tensors, not from /dev/shm files)."""

    def __init__(self, client: TrainerClient, mode: str) -> None:
        if mode not in ("distributed", "shm"):
            raise ValueError(f"unknown weight sync mode {mode!r}")
        self.client = client
        self.mode = mode
        if mode == "distributed":
            parallel = client.get("/server_info")["config"]["parallel"]
            world = parallel["tensor_parallel_size"] * parallel["pipeline_parallel_size"]
            client.init_weights_update_group("127.0.0.1", free_port(), tern_world_size=world,
                                             group_name=f"rl-{os.getpid()}", timeout_s=120)  # fmt: skip

    def push(self, tensors: Mapping[str, torch.Tensor], version: str) -> None:
        if self.mode == "distributed":
            self.client.update_weights_from_distributed(tensors, weight_version=version)
        else:
            self.client.update_weights_from_tensors(tensors, load_format="shm",
                                                    weight_version=version)  # fmt: skip

    def push_lora(self, name: str, peft_model: torch.nn.Module, version: str) -> None:
        """Only the adapter's tensors travel; `name` serves them as `version` from now on."""
        via = "distributed" if self.mode == "distributed" else "http"
        served = self.client.update_lora(name, peft_model, version=version, via=via)
        assert served["version"] == version, served

    def close(self) -> None:
        if self.mode == "distributed":
            with contextlib.suppress(OSError, urllib.error.URLError, RuntimeError):
                self.client.destroy_weights_update_group()

"""What an RL trainer imports to push weights into a running tern server (no server code runs here).

    client = TrainerClient("http://127.0.0.1:8000", api_key=None)
    client.update_weights_from_disk("/ckpt/step_100")                 # a checkpoint directory
    client.update_weights_from_tensors(model.state_dict())            # base64 safetensors over HTTP
    client.update_weights_from_tensors(sd, load_format="shm")         # same host: files in /dev/shm
    client.init_weights_update_group("127.0.0.1", 29600, tern_world_size=2)
    client.update_weights_from_distributed(model.state_dict())        # torch.distributed broadcast
    client.destroy_weights_update_group()

Every multi-bucket update is one transaction on the server: buckets carry `finished: false` but the
last, generation waits meanwhile, and a failure restores the old weights. The distributed path joins
the trainer as rank 0 of a group rendezvoused exactly as SGLang's trainers do (workers/weight_sync.py):
use `init_weights_update_group` here rather than torch.distributed.init_process_group.
Only the standard library, torch and safetensors are used.
"""

from __future__ import annotations

import base64
import json
import os
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save, save_file

from workers.weight_sync import (
    destroy_weights_update_group,
    flattened_bucket,
    init_weights_update_group,
)

DEFAULT_BUCKET_BYTES = 256 << 20


class TernAPIError(RuntimeError):
    def __init__(self, status: int, body: Any) -> None:
        message = body.get("error", {}).get("message") if isinstance(body, dict) else body
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.body = body


def buckets(
    state_dict: Mapping[str, torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[dict[str, torch.Tensor]]:
    """Consecutive groups of tensors of at most bucket_bytes each (a bigger tensor goes alone)."""
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = tensor
        size += nbytes
    if bucket:
        yield bucket


class TrainerClient:
    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 3600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self._group: dist.ProcessGroup | None = None
        self._group_name: str | None = None

    # ------------------------------------------------------------------ HTTP

    def post(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        return self._request("POST", path, body or {})

    def get(self, path: str) -> dict[str, Any]:
        return self._request("GET", path, None)

    def _request(self, method: str, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as e:
            payload = e.read()
            try:
                parsed: Any = json.loads(payload)
            except ValueError:
                parsed = payload.decode(errors="replace")
            raise TernAPIError(e.code, parsed) from None

    # ------------------------------------------------------------------ control

    def pause(self, mode: str = "abort") -> dict[str, Any]:
        return self.post("/pause_generation", {"mode": mode})

    def resume(self) -> dict[str, Any]:
        return self.post("/resume_generation")

    def sleep(self, level: int = 1) -> dict[str, Any]:
        return self.post("/sleep", {"level": level})

    def wake_up(self, tags: list[str] | None = None) -> dict[str, Any]:
        return self.post("/wake_up", {"tags": tags} if tags else {})

    def weight_version(self) -> str:
        return self.get("/weight_version")["weight_version"]

    # ------------------------------------------------------------------ weight updates

    def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None
    ) -> dict[str, Any]:
        return self.post(
            "/update_weights_from_disk",
            {"model_path": model_path, "weight_version": weight_version},
        )

    def update_weights_from_tensors(
        self,
        state_dict: Mapping[str, torch.Tensor],
        load_format: str = "safetensors",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        weight_version: str | None = None,
    ) -> dict[str, Any]:
        """Sends the tensors in buckets; "shm" writes them to /dev/shm for a server on this host."""
        if load_format not in ("safetensors", "shm"):
            raise ValueError("load_format must be 'safetensors' or 'shm'")
        parts = list(buckets(state_dict, bucket_bytes))
        result: dict[str, Any] = {}
        for i, part in enumerate(parts):
            tensors = {k: v.detach().contiguous().cpu() for k, v in part.items()}
            path = None
            if load_format == "shm":
                path = os.path.join("/dev/shm", f"tern-weights-{uuid.uuid4().hex}.safetensors")
                save_file(tensors, path)
                payload = path
            else:
                payload = base64.b64encode(save(tensors)).decode()
            try:
                result = self.post(
                    "/update_weights",
                    {
                        "serialized_named_tensors": [payload],
                        "load_format": load_format,
                        "finished": i == len(parts) - 1,
                        "weight_version": weight_version,
                    },
                )
            finally:
                if path is not None:
                    os.unlink(path)  # the server has loaded it (or failed): the file is done
        return result

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        tern_world_size: int,
        group_name: str = "weight_update_group",
        backend: str | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        """Joins as rank 0 while the server's workers join as ranks 1..tern_world_size."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": 1,
            "world_size": tern_world_size + 1,
            "group_name": group_name,
            "backend": backend,
            "timeout_s": timeout_s,
        }
        with _InBackground(self.post, "/init_weights_update_group", body) as call:
            self._group = init_weights_update_group(
                master_address, master_port, 0, tern_world_size + 1, group_name, backend, timeout_s
            )
        call.result()
        self._group_name = group_name

    def update_weights_from_distributed(
        self,
        state_dict: Mapping[str, torch.Tensor],
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        weight_version: str | None = None,
        load_format: str | None = None,
    ) -> dict[str, Any]:
        """Broadcasts the tensors bucket by bucket; load_format "flattened_bucket" (SGLang's) sends
        each bucket as one flat tensor, one collective per bucket instead of one per tensor."""
        if self._group is None:
            raise RuntimeError("call init_weights_update_group first")
        parts = list(buckets(state_dict, bucket_bytes))
        result: dict[str, Any] = {}
        for i, part in enumerate(parts):
            body = {
                "names": list(part),
                "dtypes": [str(t.dtype).removeprefix("torch.") for t in part.values()],
                "shapes": [list(t.shape) for t in part.values()],
                "group_name": self._group_name,
                "finished": i == len(parts) - 1,
                "weight_version": weight_version,
                "load_format": load_format,
            }
            tensors = [t.detach().contiguous() for t in part.values()]
            if load_format == "flattened_bucket":
                tensors = [flattened_bucket(tensors)]
            with _InBackground(self.post, "/update_weights_from_distributed", body) as call:
                for tensor in tensors:
                    dist.broadcast(tensor, src=0, group=self._group)
            result = call.result()
        return result

    def destroy_weights_update_group(self) -> None:
        if self._group is None:
            return
        self.post("/destroy_weights_update_group", {"group_name": self._group_name})
        destroy_weights_update_group(self._group)
        self._group = None


class _InBackground:
    """Runs one HTTP call in a thread while the caller takes part in a collective."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self._thread = threading.Thread(target=self._run, args=(fn, *args), daemon=True)
        self._result: Any = None
        self._error: BaseException | None = None

    def _run(self, fn: Any, *args: Any) -> None:
        try:
            self._result = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to result()
            self._error = e

    def __enter__(self) -> _InBackground:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.join()

    def result(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._result


__all__ = ["TrainerClient", "TernAPIError", "buckets"]

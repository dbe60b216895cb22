"""What an RL trainer imports to push weights into a running tern server (no server code runs here).

    client = TrainerClient("http://127.0.0.1:8000", api_key=None)
    client.update_weights_from_disk("/ckpt/step_100")                 # a checkpoint directory
    client.update_weights_from_tensors(model.state_dict())            # base64 safetensors over HTTP
    client.update_weights_from_tensors(sd, load_format="shm")         # same host: files in /dev/shm
    client.init_weights_update_group("127.0.0.1", 29600, tern_world_size=2)
    client.update_weights_from_distributed(model.state_dict())        # torch.distributed broadcast
    client.destroy_weights_update_group()
    client.update_lora("policy", peft_model, version="step-3")        # only the adapter's tensors

Every multi-bucket update is one transaction on the server: buckets carry `finished: false` but the
last, generation waits meanwhile, and a failure restores the old weights.

Several servers (replicas behind a router, on several hosts) are one client:

    client = TrainerClient(["http://hostB:8000", "http://hostC:8000"])

and every call applies to all of them as one transaction. A weight update is two-phase: every bucket
goes to every server with `finished: false` (prepare: each server loads and holds the new weights,
generation waits), then POST /finish_weights_update commits on every server; if any server fails
to prepare, the others are rolled back (`{"commit": false}`) and every server keeps the old weights
and one weight_version. pause and sleep are undone on the servers where they succeeded when another
failed (resume, wake_up); a failure raises MultiServerError naming each server's error. The distributed path joins
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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
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


class MultiServerError(RuntimeError):
    """A call failed on some servers; `errors` maps each failed server's URL to its error."""

    def __init__(self, what: str, errors: dict[str, BaseException]) -> None:
        detail = "; ".join(f"{url}: {e}" for url, e in errors.items())
        super().__init__(f"{what} failed on {len(errors)} server(s): {detail}")
        self.errors = errors


NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def buckets(
    state_dict: NamedTensors, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[dict[str, torch.Tensor]]:
    """Consecutive groups of tensors of at most bucket_bytes each (a bigger tensor goes alone).
    `state_dict` may be a generator of (name, tensor) (verl's): it is read as the buckets go."""
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    items = state_dict.items() if isinstance(state_dict, Mapping) else state_dict
    for name, tensor in items:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = tensor
        size += nbytes
    if bucket:
        yield bucket


class TrainerClient:
    def __init__(
        self, base_url: str | Sequence[str], api_key: str | None = None, timeout: float = 3600.0
    ) -> None:
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not urls:
            raise ValueError("TrainerClient needs at least one server URL")
        self.base_urls = [url.rstrip("/") for url in urls]
        self.base_url = self.base_urls[0]
        self.api_key = api_key
        self.timeout = timeout
        self._group: dist.ProcessGroup | None = None
        self._group_name: str | None = None

    # ------------------------------------------------------------------ HTTP

    def post(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """POSTs to every server; the first server's answer (MultiServerError if any failed)."""
        return self._all("POST", path, body or {})[0]

    def get(self, path: str) -> dict[str, Any]:
        return self._all("GET", path, None)[0]

    def _all(
        self, method: str, path: str, body: dict[str, Any] | None, urls: Sequence[str] = ()
    ) -> list[dict[str, Any]]:
        """The call on every server (`urls`: these only), concurrently; raises the only error,
        or MultiServerError when several servers are addressed."""
        urls = list(urls or self.base_urls)
        results, errors = self._fan_out(lambda url: self._request(url, method, path, body), urls)
        if errors:
            if len(urls) == 1:
                raise next(iter(errors.values()))
            raise MultiServerError(f"{method} {path}", errors)
        return [results[url] for url in urls]

    @staticmethod
    def _fan_out(
        fn: Callable[[str], Any], urls: Sequence[str]
    ) -> tuple[dict[str, Any], dict[str, BaseException]]:
        results: dict[str, Any] = {}
        errors: dict[str, BaseException] = {}
        if len(urls) == 1:  # no thread for the common case
            try:
                results[urls[0]] = fn(urls[0])
            except Exception as e:  # noqa: BLE001 - reported by the caller
                errors[urls[0]] = e
            return results, errors
        with ThreadPoolExecutor(len(urls)) as pool:
            futures = {url: pool.submit(fn, url) for url in urls}
        for url, future in futures.items():
            error = future.exception()
            if error is None:
                results[url] = future.result()
            else:
                errors[url] = error
        return results, errors

    def _request(
        self, base_url: str, method: str, path: str, body: dict[str, Any] | None
    ) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(base_url + path, data=data, method=method)
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

    def _undoable(
        self, path: str, body: dict[str, Any], undo_path: str, undo_body: dict[str, Any]
    ) -> dict[str, Any]:
        """`path` on every server; where it failed anywhere, `undo_path` on those it changed."""
        urls = self.base_urls
        results, errors = self._fan_out(lambda url: self._request(url, "POST", path, body), urls)
        if not errors:
            return results[urls[0]]
        if results:
            self._all("POST", undo_path, undo_body, urls=list(results))
        if len(urls) == 1:
            raise next(iter(errors.values()))
        raise MultiServerError(f"POST {path} (undone on the others)", errors)

    def pause(self, mode: str = "abort") -> dict[str, Any]:
        return self._undoable("/pause_generation", {"mode": mode}, "/resume_generation", {})

    def resume(self) -> dict[str, Any]:
        return self.post("/resume_generation")

    def sleep(self, level: int = 1) -> dict[str, Any]:
        tags = ["kv_cache", "weights"][:level]
        return self._undoable("/sleep", {"level": level}, "/wake_up", {"tags": tags})

    def wake_up(self, tags: list[str] | None = None) -> dict[str, Any]:
        return self.post("/wake_up", {"tags": tags} if tags else {})

    def reset_prefix_cache(self) -> dict[str, Any]:
        return self.post("/reset_prefix_cache")

    def weight_versions(self) -> list[str]:
        """Each server's weight version, in the order of the URLs."""
        return [r["weight_version"] for r in self._all("GET", "/weight_version", None)]

    def weight_version(self) -> str:
        """The servers' common weight version (RuntimeError if they differ)."""
        versions = self.weight_versions()
        if len(set(versions)) != 1:
            raise RuntimeError(f"the servers hold different weights: {versions}")
        return versions[0]

    # ------------------------------------------------------------------ transactions

    def _prepare(self, path: str, body: dict[str, Any], is_open: set[str]) -> None:
        """One prepare call (finished=false) on every server; on any failure, rolls back every
        server whose update is open (a failed server has rolled itself back) and raises."""
        prepare = {**body, "finished": False}
        urls = self.base_urls
        results, errors = self._fan_out(lambda url: self._request(url, "POST", path, prepare), urls)
        is_open.update(results)
        is_open.difference_update(errors)
        if errors:
            self.abort_update(is_open)
            if len(urls) == 1:
                raise next(iter(errors.values()))
            raise MultiServerError(f"POST {path} (rolled back everywhere)", errors)

    def abort_update(self, urls: Sequence[str] | set[str] | None = None) -> None:
        """Rolls back the open weight update on `urls` (None: every server)."""
        targets = self.base_urls if urls is None else list(urls)
        if targets:
            self._all("POST", "/finish_weights_update", {"commit": False}, urls=targets)

    def _commit(self, weight_version: str | None) -> dict[str, Any]:
        body = {"commit": True, "weight_version": weight_version}
        return self.post("/finish_weights_update", body)

    # ------------------------------------------------------------------ weight updates

    def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None
    ) -> dict[str, Any]:
        """Every server loads the checkpoint (its own path: each host needs the files), then all
        commit; if any server fails to load, none changes."""
        body = {"model_path": model_path, "weight_version": weight_version}
        if len(self.base_urls) == 1:
            return self.post("/update_weights_from_disk", body)
        self._prepare("/update_weights_from_disk", body, set())
        return self._commit(weight_version)

    def update_weights_from_tensors(
        self,
        state_dict: NamedTensors,
        load_format: str = "safetensors",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        weight_version: str | None = None,
    ) -> dict[str, Any]:
        """Sends the tensors in buckets; "shm" writes them to /dev/shm for a server on this host.
        A generator of (name, tensor) is read one bucket at a time."""
        if load_format not in ("safetensors", "shm"):
            raise ValueError("load_format must be 'safetensors' or 'shm'")
        is_open: set[str] = set()  # servers holding an uncommitted update
        sent = 0
        for part in buckets(state_dict, bucket_bytes):
            sent += 1
            tensors = {k: v.detach().contiguous().cpu() for k, v in part.items()}
            path = None
            if load_format == "shm":
                path = os.path.join("/dev/shm", f"tern-weights-{uuid.uuid4().hex}.safetensors")
                save_file(tensors, path)
                payload = path
            else:
                payload = base64.b64encode(save(tensors)).decode()
            body = {"serialized_named_tensors": [payload], "load_format": load_format}
            try:
                self._prepare("/update_weights", body, is_open)
            finally:
                if path is not None:
                    os.unlink(path)  # the servers have loaded it (or failed): the file is done
        if not sent:
            raise ValueError("the state dict is empty")
        return self._commit(weight_version)

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        tern_world_size: int | Sequence[int],
        group_name: str = "weight_update_group",
        backend: str | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        """Joins as rank 0; server i's workers (tern_world_size[i] of them: tp x pp) join as the
        ranks after those of servers 0..i-1, so one broadcast reaches every server."""
        sizes = [tern_world_size] if isinstance(tern_world_size, int) else list(tern_world_size)
        if len(sizes) == 1:
            sizes *= len(self.base_urls)
        if len(sizes) != len(self.base_urls):
            raise ValueError("tern_world_size: one size, or one per server")
        world_size = 1 + sum(sizes)
        bodies = {}
        for i, url in enumerate(self.base_urls):
            bodies[url] = {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": 1 + sum(sizes[:i]),
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
                "timeout_s": timeout_s,
            }

        def join_all() -> None:
            _, errors = self._fan_out(
                lambda url: self._request(url, "POST", "/init_weights_update_group", bodies[url]),
                self.base_urls,
            )
            if errors:
                raise MultiServerError("POST /init_weights_update_group", errors)

        with _InBackground(join_all) as call:
            self._group = init_weights_update_group(
                master_address, master_port, 0, world_size, group_name, backend, timeout_s
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
        if not parts:
            raise ValueError("the state dict is empty")
        is_open: set[str] = set()
        for part in parts:
            body = {
                "names": list(part),
                "dtypes": [str(t.dtype).removeprefix("torch.") for t in part.values()],
                "shapes": [list(t.shape) for t in part.values()],
                "group_name": self._group_name,
                "load_format": load_format,
            }
            tensors = [t.detach().contiguous() for t in part.values()]
            if load_format == "flattened_bucket":
                tensors = [flattened_bucket(tensors)]
            path = "/update_weights_from_distributed"
            with _InBackground(self._prepare, path, body, is_open) as call:
                for tensor in tensors:  # one broadcast reaches every server's workers
                    dist.broadcast(tensor, src=0, group=self._group)
            call.result()
        return self._commit(weight_version)

    # ------------------------------------------------------------------ LoRA adapters

    def update_lora(
        self,
        name: str,
        adapter: Any,
        version: str | None = None,
        config: Mapping[str, Any] | None = None,
        via: str = "http",
    ) -> dict[str, Any]:
        """Serves `adapter` as `name` (a new version of it when served already: requests in
        flight finish on theirs, new ones run on this one; outputs name the version). `adapter`
        is a peft model (its active adapter's config is sent) or a state dict of PEFT's tensor
        names with `config` (its adapter_config.json). via "http": the tensors as safetensors
        bytes; "distributed": broadcast over the weight-update group (init_weights_update_group
        first). Only the adapter's tensors travel, never the base weights."""
        state_dict, config = _adapter_tensors(adapter, config)
        if via == "http":
            body = {
                "lora_name": name,
                "config_dict": config,
                "serialized_tensors": base64.b64encode(save(state_dict)).decode(),
                "version": version,
            }
            return self.post("/load_lora_adapter_from_tensors", body)
        if via != "distributed":
            raise ValueError("via must be 'http' or 'distributed'")
        if self._group is None:
            raise RuntimeError("call init_weights_update_group first")
        body = {
            "lora_name": name,
            "config_dict": config,
            "names": list(state_dict),
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in state_dict.values()],
            "shapes": [list(t.shape) for t in state_dict.values()],
            "group_name": self._group_name,
            "version": version,
            "load_format": "flattened_bucket",  # one collective: hundreds of small tensors
        }
        flat = flattened_bucket(list(state_dict.values()))
        with _InBackground(self.post, "/load_lora_adapter_from_distributed", body) as call:
            dist.broadcast(flat, src=0, group=self._group)
        return call.result()

    def unload_lora(self, name: str) -> dict[str, Any]:
        return self.post("/unload_lora_adapter", {"lora_name": name})

    def destroy_weights_update_group(self) -> None:
        if self._group is None:
            return
        self.post("/destroy_weights_update_group", {"group_name": self._group_name})
        destroy_weights_update_group(self._group)
        self._group = None


def _adapter_tensors(
    adapter: Any, config: Mapping[str, Any] | None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(PEFT-named tensors, adapter_config.json) of a peft model or of a state dict + config."""
    if hasattr(adapter, "peft_config"):
        from peft import get_peft_model_state_dict  # noqa: PLC0415 - only trainers with peft

        state = get_peft_model_state_dict(adapter)
        config = adapter.peft_config[getattr(adapter, "active_adapter", "default")].to_dict()
    else:
        state = dict(adapter)
        if config is None:
            raise ValueError("a state dict needs its config (adapter_config.json as a dict)")
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    return tensors, json.loads(json.dumps(dict(config), default=_jsonable))


def _jsonable(value: Any) -> Any:
    if isinstance(value, set | frozenset):
        return sorted(value)
    if hasattr(value, "value"):  # enums (peft's task_type, peft_type)
        return value.value
    raise TypeError(f"{type(value).__name__} is not JSON")


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

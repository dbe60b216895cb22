"""Every control route, declared once: its paths (SGLang's, LMDeploy's and vLLM's names for the same
operation), the body it takes and the engine-core call it makes. The HTTP routes (server/app.py),
the OpenAPI document and the access guard (middleware.CONTROL_PATHS) are all built from CONTROL_ROUTES;
the engine core answers a call with the EngineControl method named after its UtilityMethod, and a
worker runs the WorkerControl method named after its message's tag. A new operation is one entry
here, its body struct, and those methods.

Bodies follow the peers' field names. A field a peer has whose effect tern cannot deliver is a 400
when set to anything but its neutral value (`unsupported`), never accepted and ignored.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

import msgspec

from enginecore.messages import UtilityMethod

# Weight updates may wait for a trainer's whole broadcast; disk loads may be slow.
UPDATE_TIMEOUT_S = 3600.0
CONTROL_TIMEOUT_S = 600.0


class UpdateFromDiskRequest(msgspec.Struct, forbid_unknown_fields=True):
    model_path: str
    load_format: str | None = None
    weight_version: str | None = None
    abort_all_requests: bool = False
    flush_cache: bool = True  # False keeps prefixes computed with the old weights
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    # tern's extension (as /update_weights): false loads and holds the new weights until
    # /finish_weights_update commits or rolls them back (a trainer's prepare on several servers).
    finished: bool = True

    def unsupported(self) -> dict[str, Any]:
        # No CUDA graphs, no async loading. Accepted as they are: torch_empty_cache (every update
        # empties the CUDA cache), keep_pause (tern's updates never end a pause_generation pause).
        return {"is_async": False, "recapture_cuda_graph": False, "token_step": 0}

    def check(self) -> None:
        if self.load_format not in (None, "auto", "safetensors"):
            raise ValueError("load_format must be 'safetensors' (or omitted)", "load_format")


class UpdateFromTensorRequest(msgspec.Struct, forbid_unknown_fields=True):
    serialized_named_tensors: list[str] | str
    load_format: str | None = None  # "safetensors" (base64 blobs) or "shm" (files in /dev/shm)
    finished: bool = True  # LMDeploy: false for every bucket but the last
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None

    def engine_args(self) -> dict[str, Any]:
        items = self.serialized_named_tensors
        items = [items] if isinstance(items, str) else items
        args: dict[str, Any] = {
            "finished": self.finished,
            "flush_cache": self.flush_cache,
            "abort_all_requests": self.abort_all_requests,
            "weight_version": self.weight_version,
            "blobs": [],
            "shm_paths": [],
        }
        fmt = self.load_format or "safetensors"
        if fmt == "safetensors":
            try:
                args["blobs"] = [base64.b64decode(item, validate=True) for item in items]
            except (binascii.Error, ValueError):
                raise ValueError(
                    "serialized_named_tensors must be base64 safetensors blobs",
                    "serialized_named_tensors",
                ) from None
        elif fmt == "shm":
            args["shm_paths"] = list(items)
        else:
            raise ValueError(
                f"load_format {fmt!r} is not supported: use 'safetensors' (base64 blobs, any host) "
                "or 'shm' (safetensors files in /dev/shm, same host); pickled formats are refused",
                "load_format",
            )
        return args


class InitGroupRequest(msgspec.Struct, forbid_unknown_fields=True):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str | None = None
    timeout_s: float = 600.0


class UpdateFromDistributedRequest(msgspec.Struct, forbid_unknown_fields=True):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None  # None: one broadcast per tensor; "flattened_bucket": one in all
    # tern's extension (as LMDeploy's /update_weights): false for every bucket but the last, so
    # generation waits and the buckets commit together.
    finished: bool = True

    def check(self) -> None:
        if self.load_format not in (None, "flattened_bucket"):
            raise ValueError("load_format must be 'flattened_bucket' or omitted", "load_format")
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError("names, dtypes and shapes must have the same length", "names")


class FinishUpdateRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Ends the weight update left open by calls with finished=false: the commit phase (or the
    rollback) of a transaction a trainer runs over several servers (frontend/client/trainer.py)."""

    commit: bool = True
    weight_version: str | None = None
    flush_cache: bool = True


class DestroyGroupRequest(msgspec.Struct, forbid_unknown_fields=True):
    group_name: str = "weight_update_group"


class PauseRequest(msgspec.Struct, forbid_unknown_fields=True):
    mode: str = "abort"  # abort | wait | keep (= SGLang's in_place) | retract


class EmptyRequest(msgspec.Struct, forbid_unknown_fields=True):
    pass


class SleepRequest(msgspec.Struct, forbid_unknown_fields=True):
    level: int | None = None  # 1 (default): the KV cache; 2: also the weights
    tags: list[str] | None = None  # instead of level: any of weights, kv_cache, cuda_graph


class MemoryTagsRequest(msgspec.Struct, forbid_unknown_fields=True):
    tags: list[str] | None = None  # weights, kv_cache, cuda_graph; none: all

    def engine_args(self) -> dict[str, Any]:
        return {"tags": self.tags or ["weights", "kv_cache", "cuda_graph"]}


@dataclass(frozen=True)
class ControlRoute:
    paths: tuple[str, ...]
    summary: str
    method: UtilityMethod
    body: type[msgspec.Struct] = EmptyRequest
    timeout_s: float = CONTROL_TIMEOUT_S
    http_methods: tuple[str, ...] = ("POST",)
    query: tuple[str, ...] = ()  # body fields that may also come in the query string (vLLM)


CONTROL_ROUTES: tuple[ControlRoute, ...] = (
    ControlRoute(("/pause_generation",), "Pause generation (abort, wait, keep/in_place, retract)",
                 UtilityMethod.PAUSE, PauseRequest),
    ControlRoute(("/resume_generation", "/continue_generation"), "Resume generation",
                 UtilityMethod.RESUME),
    ControlRoute(("/reset_prefix_cache", "/flush_cache"), "Forget cached prefixes",
                 UtilityMethod.RESET_PREFIX_CACHE, http_methods=("POST", "GET")),
    ControlRoute(("/update_weights_from_disk",), "Reload weights from a checkpoint",
                 UtilityMethod.UPDATE_WEIGHTS_FROM_DISK, UpdateFromDiskRequest, UPDATE_TIMEOUT_S),
    ControlRoute(("/update_weights", "/update_weights_from_tensor"), "Push weights as tensors",
                 UtilityMethod.UPDATE_WEIGHTS_FROM_TENSORS, UpdateFromTensorRequest,
                 UPDATE_TIMEOUT_S),
    ControlRoute(("/init_weights_update_group",), "Join the trainer's process group",
                 UtilityMethod.INIT_WEIGHTS_UPDATE_GROUP, InitGroupRequest),
    ControlRoute(("/update_weights_from_distributed",), "Receive a broadcast of weights",
                 UtilityMethod.UPDATE_WEIGHTS_FROM_DISTRIBUTED, UpdateFromDistributedRequest,
                 UPDATE_TIMEOUT_S),
    ControlRoute(("/finish_weights_update",), "Commit (or roll back) the open weight update",
                 UtilityMethod.FINISH_WEIGHTS_UPDATE, FinishUpdateRequest),
    ControlRoute(("/destroy_weights_update_group",), "Leave the trainer's group",
                 UtilityMethod.DESTROY_WEIGHTS_UPDATE_GROUP, DestroyGroupRequest),
    ControlRoute(("/sleep",), "Free the KV cache (level 1), the weights too (level 2), or tags",
                 UtilityMethod.SLEEP, SleepRequest, query=("level", "tags")),
    ControlRoute(("/release_memory_occupation",), "Free the memory of the tags (default: all)",
                 UtilityMethod.SLEEP, MemoryTagsRequest),
    ControlRoute(("/wake_up", "/wakeup", "/resume_memory_occupation"),
                 "Bring back what sleep freed (tags; default: all)", UtilityMethod.WAKE_UP,
                 MemoryTagsRequest, query=("tags",)),
)  # fmt: skip

# Routes that change the engine's state for every user: the access guard's list.
CONTROL_PATHS = frozenset(path for route in CONTROL_ROUTES for path in route.paths)

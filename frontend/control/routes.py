"""Every control route, declared once: its paths (SGLang's, LMDeploy's and vLLM's names for the same
operation), the body it takes, the typed engine-core operation (EngineControlOp) the body becomes and
the type of its reply (replies.py).
The HTTP routes (server/app.py), the OpenAPI document and the access guard
(middleware.CONTROL_PATHS) are all built from CONTROL_ROUTES. A body is decoded and checked once,
here; its `op()` is what travels to the engine core (EngineControl.handlers) and, for what workers
do, on to the workers (WorkerControl.handle). A new operation is one entry here, its body struct,
its message type (enginecore/messages.py) and a handler in each table.

Bodies follow the peers' field names. A field a peer has whose effect tern cannot deliver is a 400
when set to anything but its neutral value (`unsupported`), never accepted and ignored.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from enginecore.lora import LoraError, adapter_spec, read_adapter_config
from enginecore.messages import (
    DestroyWeightsUpdateGroup,
    EngineControlOp,
    FinishWeightsUpdate,
    InitWeightsUpdateGroup,
    LoadLora,
    LoadLoraAdapter,
    LoraBroadcast,
    PauseGeneration,
    ReleaseMemory,
    ResetPrefixCache,
    ResumeGeneration,
    ResumeMemory,
    UnloadLoraAdapter,
    UpdateOptions,
    UpdateWeights,
    UpdateWeightsFromDisk,
    UpdateWeightsFromDistributed,
    UpdateWeightsFromTensors,
)
from frontend.control.replies import (
    AdapterReply,
    ControlReply,
    MemoryReply,
    StateReply,
    WeightsReply,
)

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

    def op(self) -> UpdateWeights:
        return UpdateWeights(UpdateWeightsFromDisk(self.model_path), _options(self))


class UpdateFromTensorRequest(msgspec.Struct, forbid_unknown_fields=True):
    serialized_named_tensors: list[str] | str
    load_format: str | None = None  # "safetensors" (base64 blobs) or "shm" (files in /dev/shm)
    finished: bool = True  # LMDeploy: false for every bucket but the last
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None

    def op(self) -> UpdateWeights:
        items = self.serialized_named_tensors
        items = [items] if isinstance(items, str) else items
        fmt = self.load_format or "safetensors"
        if fmt == "safetensors":
            try:
                source = UpdateWeightsFromTensors(
                    blobs=[base64.b64decode(item, validate=True) for item in items]
                )
            except (binascii.Error, ValueError):
                raise ValueError(
                    "serialized_named_tensors must be base64 safetensors blobs",
                    "serialized_named_tensors",
                ) from None
        elif fmt == "shm":
            source = UpdateWeightsFromTensors(shm_paths=list(items))
        else:
            raise ValueError(
                f"load_format {fmt!r} is not supported: use 'safetensors' (base64 blobs, any host) "
                "or 'shm' (safetensors files in /dev/shm, same host); pickled formats are refused",
                "load_format",
            )
        return UpdateWeights(source, _options(self))


def _options(body: Any) -> UpdateOptions:
    return UpdateOptions(
        finished=body.finished,
        flush_cache=body.flush_cache,
        abort_all_requests=body.abort_all_requests,
        weight_version=body.weight_version,
    )


class InitGroupRequest(msgspec.Struct, forbid_unknown_fields=True):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str | None = None
    timeout_s: float = 600.0

    def op(self) -> InitWeightsUpdateGroup:
        return InitWeightsUpdateGroup(**msgspec.structs.asdict(self))


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

    def op(self) -> UpdateWeights:
        source = UpdateWeightsFromDistributed(
            group_name=self.group_name,
            names=self.names,
            dtypes=self.dtypes,
            shapes=self.shapes,
            flattened=self.load_format == "flattened_bucket",
        )
        return UpdateWeights(source, _options(self))


class FinishUpdateRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Ends the weight update left open by calls with finished=false: the commit phase (or the
    rollback) of a transaction a trainer runs over several servers (frontend/client/trainer.py)."""

    commit: bool = True
    weight_version: str | None = None
    flush_cache: bool = True

    def op(self) -> FinishWeightsUpdate:
        return FinishWeightsUpdate(self.commit, self.weight_version, self.flush_cache)


class DestroyGroupRequest(msgspec.Struct, forbid_unknown_fields=True):
    group_name: str = "weight_update_group"

    def op(self) -> DestroyWeightsUpdateGroup:
        return DestroyWeightsUpdateGroup(self.group_name)


class LoadLoraRequest(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's /v1/load_lora_adapter (load_inplace) and SGLang's /load_lora_adapter (pinned): a
    PEFT adapter directory served as `lora_name`. A name already served: vLLM's route needs
    load_inplace=true; SGLang's serves the new version (tern's choice, for RL trainers pushing
    versions under one name; SGLang refuses). Requests in flight finish on their version."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False
    pinned: bool = False
    version: str | None = None  # tern: the version outputs report (default: 1, 2, ...)

    def op(self, replace: bool) -> LoadLoraAdapter:
        try:
            rank, scaling = adapter_spec(read_adapter_config(self.lora_path))
        except LoraError as e:
            raise ValueError(str(e), "lora_path") from None
        source = LoadLora(-1, rank, scaling, path=str(Path(self.lora_path).resolve()))
        return LoadLoraAdapter(self.lora_name, source, self.version, replace, self.pinned)


class LoadLoraFromTensorsRequest(msgspec.Struct, forbid_unknown_fields=True):
    """SGLang's /load_lora_adapter_from_tensors, for RL: the adapter's tensors as base64
    safetensors (one blob for every rank, or one per TP rank) and its adapter_config.json as
    `config_dict`. SGLang's pickled form is refused: nothing unpickles data from the network."""

    lora_name: str
    config_dict: dict[str, Any]
    serialized_tensors: str | list[str]
    load_format: str | None = None  # "safetensors" (the only one)
    pinned: bool = False
    added_tokens_config: dict[str, Any] | None = None
    version: str | None = None

    def unsupported(self) -> dict[str, Any]:
        return {"added_tokens_config": None}

    def op(self) -> LoadLoraAdapter:
        if self.load_format not in (None, "safetensors"):
            raise ValueError(
                f"load_format {self.load_format!r} is not supported: send safetensors bytes",
                "load_format",
            )
        try:
            rank, scaling = adapter_spec(self.config_dict)
        except LoraError as e:
            raise ValueError(str(e), "config_dict") from None
        items = self.serialized_tensors
        blobs = [_safetensors_blob(item) for item in ([items] if isinstance(items, str) else items)]
        if not blobs:
            raise ValueError("serialized_tensors is empty", "serialized_tensors")
        source = LoadLora(-1, rank, scaling, blobs=blobs)
        return LoadLoraAdapter(self.lora_name, source, self.version, True, self.pinned)


class LoadLoraFromDistributedRequest(msgspec.Struct, forbid_unknown_fields=True):
    """tern's: an adapter the trainer broadcasts over its weight-update group (as
    /update_weights_from_distributed does weights; TrainerClient.update_lora). Such an adapter
    stays loaded (it cannot be received again)."""

    lora_name: str
    config_dict: dict[str, Any]
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    version: str | None = None
    load_format: str | None = None  # None: one broadcast per tensor; "flattened_bucket": one

    def op(self) -> LoadLoraAdapter:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError("names, dtypes and shapes must have the same length", "names")
        if self.load_format not in (None, "flattened_bucket"):
            raise ValueError("load_format must be 'flattened_bucket' or omitted", "load_format")
        try:
            rank, scaling = adapter_spec(self.config_dict)
        except LoraError as e:
            raise ValueError(str(e), "config_dict") from None
        broadcast = LoraBroadcast(
            self.group_name, self.names, self.dtypes, self.shapes,
            flattened=self.load_format == "flattened_bucket",
        )  # fmt: skip
        source = LoadLora(-1, rank, scaling, broadcast=broadcast)
        return LoadLoraAdapter(self.lora_name, source, self.version, True, True)


def _safetensors_blob(item: str) -> bytes:
    """A base64 safetensors file, its header checked (pickles and garbage are a 400 here)."""
    param = "serialized_tensors"
    try:
        blob = base64.b64decode(item, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("serialized_tensors must be base64 safetensors bytes", param) from None
    if blob[:1] == b"\x80":
        raise ValueError("pickled tensors are refused: send safetensors bytes", param)
    size = int.from_bytes(blob[:8], "little") if len(blob) >= 8 else -1
    try:
        header = msgspec.json.decode(blob[8 : 8 + size]) if 0 < size <= len(blob) - 8 else None
    except msgspec.DecodeError:
        header = None
    if not isinstance(header, dict):
        raise ValueError("serialized_tensors is not a safetensors file", param)
    return blob


class UnloadLoraRequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; the name decides

    def op(self) -> UnloadLoraAdapter:
        return UnloadLoraAdapter(self.lora_name)


class PauseRequest(msgspec.Struct, forbid_unknown_fields=True):
    mode: str = "abort"  # abort | wait | keep (= SGLang's in_place) | retract

    def op(self) -> PauseGeneration:
        return PauseGeneration(self.mode)


class EmptyRequest(msgspec.Struct, forbid_unknown_fields=True):
    pass


class SleepRequest(msgspec.Struct, forbid_unknown_fields=True):
    level: int | None = None  # 1 (default): the KV cache; 2: also the weights
    tags: list[str] | None = None  # instead of level: any of weights, kv_cache, cuda_graph

    def op(self) -> ReleaseMemory:
        return ReleaseMemory(self.level, self.tags)


class MemoryTagsRequest(msgspec.Struct, forbid_unknown_fields=True):
    tags: list[str] | None = None  # weights, kv_cache, cuda_graph; none: all

    def all_tags(self) -> list[str]:
        return self.tags or ["weights", "kv_cache", "cuda_graph"]


@dataclass(frozen=True)
class ControlRoute:
    paths: tuple[str, ...]
    summary: str
    op: Callable[[Any], EngineControlOp]  # the checked body -> the engine core's operation
    body: type[msgspec.Struct] = EmptyRequest
    timeout_s: float = CONTROL_TIMEOUT_S
    http_methods: tuple[str, ...] = ("POST",)
    query: tuple[str, ...] = ()  # body fields that may also come in the query string (vLLM)
    reply: type[ControlReply] = ControlReply  # what the engine core's answer is read as


CONTROL_ROUTES: tuple[ControlRoute, ...] = (
    ControlRoute(("/pause_generation",), "Pause generation (abort, wait, keep/in_place, retract)",
                 PauseRequest.op, PauseRequest, reply=StateReply),
    ControlRoute(("/resume_generation", "/continue_generation"), "Resume generation",
                 lambda body: ResumeGeneration(), reply=StateReply),
    ControlRoute(("/reset_prefix_cache", "/flush_cache"), "Forget cached prefixes",
                 lambda body: ResetPrefixCache(), http_methods=("POST", "GET")),
    ControlRoute(("/update_weights_from_disk",), "Reload weights from a checkpoint",
                 UpdateFromDiskRequest.op, UpdateFromDiskRequest, UPDATE_TIMEOUT_S,
                 reply=WeightsReply),
    ControlRoute(("/update_weights", "/update_weights_from_tensor"), "Push weights as tensors",
                 UpdateFromTensorRequest.op, UpdateFromTensorRequest, UPDATE_TIMEOUT_S,
                 reply=WeightsReply),
    ControlRoute(("/init_weights_update_group",), "Join the trainer's process group",
                 InitGroupRequest.op, InitGroupRequest),
    ControlRoute(("/update_weights_from_distributed",), "Receive a broadcast of weights",
                 UpdateFromDistributedRequest.op, UpdateFromDistributedRequest, UPDATE_TIMEOUT_S,
                 reply=WeightsReply),
    ControlRoute(("/finish_weights_update",), "Commit (or roll back) the open weight update",
                 FinishUpdateRequest.op, FinishUpdateRequest, reply=WeightsReply),
    ControlRoute(("/destroy_weights_update_group",), "Leave the trainer's group",
                 DestroyGroupRequest.op, DestroyGroupRequest),
    ControlRoute(("/sleep",), "Free the KV cache (level 1), the weights too (level 2), or tags",
                 SleepRequest.op, SleepRequest, query=("level", "tags"), reply=MemoryReply),
    ControlRoute(("/release_memory_occupation",), "Free the memory of the tags (default: all)",
                 lambda body: ReleaseMemory(tags=body.all_tags()), MemoryTagsRequest,
                 reply=MemoryReply),
    ControlRoute(("/v1/load_lora_adapter",), "Serve a LoRA adapter (load_inplace: a new version)",
                 lambda body: body.op(replace=body.load_inplace), LoadLoraRequest, UPDATE_TIMEOUT_S,
                 reply=AdapterReply),
    ControlRoute(("/load_lora_adapter",), "Serve a LoRA adapter (a served name: a new version)",
                 lambda body: body.op(replace=True), LoadLoraRequest, UPDATE_TIMEOUT_S,
                 reply=AdapterReply),
    ControlRoute(("/load_lora_adapter_from_tensors",), "Serve a LoRA adapter pushed as tensors",
                 LoadLoraFromTensorsRequest.op, LoadLoraFromTensorsRequest, UPDATE_TIMEOUT_S,
                 reply=AdapterReply),
    ControlRoute(("/load_lora_adapter_from_distributed",),
                 "Serve a LoRA adapter the trainer broadcasts", LoadLoraFromDistributedRequest.op,
                 LoadLoraFromDistributedRequest, UPDATE_TIMEOUT_S, reply=AdapterReply),
    ControlRoute(("/v1/unload_lora_adapter", "/unload_lora_adapter"),
                 "Stop serving a LoRA adapter (requests in flight finish first)",
                 UnloadLoraRequest.op, UnloadLoraRequest, reply=AdapterReply),
    ControlRoute(("/wake_up", "/wakeup", "/resume_memory_occupation"),
                 "Bring back what sleep freed (tags; default: all)",
                 lambda body: ResumeMemory(tags=body.all_tags()), MemoryTagsRequest,
                 query=("tags",), reply=MemoryReply),
)  # fmt: skip

# Routes that change the engine's state for every user: the access guard's list.
CONTROL_PATHS = frozenset(path for route in CONTROL_ROUTES for path in route.paths)

"""The answers of the control routes, as msgspec structs (their request bodies are in routes.py).

The engine core answers a control operation with a plain object (enginecore/control.py); the route's
reply type (ControlRoute.reply) reads it, so that a key this module does not declare is an error
here rather than an answer that silently changes. Every reply writes the JSON the peers' trainers
parse: `success` and `message` first, then what the operation adds (SGLang's and LMDeploy's shape).
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType


class ControlState(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The engine core's control state (EngineControl.state), merged over the replicas with --dp > 1
    (engine/replicas.py merge_control_states). The defaults are the frontend's view until the
    first refresh."""

    paused: str | None = None  # the pause mode (pause_generation), None when not paused
    is_sleeping: bool = False
    asleep_tags: list[str] = []
    weights_valid: bool = True  # false after the weights were released, until new ones arrive
    update_open: bool = False  # a weight update sent with finished=false waits for the rest
    weight_version: str = "default"
    lora_adapters: dict[str, dict[str, Any]] = {}  # name -> {version, loaded, pinned, path}
    replica_weight_versions: list[str] | UnsetType = UNSET  # --dp > 1: each replica's


class ControlReply(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """reset_prefix_cache, init/destroy_weights_update_group."""

    success: bool = True
    message: str


class StateReply(ControlReply, forbid_unknown_fields=True, kw_only=True):
    """pause_generation and resume_generation: the control state after the call."""

    state: ControlState


class WeightsReply(ControlReply, forbid_unknown_fields=True, kw_only=True):
    """The weight updates and finish_weights_update: the new version once committed (not for a
    bucket sent with finished=false, nor for a roll-back)."""

    weight_version: str | UnsetType = UNSET


class AdapterReply(ControlReply, forbid_unknown_fields=True, kw_only=True):
    """Loading and unloading a LoRA adapter: its name, and the version served (once loaded)."""

    name: str
    version: str | UnsetType = UNSET


class MemoryReply(ControlReply, forbid_unknown_fields=True, kw_only=True):
    """sleep, release_memory_occupation, wake_up: the control state after the call, beside
    `success` and `message` (ControlState's fields, flat)."""

    paused: str | None
    is_sleeping: bool
    asleep_tags: list[str]
    weights_valid: bool
    update_open: bool
    weight_version: str
    lora_adapters: dict[str, dict[str, Any]]
    replica_weight_versions: list[str] | UnsetType = UNSET


class WeightVersionReply(msgspec.Struct):
    """GET /weight_version (and /get_weight_version)."""

    weight_version: str


class IsSleepingReply(msgspec.Struct):
    """GET /is_sleeping."""

    is_sleeping: bool


class IsPausedReply(msgspec.Struct):
    """GET /is_paused (vLLM's): whether generation is paused (pause_generation)."""

    is_paused: bool

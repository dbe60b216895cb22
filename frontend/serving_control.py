"""The routes RL trainers call: pause/resume, weight updates, sleep and wake-up.

Request bodies follow SGLang (update_weights_from_disk / _from_tensor / _from_distributed,
init/destroy_weights_update_group, pause_generation, get_weight_version), LMDeploy (/update_weights
with serialized_named_tensors + finished, /sleep, /wakeup, /is_sleeping) and vLLM (/sleep?level=,
/wake_up, /reset_prefix_cache), so a trainer written for them works against tern by changing the URL.
Successful calls answer {"success": true, "message": ...}; failures are OpenAI-style errors (400 for
the caller's mistakes, 503 when the engine is gone).

Tensor formats (`load_format`): "safetensors" (default; each element of serialized_named_tensors is a
base64 safetensors blob, works across hosts) and "shm" (each element is the path of a safetensors file
the trainer wrote under /dev/shm on this host; the workers map it without a copy). Both are made by
`frontend.trainer_client`. Pickled formats are refused: nothing unpickles data from the network.

While the engine sleeps, or after waking its weights before new ones arrived, generation routes answer
503 (`GenerationGate`), and requests are never served with half-updated weights.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from enginecore.messages import UtilityMethod
from frontend.engine_client import EngineClient, EngineDeadError, UtilityError
from frontend.errors import APIError, bad_request, engine_dead_error
from frontend.middleware import send_error
from frontend.serving import json_response

GENERATION_PATHS = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/generate"}
)
# Weight updates may wait for a trainer's whole broadcast; disk loads may be slow.
UPDATE_TIMEOUT_S = 3600.0
CONTROL_TIMEOUT_S = 600.0


class UpdateFromDiskRequest(msgspec.Struct, forbid_unknown_fields=True):
    model_path: str
    load_format: str | None = None
    weight_version: str | None = None
    abort_all_requests: bool = False
    flush_cache: bool = True
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0


class UpdateFromTensorRequest(msgspec.Struct, forbid_unknown_fields=True):
    serialized_named_tensors: list[str] | str
    load_format: str | None = None
    finished: bool = True  # LMDeploy: false for every bucket but the last
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


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
    load_format: str | None = None
    # tern's extension (as LMDeploy's /update_weights): false for every bucket but the last, so
    # generation waits and the buckets commit together.
    finished: bool = True


class DestroyGroupRequest(msgspec.Struct, forbid_unknown_fields=True):
    group_name: str = "weight_update_group"


class PauseRequest(msgspec.Struct, forbid_unknown_fields=True):
    mode: str = "abort"


class SleepRequest(msgspec.Struct, forbid_unknown_fields=True):
    level: int = 1
    tags: list[str] | None = None


class WakeUpRequest(msgspec.Struct, forbid_unknown_fields=True):
    tags: list[str] | None = None


async def _body(request: Request, typ: type) -> Any:
    raw = await request.body()
    try:
        return msgspec.json.decode(raw or b"{}", type=typ)
    except msgspec.ValidationError as e:
        raise bad_request(f"invalid request: {e}") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as e:  # msgspec checks UTF-8 with the latter
        raise bad_request(f"malformed JSON: {e}") from None


class ControlServing:
    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine
        # The frontend's view of the engine's control state, refreshed by every control call.
        self.state: dict[str, Any] = {"is_sleeping": False, "weights_valid": True}
        self.weight_version = "default"

    @property
    def is_serving(self) -> bool:
        return not self.state.get("is_sleeping") and bool(self.state.get("weights_valid", True))

    async def _call(self, method: UtilityMethod, timeout: float = CONTROL_TIMEOUT_S, **args: Any):
        try:
            result = await self.engine.call_utility(method, timeout, **args)
        except EngineDeadError as e:
            raise engine_dead_error(str(e)) from e
        except UtilityError as e:
            await self._refresh()
            raise bad_request(str(e)) from None
        await self._refresh()
        return result

    async def _refresh(self) -> None:
        try:
            state = await self.engine.call_utility(UtilityMethod.GET_CONTROL_STATE, 10.0)
        except Exception:  # noqa: BLE001 - the engine may be gone; health reports that
            return
        self.state = state
        self.weight_version = state["weight_version"]

    # ------------------------------------------------------------------ generation control

    async def pause(self, request: Request) -> Response:
        body = await _body(request, PauseRequest)
        await self._call(UtilityMethod.PAUSE, mode=body.mode)
        return json_response({"success": True, "message": f"generation paused ({body.mode})"})

    async def resume(self, request: Request) -> Response:
        await self._call(UtilityMethod.RESUME)
        return json_response({"success": True, "message": "generation resumed"})

    async def reset_prefix_cache(self, request: Request) -> Response:
        await self._call(UtilityMethod.RESET_PREFIX_CACHE)
        return json_response({"success": True, "message": "prefix cache reset"})

    # ------------------------------------------------------------------ weights

    async def update_from_disk(self, request: Request) -> Response:
        body = await _body(request, UpdateFromDiskRequest)
        if body.load_format not in (None, "auto", "safetensors"):
            raise bad_request("load_format must be 'safetensors' (or omitted)", "load_format")
        result = await self._call(
            UtilityMethod.UPDATE_WEIGHTS_FROM_DISK,
            UPDATE_TIMEOUT_S,
            model_path=body.model_path,
            weight_version=body.weight_version,
            abort_all_requests=body.abort_all_requests,
        )
        return json_response(result)

    async def update_from_tensor(self, request: Request) -> Response:
        body = await _body(request, UpdateFromTensorRequest)
        items = body.serialized_named_tensors
        items = [items] if isinstance(items, str) else items
        args: dict[str, Any] = {"blobs": [], "shm_paths": []}
        fmt = body.load_format or "safetensors"
        if fmt == "safetensors":
            try:
                args["blobs"] = [base64.b64decode(item, validate=True) for item in items]
            except (binascii.Error, ValueError):
                raise bad_request(
                    "serialized_named_tensors must be base64 safetensors blobs",
                    "serialized_named_tensors",
                ) from None
        elif fmt == "shm":
            args["shm_paths"] = list(items)
        else:
            raise bad_request(
                f"load_format {fmt!r} is not supported: use 'safetensors' (base64 blobs, any host) "
                "or 'shm' (safetensors files in /dev/shm, same host)",
                "load_format",
            )
        result = await self._call(
            UtilityMethod.UPDATE_WEIGHTS_FROM_TENSORS,
            UPDATE_TIMEOUT_S,
            finished=body.finished,
            weight_version=body.weight_version,
            abort_all_requests=body.abort_all_requests,
            **args,
        )
        return json_response(result)

    async def init_group(self, request: Request) -> Response:
        body = await _body(request, InitGroupRequest)
        result = await self._call(
            UtilityMethod.INIT_WEIGHTS_UPDATE_GROUP,
            body.timeout_s + 30,
            **msgspec.structs.asdict(body),
        )
        return json_response(result)

    async def update_from_distributed(self, request: Request) -> Response:
        body = await _body(request, UpdateFromDistributedRequest)
        result = await self._call(
            UtilityMethod.UPDATE_WEIGHTS_FROM_DISTRIBUTED,
            UPDATE_TIMEOUT_S,
            group_name=body.group_name,
            names=body.names,
            dtypes=body.dtypes,
            shapes=body.shapes,
            finished=body.finished,
            weight_version=body.weight_version,
            abort_all_requests=body.abort_all_requests,
        )
        return json_response(result)

    async def destroy_group(self, request: Request) -> Response:
        body = await _body(request, DestroyGroupRequest)
        await self._call(UtilityMethod.DESTROY_WEIGHTS_UPDATE_GROUP, group_name=body.group_name)
        return json_response({"success": True, "message": f"destroyed {body.group_name!r}"})

    async def get_weight_version(self, request: Request) -> Response:
        await self._refresh()
        return json_response({"weight_version": self.weight_version})

    # ------------------------------------------------------------------ sleep

    async def sleep(self, request: Request) -> Response:
        body = await _body(request, SleepRequest)
        level = body.level
        if "level" in request.query_params:
            try:
                level = int(request.query_params["level"])
            except ValueError:
                raise bad_request("level must be 1 or 2", "level") from None
        if level not in (1, 2):
            raise bad_request("level must be 1 or 2", "level")
        state = await self._call(UtilityMethod.SLEEP, level=level)
        return json_response({"success": True, "message": f"asleep (level {level})", **state})

    async def wake_up(self, request: Request) -> Response:
        body = await _body(request, WakeUpRequest)
        tags = body.tags or request.query_params.getlist("tags") or None
        state = await self._call(UtilityMethod.WAKE_UP, tags=tags)
        return json_response({"success": True, "message": "awake", **state})

    async def is_sleeping(self, request: Request) -> Response:
        await self._refresh()
        return json_response({"is_sleeping": bool(self.state.get("is_sleeping"))})


class GenerationGate:
    """503 for generation routes while the engine sleeps or waits for weights after waking."""

    def __init__(self, app: ASGIApp, control: ControlServing) -> None:
        self.app = app
        self.control = control

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["path"] in GENERATION_PATHS
            and not self.control.is_serving
        ):
            asleep = self.control.state.get("is_sleeping")
            reason = (
                "the server is asleep: POST /wake_up first"
                if asleep
                else "the weights were released: push new weights (update_weights*) first"
            )
            await send_error(send, APIError(reason, 503, None, "server_asleep"))
            return
        await self.app(scope, receive, send)

"""The routes RL trainers call: pause/resume, weight updates, sleep and wake-up.

Request bodies follow SGLang (update_weights_from_disk / _from_tensor / _from_distributed,
init/destroy_weights_update_group, pause_generation, get_weight_version), LMDeploy (/update_weights
with serialized_named_tensors + finished, /sleep, /wakeup, /is_sleeping) and vLLM (/sleep?level=,
/wake_up, /reset_prefix_cache), so a trainer written for them works against tern by changing the URL.
Successful calls answer {"success": true, "message": ...} (typed: control/replies.py); failures are OpenAI-style errors (400 for
the caller's mistakes, 503 when the engine is gone).

Tensor formats (`load_format`): "safetensors" (default; each element of serialized_named_tensors is a
base64 safetensors blob, works across hosts) and "shm" (each element is the path of a safetensors file
the trainer wrote under /dev/shm on this host; the workers map it without a copy). Both are made by
`frontend.client.trainer`. Pickled formats are refused: nothing unpickles data from the network.

The routes themselves are declared in frontend/control/routes.py; ControlServing.endpoint turns one
into a handler (decode and check the body, call the engine core, answer).

While the engine sleeps, or after waking its weights before new ones arrived, generation routes answer
503 (`GenerationGate`), and requests are never served with half-updated weights.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from enginecore.messages import EngineControlOp, GetControlState, UnloadLoraAdapter
from frontend.common.errors import APIError, bad_request, engine_dead_error
from frontend.common.http import json_response, send_error
from frontend.control.replies import (
    ControlState,
    IsPausedReply,
    IsSleepingReply,
    WeightVersionReply,
)
from frontend.control.routes import ControlRoute
from frontend.engine.client import EngineClient, EngineDeadError, UtilityError
from frontend.serving.base import OpenAIServing


async def decode_body(request: Request, route: ControlRoute) -> msgspec.Struct:
    """The route's body (empty means all defaults), with the query parameters it allows, checked."""
    raw = await request.body()
    try:
        fields = msgspec.json.decode(raw or b"{}")
    except (msgspec.DecodeError, UnicodeDecodeError) as e:  # msgspec checks UTF-8 with the latter
        raise bad_request(f"malformed JSON: {e}") from None
    if not isinstance(fields, dict):
        raise bad_request("the body must be a JSON object")
    for name in route.query:
        values = request.query_params.getlist(name)
        if values and name not in fields:
            fields[name] = values if name == "tags" else values[0]
    try:
        body = msgspec.convert(fields, route.body, strict=False)
    except msgspec.ValidationError as e:
        raise bad_request(f"invalid request: {e}") from None
    unsupported = getattr(body, "unsupported", dict)()
    for name, neutral in unsupported.items():
        if getattr(body, name) != neutral:
            raise bad_request(f"{name} is not supported by tern (leave it at {neutral!r})", name)
    try:
        if hasattr(body, "check"):
            body.check()
    except ValueError as e:
        raise bad_request(*e.args) from None
    return body


def engine_op(route: ControlRoute, body: msgspec.Struct) -> EngineControlOp:
    try:
        return route.op(body)
    except ValueError as e:
        raise bad_request(*e.args) from None


class ControlServing:
    def __init__(self, engine: EngineClient, serving: OpenAIServing | None = None) -> None:
        """`serving`: whose view of the served LoRA adapters each refresh updates."""
        self.engine = engine
        self.serving = serving
        # The frontend's view of the engine's control state, refreshed by every control call.
        self.state = ControlState()

    @property
    def weight_version(self) -> str:
        return self.state.weight_version

    @property
    def is_serving(self) -> bool:
        return not self.state.is_sleeping and self.state.weights_valid

    def endpoint(self, route: ControlRoute) -> Callable[[Request], Awaitable[Response]]:
        async def handle(request: Request) -> Response:
            body = await decode_body(request, route)
            op = engine_op(route, body)
            if isinstance(op, UnloadLoraAdapter):
                self._stop_admitting(op.name)
            timeout = route.timeout_s + float(getattr(op, "timeout_s", 0.0))
            result = await self._call(op, timeout)
            if not isinstance(result, dict) or "success" not in result:
                result = {"success": True, "message": route.summary, "state": result}
            return json_response(msgspec.convert(result, route.reply))

        handle.__name__ = route.paths[0].strip("/")
        handle.control = route  # type: ignore[attr-defined]  # marks the state-changing routes
        return handle

    def _stop_admitting(self, adapter: str) -> None:
        """New requests on `adapter` get the 404 of a name not served from now on, not once the
        engine has unloaded it: a request admitted in between would reach the engine after the
        unload and fail. Those already handed to the engine reach it first (one ordered socket)
        and finish on it. A refused unload puts the name back (the refresh after the call)."""
        adapters = self.serving.adapters if self.serving is not None else None
        if adapters is not None and adapter in adapters:
            self.serving.adapters = {k: v for k, v in adapters.items() if k != adapter}

    async def _call(self, op: EngineControlOp, timeout: float) -> Any:
        try:
            result = await self.engine.call_utility(op, timeout)
        except EngineDeadError as e:
            raise engine_dead_error(str(e)) from e
        except UtilityError as e:
            await self._refresh()
            raise bad_request(str(e)) from None
        await self._refresh()
        return result

    async def _refresh(self) -> None:
        try:
            state = await self.engine.call_utility(GetControlState(), 10.0)
        except Exception:  # noqa: BLE001 - the engine may be gone; health reports that
            return
        self.state = msgspec.convert(state, ControlState)
        if self.serving is not None and self.serving.adapters is not None:
            self.serving.adapters = self.state.lora_adapters

    # ------------------------------------------------------------------ read-only

    async def get_weight_version(self, request: Request) -> Response:
        await self._refresh()
        return json_response(WeightVersionReply(self.weight_version))

    async def is_sleeping(self, request: Request) -> Response:
        await self._refresh()
        return json_response(IsSleepingReply(self.state.is_sleeping))

    async def is_paused(self, request: Request) -> Response:
        await self._refresh()
        return json_response(IsPausedReply(self.state.paused is not None))


class GenerationGate:
    """503 for generation routes while the engine sleeps or waits for weights after waking."""

    def __init__(self, app: ASGIApp, control: ControlServing, paths: frozenset[str]) -> None:
        self.app = app
        self.control = control
        self.paths = paths  # the routes that run the model (server/routes.py)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in self.paths and not self.control.is_serving:
            asleep = self.control.state.is_sleeping
            reason = (
                "the server is asleep: POST /wake_up first"
                if asleep
                else "the weights were released: push new weights (update_weights*) first"
            )
            await send_error(send, APIError(reason, 503, None, "server_asleep"), path=scope["path"])
            return
        await self.app(scope, receive, send)

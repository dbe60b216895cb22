"""The control routes of Ray Serve LLM's dev ingress (build_dev_openai_app), answered by any
replica for all of them: POST /sleep, /wakeup (and tern's /wake_up), /pause, /resume,
/reset_prefix_cache; GET /is_sleeping, /is_paused (true when any replica is).

Bodies are Ray's: {"model": ..., "options": {...}} (the options are the replica method's keyword
arguments: tern's control bodies, e.g. {"level": 1} or {"mode": "keep"}); GET takes ?model=.
The call reaches every running replica of this deployment through Ray Serve LLM's own broadcast
(ray.llm._internal.serve.utils.broadcast: each replica actor by name, as Ray's DevIngress does).
Every other path goes to tern's app.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.types import ASGIApp

from frontend.common.errors import APIError, bad_request
from frontend.common.http import error_response

# path -> (HTTP method, the replica method it calls on every replica)
DEV_ROUTES = {
    "/sleep": ("POST", "sleep"),
    "/wakeup": ("POST", "wakeup"),
    "/wake_up": ("POST", "wakeup"),
    "/pause": ("POST", "pause"),
    "/resume": ("POST", "resume"),
    "/reset_prefix_cache": ("POST", "reset_prefix_cache"),
    "/is_sleeping": ("GET", "is_sleeping"),
    "/is_paused": ("GET", "is_paused"),
}


def with_dev_routes(app: ASGIApp, model_id: str) -> ASGIApp:
    routes: list[Any] = [
        Route(path, _handler(model_id, replica_method), methods=[http_method])
        for path, (http_method, replica_method) in DEV_ROUTES.items()
    ]
    routes.append(Mount("/", app=app))
    return Starlette(routes=routes)


def _handler(model_id: str, method: str) -> Any:
    async def handle(request: Request) -> Response:
        try:
            if request.method == "GET":
                model, options = request.query_params.get("model"), {}
            else:
                model, options = _body(await request.body())
            if model is not None and model != model_id:
                raise APIError(f"the model {model!r} does not exist", 404, "model")
            results = await broadcast_to_replicas(method, options)
        except APIError as e:
            return error_response(e, request.url.path)
        if method.startswith("is_"):
            return JSONResponse({method: any(results)})
        return Response(status_code=200)

    return handle


def _body(raw: bytes) -> tuple[str | None, dict[str, Any]]:
    try:
        body = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError as e:
        raise bad_request(f"the body is not JSON: {e}") from None
    if not isinstance(body, dict) or not isinstance(body.get("options", {}), dict):
        raise bad_request('the body must be {"model": ..., "options": {...}}', "options")
    unknown = set(body) - {"model", "options"}
    if unknown:
        raise bad_request(f"unknown fields {sorted(unknown)}", sorted(unknown)[0])
    return body.get("model"), body.get("options", {})


async def broadcast_to_replicas(method: str, options: dict[str, Any]) -> list[Any]:
    """Calls `method(**options)` on every running replica of this deployment; a replica's error
    is a 400 naming it."""
    from ray import serve
    from ray.llm._internal.serve.utils.broadcast import broadcast

    context = serve.get_replica_context()
    handle = serve.get_deployment_handle(context.deployment, context.app_name)
    try:
        return await asyncio.to_thread(broadcast, handle, method, kwargs=options)
    except Exception as e:  # noqa: BLE001 - a replica refused (a bad option): the caller's error
        raise bad_request(f"{method} failed on a replica: {e}") from None

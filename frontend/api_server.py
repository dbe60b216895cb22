"""The HTTP routes (starlette) of a tern server.

Generation routes live in serving.py; this module maps URLs to them, serves the small informational
routes (/v1/models, /health, /version, /server_info), and turns every exception into an OpenAI-style
error body.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from enginecore.config import Config
from frontend.engine_client import EngineClient, EngineDeadError
from frontend.errors import APIError, engine_dead_error
from frontend.protocol import ModelCard, ModelList
from frontend.serving import OpenAIServing, error_response, json_response

logger = logging.getLogger("tern.frontend")


def tern_version() -> str:
    try:
        return version("tern")
    except PackageNotFoundError:
        return "unknown"


def build_app(config: Config, engine: EngineClient, serving: OpenAIServing) -> Starlette:
    """The ASGI app. `engine` must be started (its EngineReady describes the model)."""
    assert engine.ready is not None
    ready = engine.ready
    started = int(time.time())

    async def chat_completions(request: Request) -> Response:
        return await serving.chat(request)

    async def completions(request: Request) -> Response:
        return await serving.completion(request)

    async def models(request: Request) -> Response:
        card = ModelCard(
            id=serving.model_name,
            created=started,
            root=config.model.path,
            max_model_len=ready.max_model_len,
        )
        return json_response(ModelList([card]))

    async def health(request: Request) -> Response:
        return Response(status_code=503 if engine.is_dead else 200)

    async def server_version(request: Request) -> Response:
        return json_response({"version": tern_version()})

    async def server_info(request: Request) -> Response:
        try:
            stats = await engine.get_stats()
        except EngineDeadError as e:
            raise engine_dead_error(str(e)) from e
        info: dict[str, Any] = {
            "version": tern_version(),
            "served_model_name": serving.model_name,
            "config": dataclasses.asdict(config),
            "engine": {
                "model_summary": ready.model_summary,
                "num_kv_blocks": ready.num_kv_blocks,
                "block_size": ready.block_size,
                "max_model_len": ready.max_model_len,
                "vocab_size": ready.vocab_size,
                "engine_core_pid": engine.pid,
            },
            "num_requests_in_flight": engine.num_in_flight,
            "scheduler_stats": stats,
        }
        return json_response(info)

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/version", server_version, methods=["GET"]),
        Route("/server_info", server_info, methods=["GET"]),
    ]
    handlers = {APIError: _api_error, HTTPException: _http_error, Exception: _server_error}
    return Starlette(routes=routes, exception_handlers=handlers)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return error_response(APIError(str(exc.detail), exc.status_code))


async def _server_error(request: Request, exc: Exception) -> Response:
    logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(APIError(f"internal server error: {type(exc).__name__}: {exc}", 500))

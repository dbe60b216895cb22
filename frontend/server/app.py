"""The ASGI app of a tern server: routes built from server/routes.py's table, the middleware around
them, and every exception turned into an OpenAI-style error body.

Where each route's handler lives: frontend/server/routes.py (the table) names it.
"""

from __future__ import annotations

import logging

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from swagger_ui_bundle import swagger_ui_path

from enginecore.config import Config
from frontend.anthropic.serving import MessagesServing
from frontend.cli.server import FrontendConfig
from frontend.common.errors import APIError
from frontend.common.http import error_response
from frontend.control.serving import ControlServing, GenerationGate
from frontend.engine.client import EngineClient
from frontend.lmdeploy.serving import LMDeployServing
from frontend.openai.chat import ChatServing
from frontend.openai.completion import CompletionServing
from frontend.openai.responses import ResponsesServing, ResponseStore
from frontend.openai.tokenize import TokenizeServing
from frontend.openai.transcription import TranscriptionServing
from frontend.pooling.serving import PoolingServing, task_error
from frontend.server.generate import GenerateServing
from frontend.server.info import InfoServing, tern_version
from frontend.server.middleware import (
    DOCS_STATIC,
    AccessMiddleware,
    BodyLimitMiddleware,
    RequestIdMiddleware,
)
from frontend.server.openapi import openapi_document
from frontend.server.router_routes import RouterServing
from frontend.server.routes import AUDIO_PATHS, GENERATION_PATHS, ROUTES, Endpoint, Handlers
from frontend.serving.base import OpenAIServing
from frontend.sglang.serving import SGLangServing

logger = logging.getLogger("tern.frontend")

_json = msgspec.json.Encoder()


def build_app(
    config: Config, frontend: FrontendConfig, engine: EngineClient, serving: OpenAIServing
) -> Starlette:
    """The ASGI app. `engine` must be started (its EngineReady describes the model)."""
    assert engine.ready is not None
    chat = ChatServing(serving, frontend.chat_options)
    if config.lora.enabled:  # until the engine's control state says more
        serving.adapters = {
            name: {"version": "1", "loaded": True, "pinned": False, "path": path}
            for name, path in config.lora.modules
        }
    control = ControlServing(engine, serving)
    if config.parallel.data_parallel_size > 1 and serving.metrics is not None:
        serving.metrics.replicas = engine.replica_snapshots
    openapi = _json.encode(openapi_document("tern", tern_version()))
    lmdeploy = LMDeployServing(serving)
    handlers = Handlers(
        chat=chat,
        completion=CompletionServing(serving),
        responses=ResponsesServing(chat, ResponseStore(frontend.max_stored_responses)),
        messages=MessagesServing(chat),
        tokenize=TokenizeServing(serving),
        lmdeploy=lmdeploy,
        generate=GenerateServing(lmdeploy, SGLangServing(serving)),
        pooling=PoolingServing(serving),
        control=control,
        router=RouterServing(serving, chat, control),
        info=InfoServing(config, frontend, engine, serving, control, openapi),
        audio=TranscriptionServing(serving, frontend.media),
    )
    routes: list[BaseRoute] = [
        Route(r.path, _task_gate(engine, r.tasks, r.handler(handlers)), methods=list(r.methods))
        for r in ROUTES
    ]
    routes.append(Mount(DOCS_STATIC, StaticFiles(directory=swagger_ui_path), name="docs_static"))
    exception_handlers = {
        APIError: _api_error,
        HTTPException: _http_error,
        Exception: _server_error,
    }
    middleware = [
        *_middleware(frontend),
        Middleware(GenerationGate, control=control, paths=GENERATION_PATHS),
    ]
    return Starlette(routes=routes, exception_handlers=exception_handlers, middleware=middleware)


def _task_gate(engine: EngineClient, tasks: tuple[str, ...], endpoint: Endpoint) -> Endpoint:
    """`endpoint`, answering a 400 that names the served task unless it is one of `tasks`."""
    if not tasks:
        return endpoint

    async def gated(request: Request) -> Response:
        assert engine.ready is not None
        if engine.ready.task not in tasks:
            needed = " or ".join(f"task {t!r}" for t in tasks)
            raise task_error(request.url.path, engine.ready.task, f"a model of {needed}")
        return await endpoint(request)

    return gated


def _middleware(frontend: FrontendConfig) -> list[Middleware]:
    """Outermost first: CORS answers preflights before the key is checked (browsers send none)."""
    stack = []
    if frontend.allowed_origins:
        stack.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(frontend.allowed_origins),
                allow_methods=["*"],
                allow_headers=["*"],
                expose_headers=["X-Request-Id"],
            )
        )
    has_key = frontend.api_key is not None or frontend.admin_api_key is not None
    if has_key or not frontend.allow_remote_control:
        stack.append(
            Middleware(
                AccessMiddleware,
                api_key=frontend.api_key,
                admin_api_key=frontend.admin_api_key,
                allow_remote_control=frontend.allow_remote_control,
            )
        )
    stack.append(
        Middleware(
            BodyLimitMiddleware,
            max_bytes=frontend.max_request_body_bytes,
            timeout_s=frontend.request_body_timeout_s,
            # An audio file and its form's other fields; the file's own cap is a 413 of the route.
            path_limits=dict.fromkeys(AUDIO_PATHS, frontend.media.max_audio_bytes + 2**20),
        )
    )
    stack.append(Middleware(RequestIdMiddleware))
    return stack


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return error_response(exc, request.url.path)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    response = error_response(APIError(str(exc.detail), exc.status_code), request.url.path)
    response.headers.update(exc.headers or {})  # e.g. 405's Allow (RFC 9110)
    return response


async def _server_error(request: Request, exc: Exception) -> Response:
    logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    error = APIError(f"internal server error: {type(exc).__name__}: {exc}", 500)
    return error_response(error, request.url.path)

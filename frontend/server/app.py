"""The HTTP routes (starlette) of a tern server, and the middleware around them.

Generating routes live in serving_chat.py, serving_completion.py, serving_responses.py
(/v1/responses) and serving_native.py (/generate, /abort_request, /tokenize, /detokenize); those of
pooling models (/v1/embeddings, /pooling, /classify, /score) and /v1/encode in serving_pooling.py,
which also guards the generating routes of a pooling model (a 400 naming its task); this
module maps URLs to them, serves the small informational routes (/v1/models, /health, /ping,
/version, /server_info, /metrics, /openapi.json and its page /docs), and turns every exception into an OpenAI-style error body.

/health: 200 while the engine serves, 503 once it is dead. With --dp > 1 it also answers a JSON body,
{"status": "ok" | "degraded" | "dead", ...}: degraded (some replica died, the others serve) is
still 200 (see frontend/engine/client.py for why).
"""

from __future__ import annotations

import dataclasses
import logging
import platform
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from swagger_ui_bundle import swagger_ui_path

from enginecore.config import Config
from frontend.args import FrontendConfig
from frontend.control.routes import CONTROL_ROUTES
from frontend.control.serving import ControlServing, GenerationGate
from frontend.engine.client import EngineClient, EngineDeadError
from frontend.lmdeploy.serving import NativeServing
from frontend.openai.chat import ChatServing
from frontend.openai.completion import CompletionServing
from frontend.openai.protocol import ModelCard, ModelList
from frontend.openai.responses import ResponsesServing
from frontend.pooling.serving import Endpoint, PoolingServing, require_task
from frontend.server.errors import APIError, engine_dead_error
from frontend.server.metrics import CONTENT_TYPE_LATEST
from frontend.server.middleware import (
    DOCS_STATIC,
    AccessMiddleware,
    BodyLimitMiddleware,
    RequestIdMiddleware,
)
from frontend.server.openapi import docs_page, openapi_document
from frontend.server.router_routes import RouterServing
from frontend.serving.base import OpenAIServing, error_response, json_response

logger = logging.getLogger("tern.frontend")

_json = msgspec.json.Encoder()
_VERSIONED_PACKAGES = ("tern", "torch", "transformers", "tokenizers", "msgspec", "starlette")


def package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


def tern_version() -> str:
    return package_version("tern")


def build_app(
    config: Config, frontend: FrontendConfig, engine: EngineClient, serving: OpenAIServing
) -> Starlette:
    """The ASGI app. `engine` must be started (its EngineReady describes the model)."""
    assert engine.ready is not None
    ready = engine.ready
    started = int(time.time())
    chat = ChatServing(serving, frontend.chat_options)
    completion = CompletionServing(serving)
    responses = ResponsesServing(serving)
    native = NativeServing(serving)
    pooling = PoolingServing(serving)

    def generating(endpoint: Endpoint) -> Endpoint:
        return require_task(engine, ("generate",), endpoint)

    control = ControlServing(engine)
    num_replicas = config.parallel.data_parallel_size
    if num_replicas > 1 and serving.metrics is not None:
        serving.metrics.replicas = engine.replica_snapshots

    def card(name: str) -> ModelCard:
        return ModelCard(
            id=name, created=started, root=config.model.path, max_model_len=ready.max_model_len
        )

    async def models(request: Request) -> Response:
        return json_response(ModelList([card(name) for name in serving.model_names]))

    async def model(request: Request) -> Response:
        name = request.path_params["model"]
        serving.check_model(name)
        return json_response(card(name))

    async def health(request: Request) -> Response:
        status = 503 if engine.is_dead else 200
        if num_replicas == 1:
            return Response(status_code=status)
        return json_response(engine.health(), status)

    async def server_version(request: Request) -> Response:
        return json_response({"version": tern_version()})

    async def metrics(request: Request) -> Response:
        assert serving.metrics is not None
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def server_info_dict() -> dict[str, Any]:
        try:
            stats = await engine.get_stats()
        except EngineDeadError as e:
            raise engine_dead_error(str(e)) from e
        return {
            "version": tern_version(),
            "versions": {
                "python": platform.python_version(),
                **{name: package_version(name) for name in _VERSIONED_PACKAGES},
            },
            "served_model_name": serving.model_name,
            "served_model_names": serving.model_names,
            "model_path": config.model.path,  # sglang-router reads it at registration
            "config": dataclasses.asdict(config),
            "frontend": frontend.public_dict(),
            "engine": {
                "model_summary": ready.model_summary,
                "task": ready.task,
                "num_kv_blocks": ready.num_kv_blocks,
                "block_size": ready.block_size,
                "max_model_len": ready.max_model_len,
                "vocab_size": ready.vocab_size,
                "engine_core_pid": engine.pid,
                "data_parallel_size": num_replicas,
                "replicas": replicas_info(),
            },
            "kv_cache": {
                "num_blocks": ready.num_kv_blocks,
                "block_size": ready.block_size,
                "num_tokens": ready.num_kv_blocks * ready.block_size,
                "memory_gib": config.cache.kv_cache_memory_gib,
            },
            "num_requests_in_flight": engine.num_in_flight,
            "scheduler_stats": stats,
        }

    def replicas_info() -> list[dict[str, Any]]:
        if num_replicas == 1:
            return [
                {"replica": 0, "engine_core_pid": engine.pid, "dead_reason": engine.dead_reason}
            ]
        return [
            {"replica": r.index, "engine_core_pid": r.pid, "dead_reason": r.dead_reason}
            for r in engine.replicas
        ]

    async def server_info(request: Request) -> Response:
        return json_response(await server_info_dict())

    async def get_server_info(request: Request) -> Response:
        """SGLang's /get_server_info: its server-argument names beside tern's /server_info."""
        info = await server_info_dict()
        await control.get_weight_version(request)  # refreshes the control state
        parallel = config.parallel
        return json_response({
            **info,
            "model_path": config.model.path,
            "tokenizer_path": config.model.path,
            "tp_size": parallel.tensor_parallel_size,
            "pp_size": parallel.pipeline_parallel_size,
            "dp_size": num_replicas,
            "context_length": ready.max_model_len,
            "max_total_num_tokens": ready.num_kv_blocks * ready.block_size,
            "weight_version": control.weight_version,
            "internal_states": [{"weight_version": control.weight_version}],
        })  # fmt: skip

    async def get_model_info(request: Request) -> Response:
        """SGLang's /get_model_info."""
        await control.get_weight_version(request)
        return json_response({
            "model_path": config.model.path,
            "tokenizer_path": config.model.path,
            "served_model_name": serving.model_name,
            "is_generation": ready.task == "generate",
            "preferred_sampling_params": None,
            "weight_version": control.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "architectures": [ready.model_summary.split(":")[0]],
            "model_type": _model_type(config.model.path),
        })  # fmt: skip

    document = _json.encode(openapi_document("tern", tern_version()))

    async def openapi_json(request: Request) -> Response:
        return Response(document, media_type="application/json")

    async def docs(request: Request) -> Response:
        return HTMLResponse(docs_page("/openapi.json", DOCS_STATIC, "tern API"))

    routes = [
        Route("/v1/chat/completions", generating(chat.create), methods=["POST"]),
        Route("/v1/completions", generating(completion.create), methods=["POST"]),
        Route("/v1/responses", generating(responses.create), methods=["POST"]),
        Route("/v1/embeddings", pooling.embeddings, methods=["POST"]),
        Route("/pooling", pooling.pooling, methods=["POST"]),
        Route("/classify", pooling.classify, methods=["POST"]),
        Route("/score", pooling.score, methods=["POST"]),
        Route("/v1/encode", pooling.encode, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/generate", generating(native.generate), methods=["POST"]),
        Route("/abort_request", native.abort_request, methods=["POST"]),
        Route("/tokenize", native.tokenize, methods=["POST"]),
        Route("/detokenize", native.detokenize, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/ping", health, methods=["GET", "POST"]),
        Route("/version", server_version, methods=["GET"]),
        Route("/server_info", server_info, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        *(
            Route(path, control.endpoint(route), methods=list(route.http_methods))
            for route in CONTROL_ROUTES
            for path in route.paths
        ),
        Route("/weight_version", control.get_weight_version, methods=["GET"]),
        Route("/get_weight_version", control.get_weight_version, methods=["GET"]),
        Route("/get_model_info", get_model_info, methods=["GET"]),
        Route("/model_info", get_model_info, methods=["GET"]),  # SGLang's newer name
        *RouterServing(serving, chat, control).routes(),
        Route("/get_server_info", get_server_info, methods=["GET"]),
        Route("/is_sleeping", control.is_sleeping, methods=["GET"]),
        Route("/openapi.json", openapi_json, methods=["GET"]),
        Route("/docs", docs, methods=["GET"]),
        Mount(DOCS_STATIC, StaticFiles(directory=swagger_ui_path), name="docs_static"),
    ]
    handlers = {APIError: _api_error, HTTPException: _http_error, Exception: _server_error}
    middleware = [*_middleware(frontend), Middleware(GenerationGate, control=control)]
    return Starlette(routes=routes, exception_handlers=handlers, middleware=middleware)


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
        )
    )
    stack.append(Middleware(RequestIdMiddleware))
    return stack


def _model_type(model_path: str) -> str | None:
    """config.json's model_type (sglang-router labels workers with it)."""
    try:
        with open(f"{model_path}/config.json", "rb") as f:
            return msgspec.json.decode(f.read()).get("model_type")
    except (OSError, msgspec.DecodeError, AttributeError):
        return None


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    response = error_response(APIError(str(exc.detail), exc.status_code))
    response.headers.update(exc.headers or {})  # e.g. 405's Allow (RFC 9110)
    return response


async def _server_error(request: Request, exc: Exception) -> Response:
    logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(APIError(f"internal server error: {type(exc).__name__}: {exc}", 500))

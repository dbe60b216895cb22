"""Every HTTP route, declared once: path, methods, handler, request / response types, whether it
runs the model and which tasks can answer it.

From ROUTES come the Starlette routes (app.py), the OpenAPI document (openapi.py), the generation
gate (GENERATION_PATHS: 503 while the engine sleeps or waits for weights) and the task gate (a
400 naming the served task, pooling/serving.py `task_error`). The control routes' entries are made
from control/routes.py's CONTROL_ROUTES, which also build the access guard.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from frontend.anthropic.protocol import (
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
)
from frontend.control.routes import CONTROL_ROUTES, ControlRoute
from frontend.lmdeploy.protocol import AbortRequest, GenerateRequest, GenerateResponse
from frontend.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    ModelCard,
    ModelList,
)
from frontend.openai.responses_protocol import ResponseObject, ResponsesRequest
from frontend.openai.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from frontend.pooling.protocol import (
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    EncodeRequest,
    EncodeResponse,
    PoolingRequest,
    PoolingResponse,
    ScoreRequest,
    ScoreResponse,
)
from frontend.sglang.protocol import SGLangGenerateOutput, SGLangGenerateRequest

if TYPE_CHECKING:
    from frontend.anthropic.serving import MessagesServing
    from frontend.control.serving import ControlServing
    from frontend.lmdeploy.serving import LMDeployServing
    from frontend.openai.chat import ChatServing
    from frontend.openai.completion import CompletionServing
    from frontend.openai.responses import ResponsesServing
    from frontend.openai.tokenize import TokenizeServing
    from frontend.openai.transcription import TranscriptionServing
    from frontend.pooling.serving import PoolingServing
    from frontend.server.generate import GenerateServing
    from frontend.server.info import InfoServing
    from frontend.server.router_routes import RouterServing

Endpoint = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True)
class Handlers:
    """The objects whose methods answer the routes (built by app.py)."""

    chat: ChatServing
    completion: CompletionServing
    responses: ResponsesServing
    messages: MessagesServing
    tokenize: TokenizeServing
    lmdeploy: LMDeployServing
    generate: GenerateServing
    pooling: PoolingServing
    control: ControlServing
    router: RouterServing
    info: InfoServing
    audio: TranscriptionServing


@dataclass(frozen=True)
class RouteSpec:
    path: str  # Starlette's syntax ({name:path}); OpenAPI's is derived
    methods: tuple[str, ...]
    handler: Callable[[Handlers], Endpoint]
    summary: str
    tag: str
    request: Any = None  # a msgspec type, or a tuple of them (any of)
    response: Any = None  # None: a JSON object the document does not detail; a tuple: any of
    stream: Any = None  # the SSE chunk's type, for routes with `stream: true`
    runs_model: bool = False  # 503 while the engine sleeps or waits for weights
    tasks: tuple[str, ...] = ()  # the model tasks that can answer it; empty: any
    # The answer: json | text (Prometheus) | html | empty (the status says it) | form (json or
    # text by the request's response_format; its request is multipart/form-data)
    body: str = "json"
    optional_body: bool = False  # the request body may be left out


_OPENAI, _PEERS, _CONTROL, _OPS = (
    "OpenAI",
    "LMDeploy and SGLang",
    "Control (RL trainers)",
    "Operations",
)
_ANTHROPIC = "Anthropic"
_POOLING = "Pooling models (embedding, classification, reward)"
_ROUTERS = "Routers (vllm-router, sglang-router)"  # frontend/server/router_routes.py
_GENERATE, _POST, _GET = ("generate",), ("POST",), ("GET",)


def _control(route: ControlRoute, path: str) -> RouteSpec:
    optional = not any(f.required for f in msgspec.structs.fields(route.body))
    return RouteSpec(
        path, route.http_methods, lambda h: h.control.endpoint(route), route.summary, _CONTROL,
        route.body, optional_body=optional,
    )  # fmt: skip


ROUTES: tuple[RouteSpec, ...] = (
    RouteSpec("/v1/chat/completions", _POST, lambda h: h.chat.create, "Chat completion",
              _OPENAI, ChatCompletionRequest, ChatCompletionResponse,
              ChatCompletionStreamResponse, runs_model=True, tasks=_GENERATE),
    RouteSpec("/v1/completions", _POST, lambda h: h.completion.create, "Text completion",
              _OPENAI, CompletionRequest, CompletionResponse, CompletionStreamResponse,
              runs_model=True, tasks=_GENERATE),
    RouteSpec("/v1/responses", _POST, lambda h: h.responses.create,
              "Response (OpenAI's Responses API)", _OPENAI, ResponsesRequest, ResponseObject,
              runs_model=True, tasks=_GENERATE),
    RouteSpec("/v1/responses/{response_id}", _GET, lambda h: h.responses.retrieve,
              "A stored response", _OPENAI, response=ResponseObject),
    RouteSpec("/v1/responses/{response_id}", ("DELETE",), lambda h: h.responses.delete,
              "Forget a stored response", _OPENAI),
    RouteSpec("/v1/messages", _POST, lambda h: h.messages.create,
              "Message (Anthropic's Messages API)", _ANTHROPIC, MessagesRequest, MessageResponse,
              runs_model=True, tasks=_GENERATE),
    RouteSpec("/v1/messages/count_tokens", _POST, lambda h: h.messages.count_tokens,
              "Tokens a Messages request's prompt takes", _ANTHROPIC, CountTokensRequest,
              CountTokensResponse, tasks=_GENERATE),
    RouteSpec("/v1/audio/transcriptions", _POST, lambda h: h.audio.transcriptions,
              "Transcription of an audio file (multipart/form-data; speech-to-text models)",
              _OPENAI, runs_model=True, tasks=_GENERATE, body="form"),
    RouteSpec("/v1/audio/translations", _POST, lambda h: h.audio.translations,
              "English translation of an audio file (multipart/form-data)", _OPENAI,
              runs_model=True, tasks=_GENERATE, body="form"),
    RouteSpec("/v1/embeddings", _POST, lambda h: h.pooling.embeddings, "Embeddings (task embed)",
              _OPENAI, EmbeddingRequest, EmbeddingResponse, runs_model=True, tasks=("embed",)),
    RouteSpec("/v1/models", _GET, lambda h: h.info.models, "Served models", _OPENAI,
              response=ModelList),
    RouteSpec("/v1/models/{model:path}", _GET, lambda h: h.info.model, "One served model",
              _OPENAI, response=ModelCard),
    RouteSpec("/generate", _POST, lambda h: h.generate.generate,
              "LMDeploy's or SGLang's /generate (told apart by the body)", _PEERS,
              (GenerateRequest, SGLangGenerateRequest),
              (GenerateResponse, SGLangGenerateOutput, list[SGLangGenerateOutput]),
              runs_model=True, tasks=_GENERATE),
    RouteSpec("/abort_request", _POST, lambda h: h.lmdeploy.abort_request,
              "Abort requests by id or session", _PEERS, AbortRequest),
    RouteSpec("/tokenize", _POST, lambda h: h.tokenize.tokenize,
              "Tokenize a prompt or chat messages (vLLM's)", _OPENAI,
              (TokenizeCompletionRequest, TokenizeChatRequest), TokenizeResponse),
    RouteSpec("/detokenize", _POST, lambda h: h.tokenize.detokenize,
              "Token ids to text (vLLM's)", _OPENAI, DetokenizeRequest, DetokenizeResponse),
    RouteSpec("/pooling", _POST, lambda h: h.pooling.pooling,
              "Pooled vectors or scores (vLLM's and LMDeploy's /pooling)", _POOLING,
              PoolingRequest, PoolingResponse, runs_model=True,
              tasks=("embed", "classify", "reward")),
    RouteSpec("/classify", _POST, lambda h: h.pooling.classify,
              "Label probabilities (task classify)", _POOLING, ClassificationRequest,
              ClassificationResponse, runs_model=True, tasks=("classify",)),
    RouteSpec("/score", _POST, lambda h: h.pooling.score,
              "Scores of text pairs (cross-encoders, embedding models)", _POOLING, ScoreRequest,
              ScoreResponse, runs_model=True, tasks=("embed", "classify")),
    RouteSpec("/v1/encode", _POST, lambda h: h.pooling.encode, "LMDeploy's tokenization",
              _PEERS, EncodeRequest, EncodeResponse),
    *(_control(route, path) for route in CONTROL_ROUTES for path in route.paths),
    RouteSpec("/weight_version", _GET, lambda h: h.control.get_weight_version,
              "The weights' version", _CONTROL),
    RouteSpec("/get_weight_version", _GET, lambda h: h.control.get_weight_version,
              "The weights' version", _CONTROL),
    RouteSpec("/is_sleeping", _GET, lambda h: h.control.is_sleeping, "Whether the server sleeps",
              _CONTROL),
    RouteSpec("/is_paused", _GET, lambda h: h.control.is_paused,
              "Whether generation is paused", _CONTROL),
    RouteSpec("/get_model_info", _GET, lambda h: h.info.get_model_info,
              "The model (SGLang's names)", _CONTROL),
    RouteSpec("/get_server_info", _GET, lambda h: h.info.get_server_info,
              "/server_info with SGLang's names", _CONTROL),
    RouteSpec("/model_info", _GET, lambda h: h.info.get_model_info,
              "Same as /get_model_info (SGLang's newer name)", _ROUTERS),
    RouteSpec("/v1/completions/render", _POST, lambda h: h.router.render_completion,
              "The prompts' token ids (vLLM's render)", _ROUTERS, CompletionRequest),
    RouteSpec("/v1/chat/completions/render", _POST, lambda h: h.router.render_chat,
              "The prompt's token ids (vLLM's render)", _ROUTERS, ChatCompletionRequest),
    RouteSpec("/get_load", _GET, lambda h: h.router.get_load,
              "Load per data-parallel rank (SGLang's)", _ROUTERS),
    RouteSpec("/load", _GET, lambda h: h.router.load, "Requests in flight (vLLM's)", _ROUTERS),
    RouteSpec("/health_generate", _GET, lambda h: h.router.health_generate,
              "200 once one token was generated", _ROUTERS, body="empty"),
    RouteSpec("/health", _GET, lambda h: h.info.health,
              "200 while the engine serves, 503 otherwise", _OPS, body="empty"),
    RouteSpec("/ping", ("GET", "POST"), lambda h: h.info.health, "Same as /health", _OPS,
              body="empty"),
    RouteSpec("/version", _GET, lambda h: h.info.version, "The server's version", _OPS),
    RouteSpec("/server_info", _GET, lambda h: h.info.server_info,
              "Configuration and scheduler statistics", _OPS),
    RouteSpec("/metrics", _GET, lambda h: h.info.metrics, "Prometheus metrics", _OPS,
              body="text"),
    RouteSpec("/openapi.json", _GET, lambda h: h.info.openapi_json, "This document", _OPS),
    RouteSpec("/docs", _GET, lambda h: h.info.docs, "This document's page (Swagger UI)", _OPS,
              body="html"),
)  # fmt: skip

GENERATION_PATHS = frozenset(r.path for r in ROUTES if r.runs_model)
# Routes whose bodies carry an audio file: their body limit is the audio's (--max-audio-filesize-mb).
AUDIO_PATHS = frozenset(r.path for r in ROUTES if r.body == "form")

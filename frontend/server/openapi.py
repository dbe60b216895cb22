"""The server's OpenAPI 3.1 document (GET /openapi.json), generated from the msgspec structs that
decode the requests and encode the responses, and the Swagger UI page for it (GET /docs), served
from the `swagger-ui-bundle` package's files (no CDN: it works offline).

Every route of api_server.py has an entry in ROUTES (a test checks that none is missing).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec

from frontend.control.routes import CONTROL_ROUTES
from frontend.lmdeploy.protocol import (
    AbortRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    GenerateRequest,
    GenerateResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
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
from frontend.server.errors import ErrorResponse
from frontend.sglang.protocol import SGLangGenerateOutput, SGLangGenerateRequest

_REF = "#/components/schemas/{name}"
_ERROR_STATUSES = {
    "400": "The request is invalid (the error names the parameter)",
    "401": "Missing or wrong API key",
    "404": "Unknown model or request id",
    "413": "The request body is too large",
    "503": "The engine is not serving (dead, asleep, or paused)",
}


@dataclass(frozen=True)
class RouteDoc:
    path: str
    method: str
    summary: str
    tag: str
    request: Any = None  # a msgspec type, or a tuple of them (any of)
    response: Any = None  # None: a JSON object this document does not detail; a tuple: any of
    stream: Any = None  # the SSE chunk's type, for routes with `stream: true`
    text: bool = False  # the response is text/plain (Prometheus metrics)
    html: bool = False  # the response is a web page
    empty: bool = False  # the response has no body (its status says it all)


_OPENAI, _NATIVE, _CONTROL, _OPS = "OpenAI", "Native", "Control (RL trainers)", "Operations"
_POOLING = "Pooling models (embedding, classification, reward)"
_ROUTERS = "Routers (vllm-router, sglang-router)"  # frontend/server/router_routes.py

ROUTES: tuple[RouteDoc, ...] = (
    RouteDoc("/v1/chat/completions", "post", "Chat completion", _OPENAI, ChatCompletionRequest,
             ChatCompletionResponse, ChatCompletionStreamResponse),
    RouteDoc("/v1/completions", "post", "Text completion", _OPENAI, CompletionRequest,
             CompletionResponse, CompletionStreamResponse),
    RouteDoc("/v1/responses", "post", "Response (OpenAI's Responses API, text)", _OPENAI,
             ResponsesRequest, ResponseObject),
    RouteDoc("/v1/embeddings", "post", "Embeddings (task embed)", _OPENAI, EmbeddingRequest,
             EmbeddingResponse),
    RouteDoc("/v1/models", "get", "Served models", _OPENAI, response=ModelList),
    RouteDoc("/v1/models/{model}", "get", "One served model", _OPENAI, response=ModelCard),
    RouteDoc("/generate", "post", "LMDeploy's or SGLang's /generate (told apart by the body)",
             _NATIVE, (GenerateRequest, SGLangGenerateRequest),
             (GenerateResponse, SGLangGenerateOutput, list[SGLangGenerateOutput])),
    RouteDoc("/abort_request", "post", "Abort requests by id or session", _NATIVE, AbortRequest),
    RouteDoc("/tokenize", "post", "Tokenize a prompt or chat messages", _NATIVE,
             (TokenizeCompletionRequest, TokenizeChatRequest), TokenizeResponse),
    RouteDoc("/detokenize", "post", "Token ids to text", _NATIVE, DetokenizeRequest,
             DetokenizeResponse),
    RouteDoc("/pooling", "post", "Pooled vectors or scores (vLLM's and LMDeploy's /pooling)",
             _POOLING, PoolingRequest, PoolingResponse),
    RouteDoc("/classify", "post", "Label probabilities (task classify)", _POOLING,
             ClassificationRequest, ClassificationResponse),
    RouteDoc("/score", "post", "Scores of text pairs (cross-encoders, embedding models)",
             _POOLING, ScoreRequest, ScoreResponse),
    RouteDoc("/v1/encode", "post", "LMDeploy's tokenization", _NATIVE, EncodeRequest,
             EncodeResponse),
    RouteDoc("/weight_version", "get", "The weights' version", _CONTROL),
    RouteDoc("/get_weight_version", "get", "The weights' version", _CONTROL),
    RouteDoc("/is_sleeping", "get", "Whether the server sleeps", _CONTROL),
    RouteDoc("/get_model_info", "get", "The model (SGLang's names)", _CONTROL),
    RouteDoc("/get_server_info", "get", "/server_info with SGLang's names", _CONTROL),
    RouteDoc("/model_info", "get", "Same as /get_model_info (SGLang's newer name)", _ROUTERS),
    RouteDoc("/v1/completions/render", "post", "The prompts' token ids (vLLM's render)", _ROUTERS,
             CompletionRequest),
    RouteDoc("/v1/chat/completions/render", "post", "The prompt's token ids (vLLM's render)",
             _ROUTERS, ChatCompletionRequest),
    RouteDoc("/get_load", "get", "Load per data-parallel rank (SGLang's)", _ROUTERS),
    RouteDoc("/load", "get", "Requests in flight (vLLM's)", _ROUTERS),
    RouteDoc("/health_generate", "get", "200 once one token was generated", _ROUTERS,
             empty=True),
    *(
        RouteDoc(path, method.lower(), route.summary, _CONTROL, route.body)
        for route in CONTROL_ROUTES
        for path in route.paths
        for method in route.http_methods
    ),
    RouteDoc("/health", "get", "200 while the engine serves, 503 otherwise", _OPS, empty=True),
    RouteDoc("/ping", "get", "Same as /health", _OPS, empty=True),
    RouteDoc("/ping", "post", "Same as /health", _OPS, empty=True),
    RouteDoc("/version", "get", "The server's version", _OPS),
    RouteDoc("/server_info", "get", "Configuration and scheduler statistics", _OPS),
    RouteDoc("/metrics", "get", "Prometheus metrics", _OPS, text=True),
    RouteDoc("/openapi.json", "get", "This document", _OPS),
    RouteDoc("/docs", "get", "This document's page (Swagger UI)", _OPS, html=True),
)  # fmt: skip


def openapi_document(title: str, version: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of ROUTES."""
    types: list[Any] = [ErrorResponse]
    for r in ROUTES:
        for t in (r.request, r.response, r.stream):
            types += list(t) if isinstance(t, tuple) else [t] if t is not None else []
    schemas, components = msgspec.json.schema_components(types, ref_template=_REF)
    schema_of = dict(zip(map(_key, types), schemas))
    for r in ROUTES:
        for t in (r.request, r.response):
            if isinstance(t, tuple):
                schema_of[_key(t)] = {"anyOf": [schema_of[_key(x)] for x in t]}
    paths: dict[str, dict[str, Any]] = {}
    for r in ROUTES:
        paths.setdefault(r.path, {})[r.method] = _operation(r, schema_of)
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}, {}],
    }


def _key(t: Any) -> str:
    return repr(t)


def _operation(r: RouteDoc, schema_of: dict[str, Any]) -> dict[str, Any]:
    op: dict[str, Any] = {
        "summary": r.summary,
        "tags": [r.tag],
        "operationId": r.method + "_" + "_".join(re.findall(r"\w+", r.path)),
    }
    if r.path == "/v1/models/{model}":
        op["parameters"] = [
            {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
        ]
    if r.request is not None:
        op["requestBody"] = {
            "required": r.path not in _OPTIONAL_BODY,
            "content": {"application/json": {"schema": schema_of[_key(r.request)]}},
        }
    ok: dict[str, Any] = {"description": "OK"}
    if r.empty:
        pass
    elif r.text or r.html:
        kind = "text/html" if r.html else "text/plain"
        ok["content"] = {kind: {"schema": {"type": "string"}}}
    else:
        body = schema_of[_key(r.response)] if r.response is not None else {"type": "object"}
        ok["content"] = {"application/json": {"schema": body}}
        if r.stream is not None:
            ok["content"]["text/event-stream"] = {
                "schema": {"type": "string"},
                "description": "with `stream: true`: server-sent events, each `data:` a "
                f"{r.stream.__name__}, then `data: [DONE]`",
            }
    error = {"application/json": {"schema": schema_of[_key(ErrorResponse)]}}
    op["responses"] = {
        "200": ok,
        **{code: {"description": text, "content": error} for code, text in _ERROR_STATUSES.items()},
    }
    return op


# Routes whose body may be left out: the control routes whose fields all have defaults.
_OPTIONAL_BODY = frozenset(
    path
    for route in CONTROL_ROUTES
    if not any(f.required for f in msgspec.structs.fields(route.body))
    for path in route.paths
)


def docs_page(openapi_url: str, static_url: str, title: str) -> str:
    """Swagger UI for the document, from the bundled static files."""
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<link rel="stylesheet" href="{static_url}/swagger-ui.css">
</head>
<body>
<div id="swagger-ui"></div>
<script src="{static_url}/swagger-ui-bundle.js"></script>
<script>
window.ui = SwaggerUIBundle({{url: "{openapi_url}", dom_id: "#swagger-ui"}});
</script>
</body>
</html>
"""

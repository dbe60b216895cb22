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

from frontend.errors import ErrorResponse
from frontend.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    ModelCard,
    ModelList,
)
from frontend.protocol_native import (
    AbortRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    GenerateRequest,
    GenerateResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from frontend.protocol_responses import ResponseObject, ResponsesRequest
from frontend.serving_control import (
    DestroyGroupRequest,
    InitGroupRequest,
    PauseRequest,
    SleepRequest,
    UpdateFromDiskRequest,
    UpdateFromDistributedRequest,
    UpdateFromTensorRequest,
    WakeUpRequest,
)

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
    response: Any = None  # None: a JSON object this document does not detail
    stream: Any = None  # the SSE chunk's type, for routes with `stream: true`
    text: bool = False  # the response is text/plain (Prometheus metrics)
    html: bool = False  # the response is a web page
    empty: bool = False  # the response has no body (its status says it all)


_OPENAI, _NATIVE, _CONTROL, _OPS = "OpenAI", "Native", "Control (RL trainers)", "Operations"

ROUTES: tuple[RouteDoc, ...] = (
    RouteDoc("/v1/chat/completions", "post", "Chat completion", _OPENAI, ChatCompletionRequest,
             ChatCompletionResponse, ChatCompletionStreamResponse),
    RouteDoc("/v1/completions", "post", "Text completion", _OPENAI, CompletionRequest,
             CompletionResponse, CompletionStreamResponse),
    RouteDoc("/v1/responses", "post", "Response (OpenAI's Responses API, text)", _OPENAI,
             ResponsesRequest, ResponseObject),
    RouteDoc("/v1/models", "get", "Served models", _OPENAI, response=ModelList),
    RouteDoc("/v1/models/{model}", "get", "One served model", _OPENAI, response=ModelCard),
    RouteDoc("/generate", "post", "LMDeploy's /generate", _NATIVE, GenerateRequest,
             GenerateResponse),
    RouteDoc("/abort_request", "post", "Abort requests by id or session", _NATIVE, AbortRequest),
    RouteDoc("/tokenize", "post", "Tokenize a prompt or chat messages", _NATIVE,
             (TokenizeCompletionRequest, TokenizeChatRequest), TokenizeResponse),
    RouteDoc("/detokenize", "post", "Token ids to text", _NATIVE, DetokenizeRequest,
             DetokenizeResponse),
    RouteDoc("/pause_generation", "post", "Pause generation (abort, wait or keep)", _CONTROL,
             PauseRequest),
    RouteDoc("/resume_generation", "post", "Resume generation", _CONTROL),
    RouteDoc("/reset_prefix_cache", "post", "Forget cached prefixes", _CONTROL),
    RouteDoc("/update_weights_from_disk", "post", "Reload weights from a checkpoint", _CONTROL,
             UpdateFromDiskRequest),
    RouteDoc("/update_weights", "post", "Push weights as tensors", _CONTROL,
             UpdateFromTensorRequest),
    RouteDoc("/update_weights_from_tensor", "post", "Push weights as tensors", _CONTROL,
             UpdateFromTensorRequest),
    RouteDoc("/init_weights_update_group", "post", "Join the trainer's process group", _CONTROL,
             InitGroupRequest),
    RouteDoc("/update_weights_from_distributed", "post", "Receive a broadcast of weights",
             _CONTROL, UpdateFromDistributedRequest),
    RouteDoc("/destroy_weights_update_group", "post", "Leave the trainer's group", _CONTROL,
             DestroyGroupRequest),
    RouteDoc("/weight_version", "get", "The weights' version", _CONTROL),
    RouteDoc("/get_weight_version", "get", "The weights' version", _CONTROL),
    RouteDoc("/sleep", "post", "Free the KV cache (level 1) and the weights (level 2)", _CONTROL,
             SleepRequest),
    RouteDoc("/wakeup", "post", "Bring back what sleep freed", _CONTROL, WakeUpRequest),
    RouteDoc("/wake_up", "post", "Bring back what sleep freed", _CONTROL, WakeUpRequest),
    RouteDoc("/is_sleeping", "get", "Whether the server sleeps", _CONTROL),
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
        if isinstance(r.request, tuple):
            schema_of[_key(r.request)] = {"anyOf": [schema_of[_key(t)] for t in r.request]}
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


# Control routes whose body may be left out (their fields all have defaults).
_OPTIONAL_BODY = frozenset({"/pause_generation", "/sleep", "/wakeup", "/wake_up"})


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

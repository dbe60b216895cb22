"""The server's OpenAPI 3.1 document (GET /openapi.json), generated from the msgspec structs that
decode the requests and encode the responses, and the Swagger UI page for it (GET /docs), served
from the `swagger-ui-bundle` package's files (no CDN: it works offline).

Its routes are server/routes.py's ROUTES, the table the app's routes are built from.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from frontend.common.errors import (
    ANTHROPIC_PATH_PREFIX,
    AnthropicErrorResponse,
    ErrorResponse,
)
from frontend.server.routes import ROUTES, RouteSpec

_REF = "#/components/schemas/{name}"
_ERROR_STATUSES = {
    "400": "The request is invalid (the error names the parameter)",
    "401": "Missing or wrong API key",
    "404": "Unknown model or request id",
    "413": "The request body is too large",
    "503": "The engine is not serving (dead, asleep, or paused)",
}


def openapi_document(title: str, version: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of ROUTES."""
    types: list[Any] = [ErrorResponse, AnthropicErrorResponse]
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
        path = r.path.replace(":path}", "}")  # Starlette's converter; OpenAPI has none
        for method in r.methods:
            paths.setdefault(path, {})[method.lower()] = _operation(r, method.lower(), schema_of)
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


def _operation(r: RouteSpec, method: str, schema_of: dict[str, Any]) -> dict[str, Any]:
    op: dict[str, Any] = {
        "summary": r.summary,
        "tags": [r.tag],
        "operationId": method + "_" + "_".join(re.findall(r"\w+", r.path.replace(":path", ""))),
    }
    names = re.findall(r"\{(\w+)", r.path)
    if names:
        op["parameters"] = [
            {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
            for name in names
        ]
    if r.request is not None:
        op["requestBody"] = {
            "required": not r.optional_body,
            "content": {"application/json": {"schema": schema_of[_key(r.request)]}},
        }
    ok: dict[str, Any] = {"description": "OK"}
    if r.body == "form":
        op["requestBody"] = {"required": True, "content": {"multipart/form-data": _AUDIO_FORM}}
        ok["content"] = {
            "application/json": {"schema": {"type": "object"}},
            "text/plain": {"schema": {"type": "string"}},
            "text/event-stream": {"schema": {"type": "string"}},
        }
    elif r.body == "empty":
        pass
    elif r.body in ("text", "html"):
        kind = "text/html" if r.body == "html" else "text/plain"
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
    shape = AnthropicErrorResponse if r.path.startswith(ANTHROPIC_PATH_PREFIX) else ErrorResponse
    error = {"application/json": {"schema": schema_of[_key(shape)]}}
    op["responses"] = {
        "200": ok,
        **{code: {"description": text, "content": error} for code, text in _ERROR_STATUSES.items()},
    }
    return op


# /v1/audio/*'s form, as OpenAI's (frontend/openai/transcription.py reads it).
_AUDIO_FORM = {
    "schema": {
        "type": "object",
        "required": ["file"],
        "properties": {
            "file": {"type": "string", "format": "binary"},
            "model": {"type": "string"},
            "language": {"type": "string"},
            "prompt": {"type": "string"},
            "response_format": {
                "type": "string",
                "enum": ["json", "text", "srt", "verbose_json", "vtt"],
            },
            "temperature": {"type": "number"},
            "timestamp_granularities[]": {"type": "array", "items": {"type": "string"}},
            "stream": {"type": "boolean"},
        },
    }
}


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

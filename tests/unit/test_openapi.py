"""The OpenAPI document: every route api_server.py registers is in it; requests and errors refer
to their msgspec structs' schemas. (tests/integration/test_fuzz.py loads it with schemathesis,
which checks it as an OpenAPI document.)"""

from __future__ import annotations

import ast
from pathlib import Path

from frontend.openapi import ROUTES, openapi_document

API_SERVER = Path(__file__).resolve().parents[2] / "frontend" / "api_server.py"


def _registered_routes() -> set[tuple[str, str]]:
    """(path, method) of every `Route("/path", handler, methods=[...])` in api_server.py."""
    routes = set()
    for node in ast.walk(ast.parse(API_SERVER.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Route":
            path = node.args[0].value
            methods = next(k.value for k in node.keywords if k.arg == "methods")
            for m in methods.elts:
                # starlette's {name:path} converter is OpenAPI's {name}
                routes.add((path.replace(":path}", "}"), m.value.lower()))
    return routes


def test_every_route_is_documented() -> None:
    registered = _registered_routes()
    assert len(registered) > 25
    documented = {(r.path, r.method) for r in ROUTES}
    assert registered == documented


def test_document_structure() -> None:
    doc = openapi_document("tern", "1")
    assert doc["openapi"].startswith("3.1")
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    ref = chat["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    request = doc["components"]["schemas"][ref.rsplit("/", 1)[-1]]
    assert {"messages", "tools", "response_format", "structured_outputs"} <= set(
        request["properties"]
    )
    error = chat["responses"]["400"]["content"]["application/json"]["schema"]["$ref"]
    assert error.endswith("/ErrorResponse")
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            assert op["operationId"] and "200" in op["responses"], (path, method)

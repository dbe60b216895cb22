"""The OpenAPI document: every route the app registers is in it; requests and errors refer
to their msgspec structs' schemas. (tests/system/test_fuzz.py loads it with schemathesis,
which checks it as an OpenAPI document.)"""

from __future__ import annotations

from types import SimpleNamespace
from unittest.mock import MagicMock

from starlette.routing import Route

from enginecore.config import Config, ModelConfig
from frontend.cli.server import FrontendConfig
from frontend.server.app import build_app
from frontend.server.openapi import openapi_document


def _registered_routes() -> set[tuple[str, str]]:
    """(path, method) of every route of the app server/app.py builds."""
    engine = SimpleNamespace(ready=SimpleNamespace(max_model_len=64))
    config = Config(model=ModelConfig(path="/m", served_model_name="m"))
    app = build_app(config, FrontendConfig(("m",)), engine, MagicMock())  # type: ignore[arg-type]
    routes = set()
    for route in app.routes:
        if isinstance(route, Route):
            for m in route.methods - {"HEAD"}:
                # starlette's {name:path} converter is OpenAPI's {name}
                routes.add((route.path.replace(":path}", "}"), m.lower()))
    return routes


def test_every_route_is_documented() -> None:
    registered = _registered_routes()
    assert len(registered) > 25
    paths = openapi_document("tern", "1")["paths"]
    documented = {(path, method) for path, ops in paths.items() for method in ops}
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

"""Who may call the control routes, checked by calling AccessMiddleware as an ASGI app with fake
scopes (no sockets: a "remote" client is just a tuple in the scope): loopback clients only when no
key is set, anyone with --allow-remote-control, the admin key alone when set; CONTROL_PATHS matches
the state-changing control routes of the app; start-up warnings."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any
from unittest.mock import MagicMock

import pytest

from enginecore.config import Config, ModelConfig
from frontend.cli.server import FrontendConfig
from frontend.control.serving import ControlServing
from frontend.server.app import build_app
from frontend.server.middleware import CONTROL_PATHS, AccessMiddleware, access_warnings, is_loopback

REMOTE = ("10.1.2.3", 5000)
LOCAL = ("127.0.0.1", 5000)


async def inner_app(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"passed"})


def call(
    middleware: AccessMiddleware,
    path: str,
    client: tuple[str, int] | None,
    key: str | None = None,
) -> tuple[int, dict[str, bytes], bytes]:
    headers = [] if key is None else [(b"authorization", f"Bearer {key}".encode())]
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers, "client": client}
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(middleware(scope, receive, send))
    start, body = sent
    return start["status"], dict(start["headers"]), body["body"]


def guard(**kw: Any) -> AccessMiddleware:
    return AccessMiddleware(inner_app, kw.pop("api_key", None), **kw)


def test_control_routes_answer_loopback_clients_only_without_a_key() -> None:
    mw = guard()
    for path in sorted(CONTROL_PATHS):
        status, headers, body = call(mw, path, REMOTE)
        assert status == 403, path
        assert headers[b"content-type"] == b"application/json"
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == "remote_control_forbidden"
        assert error["type"] == "invalid_request_error"
        assert path in error["message"]
        assert "--allow-remote-control" in error["message"]
        assert "--admin-api-key" in error["message"]
    for client in (LOCAL, ("127.8.9.10", 1), ("::1", 1), ("::ffff:127.0.0.1", 1)):
        assert call(mw, "/sleep", client) == (200, {}, b"passed"), client
    # Clients that are not IP addresses (or none at all) are not local.
    assert call(mw, "/sleep", ("testclient", 1))[0] == 403
    assert call(mw, "/sleep", None)[0] == 403
    # Other routes (read-only control ones too) stay open without a key.
    for path in ("/v1/completions", "/abort_request", "/weight_version", "/is_sleeping"):
        assert call(mw, path, REMOTE)[0] == 200, path


def test_allow_remote_control() -> None:
    mw = guard(allow_remote_control=True)
    assert call(mw, "/update_weights_from_disk", REMOTE) == (200, {}, b"passed")


def test_admin_key_opens_control_routes_only() -> None:
    mw = guard(api_key="user", admin_api_key="admin", allow_remote_control=True)
    for key in (None, "user", "wrong"):
        status, headers, body = call(mw, "/sleep", LOCAL, key)
        assert status == 401 and headers[b"www-authenticate"] == b"Bearer", key
        error = json.loads(body)["error"]
        assert error["code"] == "invalid_api_key" and "--admin-api-key" in error["message"]
    assert call(mw, "/sleep", REMOTE, "admin")[0] == 200
    assert call(mw, "/v1/completions", REMOTE, "user")[0] == 200
    assert call(mw, "/v1/completions", REMOTE, "admin")[0] == 401
    assert call(mw, "/health", REMOTE)[0] == 200


def test_api_key_guards_control_routes_without_an_admin_key() -> None:
    mw = guard(api_key="user")
    assert call(mw, "/sleep", LOCAL)[0] == 401  # loopback is no substitute for the key
    assert call(mw, "/sleep", REMOTE, "user")[0] == 200
    # An admin key alone leaves the other routes open.
    mw = guard(admin_api_key="admin")
    assert call(mw, "/v1/completions", REMOTE)[0] == 200
    assert call(mw, "/sleep", LOCAL)[0] == 401


def test_control_paths_are_the_state_changing_control_routes() -> None:
    engine = SimpleNamespace(ready=SimpleNamespace(max_model_len=64))
    config = Config(model=ModelConfig(path="/m", served_model_name="m"))
    app = build_app(config, FrontendConfig(("m",)), engine, MagicMock())  # type: ignore[arg-type]
    state_changing = {
        route.path for route in app.routes if hasattr(getattr(route, "endpoint", None), "control")
    }
    assert state_changing == CONTROL_PATHS
    # ControlServing's other routes only read.
    readers = {
        route.path
        for route in app.routes
        if isinstance(getattr(getattr(route, "endpoint", None), "__self__", None), ControlServing)
    }
    assert readers and not readers & CONTROL_PATHS
    assert all(route.methods <= {"GET", "HEAD"} for route in app.routes if route.path in readers)


def test_is_loopback() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("127.255.0.1") and is_loopback("::1")
    assert is_loopback("::ffff:127.0.0.1")
    for host in ("0.0.0.0", "::", "10.0.0.1", "::ffff:10.0.0.1", "localhost", "", None):
        assert not is_loopback(host), host


@pytest.mark.parametrize(
    "host, kw, expected",
    [
        ("127.0.0.1", {}, []),
        ("0.0.0.0", {}, ["listening on 0.0.0.0 with no --api-key"]),
        ("::", {"allow_remote_control": True}, ["listening on ::", "--allow-remote-control"]),
        ("127.0.0.1", {"allow_remote_control": True}, ["--allow-remote-control"]),
        ("0.0.0.0", {"api_key": "k", "allow_remote_control": True}, []),
        ("0.0.0.0", {"admin_api_key": "k"}, []),
    ],
)
def test_access_warnings(host: str, kw: dict[str, Any], expected: list[str]) -> None:
    warnings = access_warnings(FrontendConfig(("m",), **kw), host)
    assert len(warnings) == len(expected)
    for warning, start in zip(warnings, expected):
        assert warning.startswith(start), warning

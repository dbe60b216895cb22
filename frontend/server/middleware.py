"""ASGI middleware of the HTTP server: access control, request-body limits, X-Request-Id echo.

Order (outermost first, set up in server/app.py): CORS (starlette's; answers preflights itself),
AccessMiddleware (401 or 403 before anything reads the body or reaches the engine; left out when
it has nothing to check), BodyLimitMiddleware (413, 408), RequestIdMiddleware. Each is a plain ASGI
callable: streaming responses pass through untouched.

Access: OPEN_PATHS need nothing; CONTROL_PATHS (they change what every user gets) need the admin key
when one is set, else the API key when one is set, else a loopback client (unless remote control is
allowed); every other route needs the API key when one is set.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from frontend.common.errors import APIError
from frontend.common.http import send_error
from frontend.control.routes import CONTROL_PATHS

if TYPE_CHECKING:
    from frontend.cli.server import FrontendConfig

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Routes open without a key: liveness, monitoring, the version.
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/ping", "/openapi.json", "/docs"})
DOCS_STATIC = "/docs/static"  # Swagger UI's files, for /docs: open too


# Routes that change the engine's state for every user (weights, sleep, pause, the prefix cache) are
# declared in control/routes.py.
def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value
    return None


def is_loopback(host: str | None) -> bool:
    """True for 127.0.0.0/8, ::1 and their IPv4-mapped forms; False for names and None."""
    try:
        address = ipaddress.ip_address(host or "")
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # a dual-stack socket sees 127.0.0.1 as ::ffff:127.0.0.1
    return address.is_loopback


def access_warnings(frontend: FrontendConfig, host: str) -> list[str]:
    """What start-up warns about, for a server listening on `host` (the bound address)."""
    if frontend.api_key is not None or frontend.admin_api_key is not None:
        return []
    warnings = []
    if not is_loopback(host):
        control = (
            "" if frontend.allow_remote_control else "; control routes answer clients on this host"
        )
        warnings.append(
            f"listening on {host} with no --api-key: every client that reaches the port can use "
            f"the API{control}"
        )
    if frontend.allow_remote_control:
        warnings.append(
            "--allow-remote-control with no --admin-api-key or --api-key: every client that "
            "reaches the port can update the weights, pause, sleep and reset the server"
        )
    return warnings


class AccessMiddleware:
    """Answers 401 (wrong or missing key) or 403 (remote client, control route) at once."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        admin_api_key: str | None = None,
        allow_remote_control: bool = False,
    ) -> None:
        self.app = app
        self._api_key = None if api_key is None else b"Bearer " + api_key.encode()
        control_key = admin_api_key if admin_api_key is not None else api_key
        self._control_key = None if control_key is None else b"Bearer " + control_key.encode()
        self._is_admin_key = admin_api_key is not None
        self.allow_remote_control = allow_remote_control

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if (
            scope["type"] == "http"
            and path not in OPEN_PATHS
            and not path.startswith(DOCS_STATIC + "/")
        ):
            err = self._check(scope)
            if err is not None:
                headers = ((b"www-authenticate", b"Bearer"),) if err.status == 401 else ()
                await send_error(send, err, headers, path)
                return
        await self.app(scope, receive, send)

    def _check(self, scope: Scope) -> APIError | None:
        if scope["path"] not in CONTROL_PATHS:
            return None if self._api_key is None else _check_key(scope, self._api_key, "API key")
        if self._control_key is not None:
            what = "admin API key (--admin-api-key)" if self._is_admin_key else "API key"
            return _check_key(scope, self._control_key, what)
        client = scope.get("client")
        if self.allow_remote_control or is_loopback(client[0] if client else None):
            return None
        return APIError(
            f"{scope['path']} changes the server for every user and is served only to clients on "
            "this host when no key is set: start tern with --admin-api-key (or --api-key) and "
            "send 'Authorization: Bearer <key>', or with --allow-remote-control",
            403,
            None,
            "remote_control_forbidden",
        )


def _check_key(scope: Scope, expected: bytes, what: str) -> APIError | None:
    given = _header(scope, b"authorization") or b""
    api_key = _header(scope, b"x-api-key")  # what the anthropic SDK sends
    if not given and api_key is not None:
        given = b"Bearer " + api_key
    # NOTE: constant-time comparison: response timing must not reveal the key's prefix.
    if hmac.compare_digest(given, expected):
        return None
    return APIError(
        f"Incorrect or missing {what}: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
        401,
        None,
        "invalid_api_key",
    )


UNLIMITED_BODY_PATHS = frozenset(
    {"/update_weights", "/update_weights_from_tensor", "/load_lora_adapter_from_tensors"}
)
assert UNLIMITED_BODY_PATHS <= CONTROL_PATHS  # unlimited bodies only behind the control guard


class BodyLimitMiddleware:
    """Request bodies over `max_bytes` get 413: at once by Content-Length, else while reading.
    Bodies not complete within `timeout_s` of the request's start get 408 (a client sending one
    byte a second must not hold a connection and a task forever)."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        timeout_s: float = 30.0,
        path_limits: dict[str, int] | None = None,
    ) -> None:
        """path_limits: paths whose bodies have their own cap instead (audio uploads)."""
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.path_limits = path_limits or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Weight pushes carry whole checkpoints; those routes are guarded (CONTROL_PATHS).
        if scope["type"] != "http" or scope["path"] in UNLIMITED_BODY_PATHS:
            await self.app(scope, receive, send)
            return
        max_bytes = self.path_limits.get(scope["path"], self.max_bytes)
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > max_bytes:
            await send_error(send, self._too_large(max_bytes), path=scope.get("path", ""))
            return
        received = 0
        is_body_complete = False
        deadline = time.monotonic() + self.timeout_s

        async def limited_receive() -> Message:
            nonlocal received, is_body_complete
            if is_body_complete:
                # NOTE: no deadline once the body is in: streaming responses wait here for the
                # client's disconnect for as long as they stream.
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), deadline - time.monotonic())
            except TimeoutError:
                # Raised inside the route's body read: the app's APIError handler answers 408,
                # and the server then closes the connection (the body was not read to its end).
                raise self._timed_out() from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > max_bytes:
                    # Raised inside the route's body read: the app's APIError handler answers 413.
                    raise self._too_large(max_bytes)
                is_body_complete = not message.get("more_body", False)
            else:
                is_body_complete = True  # http.disconnect: nothing more will come
            return message

        await self.app(scope, limited_receive, send)

    def _too_large(self, max_bytes: int) -> APIError:
        return APIError(
            f"request body too large (the limit is {max_bytes} bytes)", 413, None,
            "request_too_large",
        )  # fmt: skip

    def _timed_out(self) -> APIError:
        return APIError(
            f"request body not received within {self.timeout_s:g} s (--request-body-timeout)",
            408, None, "request_timeout",
        )  # fmt: skip


class RequestIdMiddleware:
    """Echoes the client's X-Request-Id on every response that does not set one itself."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = _header(scope, b"x-request-id") if scope["type"] == "http" else None
        if request_id is None:
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(k.lower() == b"x-request-id" for k, _ in headers):
                    headers.append((b"x-request-id", request_id))
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, send_with_id)

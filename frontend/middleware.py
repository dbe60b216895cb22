"""ASGI middleware of the HTTP server: API keys, request-body limits, X-Request-Id echo.

Order (outermost first, set up in api_server.py): CORS (starlette's; answers preflights itself),
ApiKeyMiddleware (401 before anything reads the body or reaches the engine), BodyLimitMiddleware
(413), RequestIdMiddleware. Each is a plain ASGI callable: streaming responses pass through untouched.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import msgspec

from frontend.errors import APIError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Routes open without a key: liveness, monitoring, the version.
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/ping"})

_json = msgspec.json.Encoder()


async def send_error(
    send: Send, err: APIError, headers: tuple[tuple[bytes, bytes], ...] = ()
) -> None:
    body = _json.encode(err.to_response())
    await send(
        {
            "type": "http.response.start",
            "status": err.status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value
    return None


class ApiKeyMiddleware:
    """Every route but OPEN_PATHS needs `Authorization: Bearer <key>`; otherwise 401 at once."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = b"Bearer " + api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = _header(scope, b"authorization") or b""
            # NOTE: constant-time comparison: response timing must not reveal the key's prefix.
            if not hmac.compare_digest(given, self._expected):
                err = APIError(
                    "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                    401,
                    None,
                    "invalid_api_key",
                )
                await send_error(send, err, ((b"www-authenticate", b"Bearer"),))
                return
        await self.app(scope, receive, send)


UNLIMITED_BODY_PATHS = frozenset({"/update_weights", "/update_weights_from_tensor"})


class BodyLimitMiddleware:
    """Request bodies over `max_bytes` get 413: at once by Content-Length, else while reading."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Weight pushes carry whole checkpoints; those routes need the API key when one is set.
        if scope["type"] != "http" or scope["path"] in UNLIMITED_BODY_PATHS:
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await send_error(send, self._too_large())
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # Raised inside the route's body read: the app's APIError handler answers 413.
                    raise self._too_large()
            return message

        await self.app(scope, limited_receive, send)

    def _too_large(self) -> APIError:
        return APIError(
            f"request body too large (the limit is {self.max_bytes} bytes)", 413, None,
            "request_too_large",
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

"""HTTP helpers every room that answers requests shares: JSON and SSE bodies, error responses (as
a starlette Response or straight on an ASGI `send`), the request-id header.

Error bodies take the shape the clients of the path parse (frontend/common/errors.py error_body).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import msgspec
from starlette.responses import Response

from frontend.common.errors import APIError, error_body

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

_json = msgspec.json.Encoder()
REQUEST_ID_HEADER = "X-Request-Id"


# What JSON leaves raw but str.splitlines() ends a line at: clients that split a stream with it
# (httpx's aiter_lines, through 0.28 at least) cut an event in two where a sampled token holds one.
_LINE_BREAKS_JSON_KEEPS = (
    (b"\xe2\x80\xa8", b"\\u2028"),
    (b"\xe2\x80\xa9", b"\\u2029"),
    (b"\xc2\x85", b"\\u0085"),
)


def sse_json(obj: Any) -> bytes:
    """obj as JSON for an event's data line, every character a line splitter may break at escaped
    (in UTF-8 these byte runs are those characters alone)."""
    data = _json.encode(obj)
    for raw, escaped in _LINE_BREAKS_JSON_KEEPS:
        data = data.replace(raw, escaped)
    return data


def sse(obj: Any) -> bytes:
    return b"data: " + sse_json(obj) + b"\n\n"


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_json.encode(obj), status, headers=headers, media_type="application/json")


def error_response(err: APIError, path: str = "") -> Response:
    """The error in the shape the clients of `path` parse (frontend/common/errors.py)."""
    return json_response(error_body(err, path), err.status)


async def send_error(
    send: Send, err: APIError, headers: tuple[tuple[bytes, bytes], ...] = (), path: str = ""
) -> None:
    body = _json.encode(error_body(err, path))
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

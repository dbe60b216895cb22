"""One request to an ASGI app inside this process, its answer read as it is sent: how TernServer's
Python methods (chat, completions, sleep...) reach tern's routes with no socket or HTTP parsing,
so that every validation, error body and stream is the HTTP server's own.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

from starlette.types import ASGIApp, Message


class ASGIAnswer:
    """The status and headers once the app started its response; `body()` streams the rest."""

    def __init__(self, status: int, headers: dict[str, str], chunks: AsyncIterator[bytes]) -> None:
        self.status = status
        self.headers = headers
        self._chunks = chunks

    def body(self) -> AsyncIterator[bytes]:
        return self._chunks

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self._chunks])


async def call_app(
    app: ASGIApp,
    method: str,
    path: str,
    body: bytes = b"",
    query: str = "",
    headers: Mapping[str, str] | None = None,
) -> ASGIAnswer:
    headers = {"content-type": "application/json", **(headers or {})}
    headers["content-length"] = str(len(body))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
    }
    sent: asyncio.Queue[Message | BaseException] = asyncio.Queue()
    disconnected = asyncio.Event()
    request_read = False

    async def receive() -> Message:
        nonlocal request_read
        if not request_read:
            request_read = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()  # the reader stopped reading: the client went away
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await sent.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        except BaseException as e:  # noqa: BLE001 - handed to the reader
            await sent.put(e)
            raise

    task = asyncio.create_task(run())
    start = await sent.get()
    if isinstance(start, BaseException):
        raise start
    assert start["type"] == "http.response.start", start

    async def chunks() -> AsyncIterator[bytes]:
        try:
            while True:
                message = await sent.get()
                if isinstance(message, BaseException):
                    raise message
                if message["type"] != "http.response.body":
                    continue
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    return
        finally:
            disconnected.set()
            if not task.done():
                task.cancel()
            with contextlib.suppress(BaseException):
                await task

    status: int = start["status"]
    answer_headers = {k.decode(): v.decode() for k, v in start.get("headers", [])}
    return ASGIAnswer(status, answer_headers, chunks())


def request_body(request: Any) -> dict[str, Any]:
    """A request as JSON: Ray's pydantic models, msgspec structs, or a dict."""
    if isinstance(request, Mapping):
        return dict(request)
    if hasattr(request, "model_dump"):
        return request.model_dump(exclude_unset=True, mode="json")
    import msgspec

    return msgspec.to_builtins(request)

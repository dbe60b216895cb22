"""uvicorn's HTTP/1.1 protocol with a keep-alive close that cannot race a request already sent.

The race (seen as "Server disconnected" / "Connection reset by peer" under `vllm bench serve`):
uvicorn closes a kept-alive connection when its idle timer fires. Under uvloop, libuv runs due timers
before it polls sockets, so when the frontend's event loop has been starved past the timer (both
cores busy with the model) the timer closes a connection whose next request is already in the
socket's buffer, unread. The client sent it on a connection it believed open and gets the close
instead of an answer. Two things stop it: the close is skipped while the socket has unread bytes (the
loop reads them right after and the request is served), and the default idle time outlasts the
connection pools of the clients people put in front (aiohttp 15 s, vLLM's benchmark 60 s, Go and
reqwest 90 s), so the client, not the server, ends an idle connection.

The parser is httptools (llhttp, uvicorn's choice when installed) rather than the pure-Python h11:
a streamed token costs the frontend's event loop ~15% less CPU, which the model's threads get back.
"""

from __future__ import annotations

import select

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

DEFAULT_KEEP_ALIVE_S = 120.0


class KeepAliveSafeHttpProtocol(HttpToolsProtocol):
    def timeout_keep_alive_handler(self) -> None:
        if self.transport.is_closing():
            return
        if _has_unread_bytes(self.transport):
            # A request (or the client's FIN) waits to be read: data_received cancels the timer
            # when it is a request; the idle clock restarts either way.
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )
            return
        super().timeout_keep_alive_handler()


def _has_unread_bytes(transport: object) -> bool:
    sock = transport.get_extra_info("socket")  # type: ignore[attr-defined]
    if sock is None:
        return False
    try:
        readable, _, _ = select.select([sock.fileno()], [], [], 0)
    except (OSError, ValueError):
        return False
    return bool(readable)

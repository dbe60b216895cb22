"""A producer's bootstrap: the registry of the KV leases its requests lent, and the ZMQ ROUTER that
answers consumers about them (one per server, whatever --dp).

A producing request's last output fills its lease (`LeaseRegistry.lend`: the replica, the blocks,
the prompt's length); a producing request that ends without lending (an error, an abort, the
client gone) is recorded as failed (`fail`) so that a waiting consumer stops at once. Both are
kept for the lease's time (the engine core frees unreleased blocks then by itself).

The wire (msgspec msgpack, enginecore/messages.py): a consumer's REQ (or DEALER) socket sends a
`BootstrapRequest`; the reply is a `LeaseReply`:
- LeaseQuery -> "ready" (block ids, prompt tokens, the replica's worker endpoints and layouts by
  rank), "pending" (not lent yet, or unknown: SGLang's router reaches producer and consumer at
  once, so a consumer may ask first), or "failed" (with `error`).
- LeaseRelease -> the lease's blocks go back to its replica's pool (RequestType.RELEASE_KV) and the
  lease is forgotten; the reply is LeaseReply(state="released"), also for a lease not held.
This module knows nothing about HTTP nor about how blocks are copied.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from enginecore.messages import (
    BootstrapRequest,
    EngineReady,
    LeaseQuery,
    LeaseRelease,
    LeaseReply,
)

logger = logging.getLogger("tern.frontend")

RELEASED = "released"  # the reply state of a LeaseRelease


@dataclass
class Lease:
    replica: int
    block_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # the prompt (its consumer checks its own)
    expires_at: float = 0.0  # time.monotonic()
    error: str | None = None  # set: the producing request ended without lending
    other_block_ids: list[list[int]] = field(default_factory=list)  # further KV-cache groups'
    state_checkpoint: int = -1  # hybrid models: the checkpoint of the states after the blocks
    routing: bytes = b""  # --enable-return-routed-experts: the lent positions' routing rows


class LeaseRegistry:
    """Leases by id. `release_kv(replica, lease_ids)` hands blocks back to a replica's engine
    core; `ready_of(replica)` is the replica's EngineReady (its KV endpoints and layouts)."""

    def __init__(
        self,
        lease_s: float,
        release_kv: Callable[[int, list[str]], None],
        ready_of: Callable[[int], EngineReady | None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.lease_s = lease_s
        self.release_kv = release_kv
        self.ready_of = ready_of
        self.clock = clock
        self._leases: dict[str, Lease] = {}

    def __len__(self) -> int:
        self._expire()
        return len(self._leases)

    def lend(
        self,
        lease_id: str,
        replica: int,
        token_ids: list[int],
        block_ids: list[int],
        other_block_ids: list[list[int]] = (),  # type: ignore[assignment]
        state_checkpoint: int = -1,
        routing: bytes = b"",
    ) -> None:
        """A producing request finished: its blocks are lent under `lease_id`."""
        self._expire()
        lease = Lease(
            replica, list(block_ids), list(token_ids), self.clock() + self.lease_s,
            other_block_ids=[list(ids) for ids in other_block_ids],
            state_checkpoint=state_checkpoint, routing=routing,
        )  # fmt: skip
        self._put(lease_id, lease)

    def fail(self, lease_id: str, replica: int, error: str, release: bool = False) -> None:
        """A producing request ended without lending (kept a lease's time: consumers fail fast).
        `release`: it was aborted here, and the engine core may have lent its blocks meanwhile:
        they go back (a release of a lease the engine core does not hold does nothing)."""
        self._expire()
        if lease_id in self._leases and self._leases[lease_id].error is None:
            return  # already lent: a late abort of a finished request changes nothing
        if release:
            self.release_kv(replica, [lease_id])
        self._put(lease_id, Lease(replica, expires_at=self.clock() + self.lease_s, error=error))

    def query(self, lease_id: str) -> LeaseReply:
        self._expire()
        lease = self._leases.get(lease_id)
        if lease is None:
            return LeaseReply("pending")
        if lease.error is not None:
            return LeaseReply("failed", error=lease.error)
        ready = self.ready_of(lease.replica)
        if ready is None:
            return LeaseReply("failed", error=f"replica {lease.replica} of the producer is gone")
        return LeaseReply(
            "ready",
            block_ids=lease.block_ids,
            num_tokens=len(lease.token_ids),
            token_ids=lease.token_ids,
            endpoints=list(ready.kv_endpoints),
            layouts=list(ready.kv_layouts),
            other_block_ids=lease.other_block_ids,
            state_checkpoint=lease.state_checkpoint,
            routing=lease.routing,
        )

    def release(self, lease_id: str) -> LeaseReply:
        lease = self._leases.pop(lease_id, None)
        if lease is not None and lease.error is None:
            self.release_kv(lease.replica, [lease_id])
        return LeaseReply(RELEASED)

    def answer(self, request: LeaseQuery | LeaseRelease) -> LeaseReply:
        if isinstance(request, LeaseQuery):
            return self.query(request.lease_id)
        return self.release(request.lease_id)

    def _put(self, lease_id: str, lease: Lease) -> None:
        self._leases.pop(lease_id, None)  # a reused id goes to the end: deadline order holds
        self._leases[lease_id] = lease

    def _expire(self) -> None:
        now = self.clock()
        # NOTE: the engine core frees an expired lease's blocks itself: forgetting is enough.
        # Entries are held in insertion order, which is deadline order (one lease_s; _put
        # re-inserts a reused id at the end): only the oldest are looked at.
        ended = []
        for lease_id, lease in self._leases.items():
            if lease.expires_at > now:
                break
            ended.append(lease_id)
        for lease_id in ended:
            del self._leases[lease_id]


class BootstrapServer:
    """The ROUTER socket at tcp://<host>:<port> answering consumers from a LeaseRegistry.
    `host`: the HTTP server's --host (every address for 0.0.0.0, ::, or empty)."""

    def __init__(self, registry: LeaseRegistry, host: str, port: int) -> None:
        self.registry = registry
        self.is_ipv6, bind_host = _bind_host(host)
        self.address = f"tcp://{bind_host}:{port}"
        self._ctx = zmq.asyncio.Context()
        self._socket: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._decoder = msgspec.msgpack.Decoder(BootstrapRequest)
        self._encoder = msgspec.msgpack.Encoder()

    def start(self) -> None:
        """Binds (raises ValueError when the port is taken) and answers in a task."""
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.is_ipv6:
            sock.setsockopt(zmq.IPV6, 1)
        try:
            sock.bind(self.address)
        except zmq.ZMQError as e:
            sock.close()
            raise ValueError(f"the KV bootstrap cannot bind {self.address}: {e}") from None
        self._socket = sock
        self._task = asyncio.ensure_future(self._serve())
        logger.info("KV bootstrap listening at %s", self.address)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._socket is not None:
            self._socket.close(linger=0)
        self._ctx.term()

    async def _serve(self) -> None:
        assert self._socket is not None
        while True:
            frames = await self._socket.recv_multipart()
            # [identity, b"", body] from a REQ socket, [identity, body] from a DEALER.
            envelope, body = frames[:-1], frames[-1]
            try:
                reply = self.registry.answer(self._decoder.decode(body))
            except msgspec.DecodeError as e:
                reply = LeaseReply("failed", error=f"bad bootstrap request: {e}")
            except Exception as e:  # a registry callback failed: answer rather than hang a peer
                logger.exception("the KV bootstrap failed to answer")
                reply = LeaseReply("failed", error=f"{type(e).__name__}: {e}")
            await self._socket.send_multipart([*envelope, self._encoder.encode(reply)])


def _bind_host(host: str) -> tuple[bool, str]:
    """(IPv6?, the host as a ZMQ tcp endpoint takes it: "*", an address, "[v6 address]")."""
    if host in ("", "0.0.0.0"):
        return False, "*"
    if host == "::":
        return True, "*"
    try:
        family, *_, addr = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0]
    except OSError as e:
        raise ValueError(f"the KV bootstrap cannot resolve {host!r}: {e}") from None
    if family == socket.AF_INET6:
        return True, f"[{addr[0]}]"
    return False, str(addr[0])


def open_bootstrap(
    lease_s: float,
    host: str,
    port: int,
    release_kv: Callable[[int, list[str]], None],
    ready_of: Callable[[int], EngineReady | None],
) -> tuple[LeaseRegistry, BootstrapServer]:
    """A producer's registry and its bootstrap, bound and answering (ValueError: cannot bind)."""
    registry = LeaseRegistry(lease_s, release_kv, ready_of)
    server = BootstrapServer(registry, host, port)
    server.start()
    return registry, server

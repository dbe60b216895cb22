"""A KV producer's bootstrap: the lease registry (lent, failed, pending, expired, released) and its
ZMQ ROUTER answering a consumer's REQ socket in-process; a producing Generation fills the
registry from its last output (or fails its lease when it errs or is aborted)."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

import msgspec
import pytest
import zmq
import zmq.asyncio

from enginecore.messages import (
    EngineCoreOutput,
    EngineReady,
    FinishReason,
    KVLayout,
    KVTransfer,
    LeaseQuery,
    LeaseRelease,
    LeaseReply,
    SamplingParams,
)
from frontend.common.errors import APIError, bad_request
from frontend.disagg.bootstrap import RELEASED, BootstrapServer, LeaseRegistry
from frontend.serving.generation import Generation, RequestFailedError
from frontend.serving.kv_answers import refusal_fails_room

LAYOUT = KVLayout("llama-tiny", "float32", 16, 1, 1, 0, [2, 16, 4, 8])
READY = EngineReady(
    model_summary="tiny", num_kv_blocks=64, block_size=16, max_model_len=512, vocab_size=100,
    kv_endpoints=["tcp://127.0.0.1:7001"], kv_layouts=[LAYOUT],
)  # fmt: skip


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeEngine:
    """What the registry calls: release_kv(replica, ids) and replica_ready(replica)."""

    def __init__(self) -> None:
        self.released: list[tuple[int, list[str]]] = []
        self.dead: set[int] = set()

    def release_kv(self, replica: int, lease_ids: list[str]) -> None:
        self.released.append((replica, lease_ids))

    def replica_ready(self, replica: int) -> EngineReady | None:
        return None if replica in self.dead else READY


def registry(engine: FakeEngine, clock: Clock | None = None) -> LeaseRegistry:
    return LeaseRegistry(30.0, engine.release_kv, engine.replica_ready, clock or Clock())


def test_registry_states() -> None:
    engine, clock = FakeEngine(), Clock()
    leases = registry(engine, clock)
    assert leases.query("a") == LeaseReply("pending")
    leases.lend("a", 1, list(range(40)), [3, 4])
    assert leases.query("a") == LeaseReply(
        "ready", [3, 4], 40, ["tcp://127.0.0.1:7001"], [LAYOUT], list(range(40))
    )
    leases.fail("b", 0, "the engine failed")
    assert leases.query("b") == LeaseReply("failed", error="the engine failed")
    leases.fail("a", 1, "late abort")  # a lent lease stays lent
    assert leases.query("a").state == "ready"
    assert len(leases) == 2
    clock.now += 31  # both expire: the engine core frees its own blocks
    assert leases.query("a").state == "pending" and len(leases) == 0
    assert engine.released == []


def test_release_reaches_the_replica_once() -> None:
    engine = FakeEngine()
    leases = registry(engine)
    leases.lend("a", 2, list(range(20)), [7])
    assert leases.release("a") == LeaseReply(RELEASED)
    assert engine.released == [(2, ["a"])]
    assert leases.release("a") == LeaseReply(RELEASED)  # not held any more: nothing sent
    leases.fail("b", 0, "x")
    leases.release("b")  # a failed lease lent nothing
    assert engine.released == [(2, ["a"])]
    assert leases.query("a").state == "pending"


def test_aborted_producer_releases_what_it_may_have_lent() -> None:
    engine = FakeEngine()
    leases = registry(engine)
    leases.fail("c", 1, "aborted", release=True)
    assert engine.released == [(1, ["c"])]
    assert leases.query("c") == LeaseReply("failed", error="aborted")


def test_dead_replica_answers_failed() -> None:
    engine = FakeEngine()
    leases = registry(engine)
    leases.lend("a", 1, list(range(16)), [1])
    engine.dead.add(1)
    reply = leases.query("a")
    assert reply.state == "failed" and "replica 1" in (reply.error or "")


def test_router_answers_req_and_dealer_clients() -> None:
    async def scenario() -> None:
        engine = FakeEngine()
        leases = registry(engine)
        server = BootstrapServer(leases, "127.0.0.1", _free_port())
        server.start()
        ctx = zmq.asyncio.Context()
        req = ctx.socket(zmq.REQ)
        req.connect(server.address)
        enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(LeaseReply)

        async def ask(sock: zmq.asyncio.Socket, msg: msgspec.Struct) -> LeaseReply:
            await sock.send(enc.encode(msg))
            frames = await asyncio.wait_for(sock.recv_multipart(), 5)
            return dec.decode(frames[-1])

        try:
            assert (await ask(req, LeaseQuery("room-1"))).state == "pending"
            leases.lend("room-1", 0, list(range(32)), [5, 6])
            reply = await ask(req, LeaseQuery("room-1"))
            assert reply.state == "ready" and reply.block_ids == [5, 6]
            assert reply.num_tokens == 32 and reply.layouts == [LAYOUT]
            assert (await ask(req, LeaseRelease("room-1"))).state == RELEASED
            assert engine.released == [(0, ["room-1"])]
            leases.fail("room-2", 0, "refused")
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(server.address)
            reply = await ask(dealer, LeaseQuery("room-2"))
            assert reply == LeaseReply("failed", error="refused")
            await req.send(b"\x01not msgpack")
            frames = await asyncio.wait_for(req.recv_multipart(), 5)
            bad = dec.decode(frames[-1])
            assert bad.state == "failed" and "bad bootstrap request" in (bad.error or "")
            dealer.close(linger=0)
        finally:
            req.close(linger=0)
            ctx.term()
            await server.close()

    asyncio.run(scenario())


def test_taken_port_is_a_clear_error() -> None:
    async def scenario() -> None:
        port = _free_port()
        first = BootstrapServer(registry(FakeEngine()), "127.0.0.1", port)
        first.start()
        try:
            second = BootstrapServer(registry(FakeEngine()), "0.0.0.0", port)
            with pytest.raises(ValueError, match="cannot bind"):
                second.start()
            await second.close()
        finally:
            await first.close()

    asyncio.run(scenario())


# --------------------------------------------------------------------------- Generation


class FakeStream:
    def __init__(self, outputs: list[EngineCoreOutput], replica: int) -> None:
        self.outputs = outputs
        self.replica = replica

    async def next(self) -> EngineCoreOutput:
        return self.outputs.pop(0)


class FakeClient:
    is_dead = False

    def __init__(self, outputs: list[EngineCoreOutput], replica: int = 0) -> None:
        self.stream = FakeStream(outputs, replica)
        self.requests: list = []
        self.aborted: list[str] = []

    def add_request(self, request):  # noqa: ANN001, ANN201
        self.requests.append(request)
        return self.stream

    def abort(self, request_ids: list[str]) -> None:
        self.aborted += request_ids


class Detok:
    """The few IncrementalDetokenizer members Generation reads."""

    num_tokens = 0
    is_stopped = False
    stop_reason = None

    def update(self, tokens: list[int], ends_with_stop_token: bool) -> None:
        self.num_tokens += len(tokens)

    def take_new_text(self, final: bool) -> str:
        return ""


def generation(client: FakeClient, leases: LeaseRegistry, role: str = "produce") -> Generation:
    return Generation(
        client, "r1", [1, 2, 3], SamplingParams(max_tokens=1), Detok(),  # type: ignore[arg-type]
        kv_transfer=KVTransfer(role, "lease-1"), leases=leases,
    )  # fmt: skip


def test_generation_lends_on_its_last_output() -> None:
    engine = FakeEngine()
    leases = registry(engine)
    out = EngineCoreOutput("r1", [7], FinishReason.LENGTH, kv_lease_block_ids=[11, 12])
    client = FakeClient([out], replica=1)
    gen = generation(client, leases)
    assert client.requests[0].kv_transfer == KVTransfer("produce", "lease-1")
    asyncio.run(gen.collect())
    assert gen.kv_lease_block_ids == [11, 12] and gen.replica == 1
    assert leases.query("lease-1") == LeaseReply(
        "ready", [11, 12], 3, ["tcp://127.0.0.1:7001"], [LAYOUT], [1, 2, 3]
    )
    gen.abort()  # the HTTP request closes: the lease stays
    assert leases.query("lease-1").state == "ready" and engine.released == []


def test_generation_fails_its_lease_on_error_and_abort() -> None:
    engine = FakeEngine()
    leases = registry(engine)
    err = EngineCoreOutput("r1", [], FinishReason.ERROR, error="out of blocks")
    gen = generation(FakeClient([err]), leases)
    with pytest.raises(RequestFailedError):
        asyncio.run(gen.collect())
    assert leases.query("lease-1") == LeaseReply("failed", error="out of blocks")
    leases = registry(engine)
    gen = generation(FakeClient([]), leases)
    gen.abort()  # the client went away before the engine answered
    reply = leases.query("lease-1")
    assert reply.state == "failed" and "aborted" in (reply.error or "")
    assert engine.released == [(0, ["lease-1"])]


def test_consuming_generation_fills_no_lease() -> None:
    leases = registry(FakeEngine())
    out = EngineCoreOutput("r1", [7], FinishReason.LENGTH)
    gen = generation(FakeClient([out]), leases, role="consume")
    asyncio.run(gen.collect())
    assert len(leases) == 0 and gen.kv_lease_block_ids is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_refused_sglang_request_fails_its_room() -> None:
    leases = registry(FakeEngine())
    serving = SimpleNamespace(leases=leases)
    with pytest.raises(APIError), refusal_fails_room(serving, 42):  # type: ignore[arg-type]
        raise bad_request("the prompt is too long", "text")
    reply = leases.query("room-42")
    assert reply.state == "failed" and "too long" in (reply.error or "")
    with refusal_fails_room(serving, 43):  # type: ignore[arg-type]
        pass  # not refused: nothing recorded
    assert leases.query("room-43").state == "pending"
    with pytest.raises(APIError), refusal_fails_room(serving, None):  # type: ignore[arg-type]
        raise bad_request("no room", "text")
    assert len(leases) == 1

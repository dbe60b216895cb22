"""A consumer's pulls: threads that fetch a request's prompt blocks from its producer.

A "consume" request is parked here, off the scheduler, while a thread asks the producer's
bootstrap where its lease is (again and again while the producer still computes: SGLang's router
reaches both servers at once), pulls each worker rank's share of the blocks from the producer's
rank of the same index, releases the lease, and posts a KVPulled to the engine core's input
socket; the engine core then schedules the request with the blocks as its computed prefix. On a
hybrid model (Qwen3.5) each rank also sends its linear-attention states after those blocks (the
producer's lease keeps them in a state checkpoint); a lease without them is not pulled: the
consumer computes the prompt. Under --enable-return-routed-experts the lease carries the routing
rows of its positions too (a producer that records none is not pulled from).

A producer that answers nothing within reply_timeout_s is taken for gone: the pull fails (and the
request fails or recomputes, load_failure_policy), it never hangs.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import msgspec
import zmq

from enginecore.config import KVTransferConfig
from enginecore.kv_transfer.files import host_name, new_path, remove
from enginecore.messages import (
    KVLayout,
    KVPull,
    KVPulled,
    KVPullReply,
    KVTransfer,
    LeaseQuery,
    LeaseRelease,
    LeaseReply,
    RequestType,
)
from enginecore.request import Request

logger = logging.getLogger("tern.engine")

# Pulls in flight at once: a pull mostly waits (for a producer's lease, on sockets).
MAX_CONCURRENT_PULLS = 16
# Between two lease queries while the producer computes the prompt.
PENDING_POLL_S = 0.02


class PullFailed(Exception):
    pass


@dataclass(frozen=True)
class RankPull:
    """One producer rank's share, in files on this host."""

    path: str
    state_path: str
    num_bytes: int


def _write(data: bytes) -> str:
    path = new_path()
    with open(path, "wb") as f:
        f.write(data)
    return path


class KVPuller:
    def __init__(
        self,
        config: KVTransferConfig,
        layouts: list[KVLayout],
        block_size: int,
        notify_addr: str,
        with_states: bool = False,
        num_groups: int = 1,
        routing_row_bytes: int = 0,
    ) -> None:
        """layouts: this server's ranks' (a producer's must be the same); notify_addr: the engine
        core's input socket, where KVPulled messages go; with_states: a hybrid model's;
        num_groups: its KV-cache groups (sliding-window layers make more than one);
        routing_row_bytes: a position's routing row, when routing is recorded (0: it is not)."""
        self.config = config
        self.layouts = layouts
        self.block_size = block_size
        self.with_states = with_states
        self.num_groups = num_groups
        self.routing_row_bytes = routing_row_bytes
        self._ctx = zmq.Context()
        self._notify_addr = notify_addr
        self._pool = ThreadPoolExecutor(MAX_CONCURRENT_PULLS, thread_name_prefix="tern-kv-pull")
        self.parked: dict[str, Request] = {}
        self.num_pulls_total = 0
        self.num_failures_total = 0
        self.num_bytes_total = 0

    def park(self, request: Request, spec: KVTransfer) -> None:
        self.parked[request.request_id] = request
        self._pool.submit(self._run, request.request_id, list(request.prompt_token_ids), spec)

    def cancel(self, request_id: str) -> Request | None:
        """An aborted request leaves; its pull's result, when it comes, is dropped."""
        return self.parked.pop(request_id, None)

    def take(self, result: KVPulled) -> Request | None:
        """The request a finished pull belongs to (None: it was aborted; its files go)."""
        if result.error is not None:
            self.num_failures_total += 1
        else:
            self.num_pulls_total += 1
            self.num_bytes_total += result.num_bytes
        request = self.parked.pop(result.request_id, None)
        if request is None:
            remove([*result.paths, *result.state_paths])
        return request

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._ctx.term()

    # ------------------------------------------------------------------ the pulling thread

    def _run(self, request_id: str, prompt: list[int], spec: KVTransfer) -> None:
        try:
            result = self._pull(request_id, prompt, spec)
        except PullFailed as e:
            result = KVPulled(request_id, error=str(e))
        except Exception as e:  # noqa: BLE001 - any failure ends this pull, not the engine
            logger.exception("KV pull of %s failed", request_id)
            result = KVPulled(request_id, error=f"{type(e).__name__}: {e}")
        if result.error is not None:
            logger.warning("KV pull of %s failed: %s", request_id, result.error)
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(self._notify_addr)
        sock.send_multipart([RequestType.KV_PULLED.value, msgspec.msgpack.encode(result)])
        sock.close()

    def _pull(self, request_id: str, prompt: list[int], spec: KVTransfer) -> KVPulled:
        lease = self._wait_for_lease(spec)
        self._check(lease, prompt, spec)
        num_blocks = min(len(lease.block_ids), (len(prompt) - 1) // self.block_size)
        checkpoint = lease.state_checkpoint if self.with_states else -1
        if self.with_states and checkpoint < 0:
            num_blocks = 0  # blocks without the states after them: nothing to resume from
        if self.with_states and num_blocks != (len(lease.token_ids) - 1) // self.block_size:
            num_blocks = 0  # the producer's checkpoint is at another block boundary
        routing = lease.routing[: num_blocks * self.block_size * self.routing_row_bytes]
        if len(routing) < num_blocks * self.block_size * self.routing_row_bytes:
            num_blocks = 0  # positions without their routing rows (the producer records none)
        paths: list[str] = []
        state_paths: list[str] = []
        num_bytes = 0
        try:
            if num_blocks:
                groups = [lease.block_ids, *lease.other_block_ids]
                block_ids = [b for ids in groups for b in ids[:num_blocks]]
                for endpoint, layout in zip(lease.endpoints, self.layouts):
                    pulled = self._pull_rank(endpoint, layout, block_ids, checkpoint)
                    paths.append(pulled.path)
                    if pulled.state_path:
                        state_paths.append(pulled.state_path)
                    num_bytes += pulled.num_bytes
        except BaseException:
            remove([*paths, *state_paths])
            raise
        finally:
            self._release(spec)
        return KVPulled(
            request_id, paths, num_blocks, num_bytes, state_paths=state_paths,
            routing=routing if num_blocks else b"",
            with_draft=all(t.drafts_agree(o) for t, o in zip(lease.layouts, self.layouts)),
        )  # fmt: skip

    def _wait_for_lease(self, spec: KVTransfer) -> LeaseReply:
        deadline = time.monotonic() + self.config.wait_s
        with self._socket(spec.bootstrap_addr) as sock:
            while True:
                reply = self._ask(sock, LeaseQuery(spec.lease_id), LeaseReply, spec.bootstrap_addr)
                if reply.state == "ready":
                    return reply
                if reply.state == "failed":
                    raise PullFailed(f"the producer did not compute the prompt: {reply.error}")
                if time.monotonic() > deadline:
                    raise PullFailed(
                        f"no KV lease {spec.lease_id!r} at {spec.bootstrap_addr} within "
                        f"{self.config.wait_s:g} s"
                    )
                time.sleep(PENDING_POLL_S)

    def _check(self, lease: LeaseReply, prompt: list[int], spec: KVTransfer) -> None:
        if spec.remote_block_ids is not None and spec.remote_block_ids != lease.block_ids:
            raise PullFailed("the producer's lease holds other blocks than the request names")
        if len(lease.layouts) != len(self.layouts) or not all(
            t.blocks_agree(o) for t, o in zip(lease.layouts, self.layouts)
        ):
            theirs = lease.layouts[0] if lease.layouts else None
            raise PullFailed(
                f"the producer's KV layout differs from this server's: producer {theirs}, "
                f"consumer {self.layouts[0] if self.layouts else None} (model, dtype, block "
                "size and tp x pp must be equal)"
            )
        if len(lease.other_block_ids) + 1 != self.num_groups or any(
            len(ids) != len(lease.block_ids) for ids in lease.other_block_ids
        ):
            raise PullFailed(
                f"the producer lent blocks of {len(lease.other_block_ids) + 1} KV-cache groups, "
                f"not this model's {self.num_groups} (each the prompt's whole)"
            )
        lent = len(lease.block_ids) * self.block_size
        if lease.token_ids[:lent] != prompt[:lent]:
            raise PullFailed("the producer computed another prompt than this request's")

    def _pull_rank(
        self, endpoint: str, layout: KVLayout, block_ids: list[int], checkpoint: int
    ) -> RankPull:
        """One rank's share: files the producer wrote on this host, or the bytes it sent
        written into files here (blocks, then states)."""
        pull = KVPull(layout, block_ids, host_name(), checkpoint)
        with self._socket(endpoint) as sock:
            sock.send(msgspec.msgpack.encode(pull))
            frames = self._recv(sock, endpoint)
        reply = msgspec.msgpack.decode(frames[0], type=KVPullReply)
        if reply.error is not None:
            raise PullFailed(f"the producer refused the pull: {reply.error}")
        if checkpoint >= 0 and not (reply.state_shm_path or reply.num_state_bytes):
            raise PullFailed("the producer sent no linear-attention states")
        frames = frames[1:]
        path = reply.shm_path or _write(frames.pop(0))
        state_path = ""
        if checkpoint >= 0:
            state_path = reply.state_shm_path or _write(frames.pop(0))
        return RankPull(path, state_path, reply.num_bytes + reply.num_state_bytes)

    def _release(self, spec: KVTransfer) -> None:
        """Best effort: a lease nobody releases ends by itself (lease_s)."""
        try:
            with self._socket(spec.bootstrap_addr) as sock:
                self._ask(sock, LeaseRelease(spec.lease_id), LeaseReply, spec.bootstrap_addr)
        except PullFailed as e:
            logger.warning("KV lease %s not released: %s", spec.lease_id, e)

    # ------------------------------------------------------------------ sockets

    def _socket(self, addr: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(addr)
        return sock

    def _ask(self, sock: zmq.Socket, msg: object, typ: type, addr: str) -> LeaseReply:
        sock.send(msgspec.msgpack.encode(msg))
        return msgspec.msgpack.decode(self._recv(sock, addr)[0], type=typ)

    def _recv(self, sock: zmq.Socket, addr: str) -> list[bytes]:
        if not sock.poll(int(self.config.reply_timeout_s * 1000)):
            raise PullFailed(
                f"the producer at {addr} did not answer within {self.config.reply_timeout_s:g} s"
            )
        return sock.recv_multipart()

"""Single-writer, multi-reader broadcast of byte messages: a ring of chunks in shared memory.

The engine core enqueues every step (a msgpack blob, typically 100 B - 50 KB) once; each worker
dequeues it. Local readers (same host) read it from shared memory; a message larger than a chunk
goes over ZMQ and the chunk only says so; remote readers (other hosts) get every message over ZMQ
(XPUB on a TCP port). This module moves opaque bytes: it knows nothing about what they encode.

Shared-memory segment (N = max_chunks, R = n_local_reader, C = max_chunk_bytes)::

    offset 0                   +----------------------------------------------+
                               | chunk 0: kind u8 | 7 pad | length u64 | C B  |  16 + C bytes
                               | chunk 1: ...                                 |
                               | ...  chunk N-1                               |
    N * (16 + C)               +----------------------------------------------+
                               | meta 0: written u8 | read[0] u8 .. read[R-1] |  1 + R bytes
                               | ...  meta N-1                                |
    N * (16 + C + 1 + R)       +----------------------------------------------+
                               | sleeping: writer u8 | reader[0] .. [R-1] u8  |  1 + R bytes
                               +----------------------------------------------+

    kind: 1 = payload inline in the chunk, 2 = payload follows on the local XPUB socket.

Flag state machine of one chunk (the writer and each reader walk the ring in order):

    FREE (written=0, or written=1 and every read[r]=1)
      | writer: written=0, copy header + payload, every read[r]=0, written=1
      v
    PUBLISHED (written=1, read[r]=0 for some r)
      | reader r: sees read[r]=0 then written=1, copies the payload out, read[r]=1
      v
    FREE again once all R readers have set their read flag

The writer never overwrites a chunk some reader has not read (it blocks instead), so nothing is
lost and readers see messages in order.

Waiting without burning the 2 shared cores: a waiting side spins for _SPIN_S with sched_yield, then
raises its `sleeping` byte and blocks in poll(2) on its own wake-up FIFO (`wake{slot}` in the
queue's private directory; slot 0 is the writer, 1 + r reader r). After publishing, the writer
writes a byte to the FIFO of every sleeping reader; after reading, a reader writes one to the
writer's FIFO if the writer sleeps. A FIFO wakes the sleeper straight from the kernel: measured
here, an idle round trip took ~95 us median against ~480 us for ZMQ PUB/SUB + PUSH/PULL over ipc,
whose I/O threads add two hops per direction. Blocking waits are cut into _WAKE_SLICE_S slices that
re-check the flags, which bounds the cost of a wake-up lost to the (theoretical) store-load
reordering between "raise sleeping, check flag" and "set flag, check sleeping".

Memory ordering: the writer stores the payload before the written flag, a reader loads its read
flag, then the written flag, then the payload, and stores its read flag after copying out. x86 is
TSO (stores become visible in program order, loads are not reordered with older loads or younger
stores), so these program orders are the visibility orders. ARM allows more reordering, but
between any two of these Python-level accesses the interpreter runs hundreds of instructions and a
GIL-holding eval loop; in practice the stores have long drained (vLLM relies on the same). If that
ever stops being enough, a fence via ctypes belongs in _publish and _wait.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import struct
import sys
import tempfile
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from multiprocessing import resource_tracker, shared_memory

import msgspec
import zmq

_HEADER = struct.Struct("<B7xQ")  # kind, padding, payload length
_KIND_INLINE = 1
_KIND_OVERFLOW = 2
_SPIN_S = 50e-6  # how long a waiter polls the flags before it blocks
_WAKE_SLICE_S = 0.1  # longest single blocking wait; see the module docstring
_READY = b"READY"
_MAX_DRAIN = 10_000


class Handle(msgspec.Struct, frozen=True):
    """Everything a reader needs to attach to a MessageQueue (picklable and msgspec-encodable)."""

    n_reader: int
    n_local_reader: int
    max_chunk_bytes: int
    max_chunks: int
    shm_name: str | None = None  # None when there is no local reader
    local_data_addr: str | None = None  # XPUB: payloads too large for a chunk
    wake_dir: str | None = None  # holds the wake-up FIFOs wake0 (writer), wake{1 + r} (reader r)
    remote_addr: str | None = None  # XPUB on TCP: every message, for remote readers


def _segment_size(n_local: int, max_chunk_bytes: int, max_chunks: int) -> int:
    return max_chunks * (_HEADER.size + max_chunk_bytes + 1 + n_local) + 1 + n_local


@contextlib.contextmanager
def _untracked() -> Iterator[None]:
    # Python < 3.13 registers an *attached* segment with the resource tracker, which then unlinks
    # it (and warns about a leak) when the reader exits, although the writer owns it.
    original = resource_tracker.register
    resource_tracker.register = lambda name, rtype: None
    try:
        yield
    finally:
        resource_tracker.register = original


def _create_reserved(size: int) -> shared_memory.SharedMemory:
    """A new segment whose pages are all reserved now: a full /dev/shm is a clear error here, not
    a SIGBUS in whichever process first touches a page the tmpfs cannot back."""
    shm = shared_memory.SharedMemory(
        name=f"tern_mq_{uuid.uuid4().hex[:16]}", create=True, size=size
    )
    try:
        os.posix_fallocate(shm._fd, 0, size)  # the POSIX SharedMemory keeps its descriptor here
    except OSError as e:
        shm.close()
        shm.unlink()
        raise OSError(e.errno, f"{shm_space_message(size)} ({e.strerror})") from None
    return shm


def shm_space_message(needed: int) -> str:
    """What to tell the user when /dev/shm cannot hold `needed` bytes."""
    try:
        st = os.statvfs("/dev/shm")
        free = f"{st.f_bavail * st.f_frsize / 2**20:.1f} MiB free of {st.f_blocks * st.f_frsize / 2**20:.1f} MiB"
    except OSError:
        free = "its size unknown"
    return (
        f"/dev/shm has no room for {needed / 2**20:.1f} MiB of shared memory ({free}): give the "
        "container more (docker run --shm-size=1g) or free /dev/shm"
    )


def _attach(name: str) -> shared_memory.SharedMemory:
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)
    with _untracked():
        return shared_memory.SharedMemory(name=name)


def _open_fifo(wake_dir: str, slot: int) -> int:
    # O_RDWR: never blocks on open, never ENXIO without a peer, never SIGPIPE (we hold a read end).
    return os.open(f"{wake_dir}/wake{slot}", os.O_RDWR | os.O_NONBLOCK)


def _signal(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):  # FIFO full: the sleeper has wake-ups pending
        os.write(fd, b"\0")


def _drain(fd: int) -> None:
    for _ in range(_MAX_DRAIN):
        try:
            os.read(fd, 4096)
        except BlockingIOError:
            return


def _release(
    views: list[memoryview],
    fds: list[int],
    sockets: list[zmq.Socket],
    ctx: zmq.Context,
    shm: shared_memory.SharedMemory | None,
    is_owner: bool,
    ipc_dir: str | None,
) -> None:
    """Frees a queue's resources; runs once, from close() or at interpreter exit (weakref.finalize)."""
    for view in views:
        view.release()  # NOTE: shm.close() raises BufferError while a view of it is alive
    for fd in fds:
        os.close(fd)
    for sock in sockets:
        sock.close(linger=0)
    ctx.term()
    if shm is not None:
        shm.close()
        if is_owner:
            with contextlib.suppress(FileNotFoundError):
                shm.unlink()
    if ipc_dir is not None:
        shutil.rmtree(ipc_dir, ignore_errors=True)


def _remaining(deadline: float | None) -> float:
    """Seconds left before deadline (a whole slice when there is none); TimeoutError when none."""
    if deadline is None:
        return _WAKE_SLICE_S
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("MessageQueue wait timed out")
    return min(left, _WAKE_SLICE_S)


class MessageQueue:
    """One writer broadcasting bytes to n_reader readers, n_local_reader of them via shared memory.

    The constructor builds the writer; readers come from `create_from_handle(writer.export_handle())`
    in their own processes. Both sides call `wait_until_ready` before the first message.
    """

    def __init__(
        self,
        n_reader: int,
        n_local_reader: int,
        max_chunk_bytes: int = 1 << 20,
        max_chunks: int = 8,
        connect_ip: str = "127.0.0.1",
        parent_dir: str | None = None,
    ) -> None:
        """parent_dir: where the local readers' sockets and wake-up pipes get their directory
        (default: the system's temporary directory); whoever owns it removes what a killed
        writer leaves there."""
        if not 0 <= n_local_reader <= n_reader or n_reader < 1:
            raise ValueError(
                f"need 0 <= n_local_reader ({n_local_reader}) <= n_reader ({n_reader})"
                " and n_reader >= 1"
            )
        if n_local_reader > 255 or max_chunk_bytes < 1 or max_chunks < 1:
            raise ValueError("need n_local_reader <= 255, max_chunk_bytes >= 1, max_chunks >= 1")
        ctx = zmq.Context()
        shm = ipc_dir = None
        addrs: dict[str, str] = {}
        self._data_sock = self._remote_sock = None
        if n_local_reader > 0:
            shm = _create_reserved(_segment_size(n_local_reader, max_chunk_bytes, max_chunks))
            ipc_dir = tempfile.mkdtemp(prefix="tern-mq-", dir=parent_dir)
            self._data_sock = self._xpub(ctx, addrs, "local_data_addr", f"ipc://{ipc_dir}/data")
            for slot in range(1 + n_local_reader):
                os.mkfifo(f"{ipc_dir}/wake{slot}", 0o600)
            addrs["wake_dir"] = ipc_dir
        if n_reader > n_local_reader:
            self._remote_sock = self._xpub(ctx, addrs, "remote_addr", f"tcp://{connect_ip}:*")
        self._handle = Handle(
            n_reader,
            n_local_reader,
            max_chunk_bytes,
            max_chunks,
            shm.name if shm is not None else None,
            **addrs,
        )
        self._setup(self._handle, ctx, shm, is_writer=True, rank=-1, ipc_dir=ipc_dir)

    @staticmethod
    def _xpub(ctx: zmq.Context, addrs: dict[str, str], key: str, addr: str) -> zmq.Socket:
        sock = ctx.socket(zmq.XPUB)
        sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # pass every subscription up: one per reader
        sock.setsockopt(zmq.SNDHWM, 0)  # PUB drops at the high-water mark; never drop
        sock.bind(addr)
        addrs[key] = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        return sock

    def _setup(
        self,
        handle: Handle,
        ctx: zmq.Context,
        shm: shared_memory.SharedMemory | None,
        is_writer: bool,
        rank: int,
        ipc_dir: str | None,
    ) -> None:
        self.n_reader = handle.n_reader
        self.n_local_reader = handle.n_local_reader
        self.max_chunk_bytes = handle.max_chunk_bytes
        self.max_chunks = handle.max_chunks
        self.is_writer = is_writer
        self.rank = rank
        self.shm_name = handle.shm_name
        self._idx = 0  # the chunk this side touches next
        self._is_ready = False
        self._closed = False
        self._all_read = b"\x01" * handle.n_local_reader
        self._no_read = bytes(handle.n_local_reader)
        views: list[memoryview] = []
        if shm is not None and (is_writer or rank < handle.n_local_reader):
            n, c, r = (
                handle.max_chunks,
                _HEADER.size + handle.max_chunk_bytes,
                handle.n_local_reader,
            )
            buf = shm.buf
            self._chunks = [buf[i * c : (i + 1) * c] for i in range(n)]
            meta0 = n * c
            self._metas = [buf[meta0 + i * (1 + r) : meta0 + (i + 1) * (1 + r)] for i in range(n)]
            self._sleeping = buf[meta0 + n * (1 + r) : meta0 + n * (1 + r) + 1 + r]
            views = [*self._chunks, *self._metas, self._sleeping]
            # Wake-up FIFOs: this side sleeps on its own slot and signals the other side's slots.
            own = 0 if is_writer else 1 + rank
            peers = range(1, 1 + r) if is_writer else (0,)
            self._wake_fds = {slot: _open_fifo(handle.wake_dir, slot) for slot in (own, *peers)}
            self._poller = select.poll()
            self._poller.register(self._wake_fds[own], select.POLLIN)
        fds = list(getattr(self, "_wake_fds", {}).values())
        sockets = [s for s in (self._data_sock, self._remote_sock) if s is not None]
        self._finalizer = weakref.finalize(
            self, _release, views, fds, sockets, ctx, shm, is_writer, ipc_dir
        )

    def export_handle(self) -> Handle:
        assert self.is_writer, "only the writer exports a handle"
        return self._handle

    @classmethod
    def create_from_handle(cls, handle: Handle, reader_rank: int) -> MessageQueue:
        """A reader: local (shared memory) if reader_rank < n_local_reader, else remote (ZMQ)."""
        if not 0 <= reader_rank < handle.n_reader:
            raise ValueError(f"reader_rank {reader_rank} not in [0, {handle.n_reader})")
        self = cls.__new__(cls)
        ctx = zmq.Context()
        shm = None
        self._data_sock = self._remote_sock = None
        if reader_rank < handle.n_local_reader:
            assert handle.shm_name and handle.local_data_addr and handle.wake_dir
            shm = _attach(handle.shm_name)
            self._data_sock = cls._sub(ctx, handle.local_data_addr)
        else:
            assert handle.remote_addr
            self._remote_sock = cls._sub(ctx, handle.remote_addr)
        self._setup(handle, ctx, shm, is_writer=False, rank=reader_rank, ipc_dir=None)
        return self

    @staticmethod
    def _sub(ctx: zmq.Context, addr: str) -> zmq.Socket:
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(addr)
        return sock

    @property
    def is_local_reader(self) -> bool:
        return not self.is_writer and self.rank < self.n_local_reader

    def wait_until_ready(self, timeout: float) -> None:
        """Handshake: the writer waits for every reader's subscriptions, then sends READY.

        Without it, messages published before a SUB socket has connected are silently lost.
        """
        self._check_open()
        deadline = time.monotonic() + timeout
        if self.is_writer:
            pending = {}
            if self._data_sock is not None:
                pending[self._data_sock] = self.n_local_reader
            if self._remote_sock is not None:
                pending[self._remote_sock] = self.n_reader - self.n_local_reader
            poller = zmq.Poller()
            for sock in pending:
                poller.register(sock, zmq.POLLIN)
            while any(pending.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"readers not subscribed after {timeout} s: {pending}")
                for sock, _ in poller.poll(left * 1000):
                    if sock.recv()[:1] == b"\x01":  # \x01 + topic: subscribe; \x00: unsubscribe
                        pending[sock] -= 1
            for sock in (self._data_sock, self._remote_sock):
                if sock is not None:
                    sock.send(_READY)
        else:
            msg = self._recv(self._data_sock or self._remote_sock, deadline)
            assert msg == _READY, f"expected READY from the writer, got {msg[:16]!r}"
        self._is_ready = True

    def enqueue(self, data: bytes, timeout: float | None = None) -> None:
        """Publishes data to every reader; blocks (TimeoutError after timeout) while the ring is full."""
        self._check_open()
        assert self.is_writer and self._is_ready, "enqueue needs the writer after wait_until_ready"
        if self.n_local_reader > 0:
            deadline = None if timeout is None else time.monotonic() + timeout
            meta = self._metas[self._idx]
            all_read = self._all_read

            def is_free() -> bool:
                m = meta.tobytes()
                return m[0] == 0 or m[1:] == all_read

            self._wait(is_free, deadline, 0)
            self._publish(meta, self._chunks[self._idx], data)
            self._idx = (self._idx + 1) % self.max_chunks
        if self._remote_sock is not None:
            self._remote_sock.send(data, copy=False)

    def _publish(self, meta: memoryview, chunk: memoryview, data: bytes) -> None:
        meta[0] = 0
        n = len(data)
        if n <= self.max_chunk_bytes:
            _HEADER.pack_into(chunk, 0, _KIND_INLINE, n)
            chunk[_HEADER.size : _HEADER.size + n] = data
        else:
            _HEADER.pack_into(chunk, 0, _KIND_OVERFLOW, n)
            # Sent before the flag flips, so a reader that sees the flag finds the payload queued.
            self._data_sock.send(data, copy=False)
        # NOTE: order matters: read flags cleared before written=1, or a reader that already read
        # this chunk in the previous lap would not wait; payload before written=1 (see docstring).
        meta[1:] = self._no_read
        meta[0] = 1
        sleeping = self._sleeping.tobytes()
        if sleeping[1:] != self._no_read:
            for slot in range(1, 1 + self.n_local_reader):
                if sleeping[slot]:
                    _signal(self._wake_fds[slot])

    def dequeue(self, timeout: float | None = None) -> bytes:
        """The next message; raises TimeoutError if none arrives within timeout seconds."""
        self._check_open()
        assert not self.is_writer and self._is_ready, (
            "dequeue needs a reader after wait_until_ready"
        )
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self.is_local_reader:
            return self._recv(self._remote_sock, deadline)
        meta = self._metas[self._idx]
        chunk = self._chunks[self._idx]
        slot = 1 + self.rank
        # NOTE: own read flag first, then written: read[r]=0 proves the writer finished this lap's
        # payload (it clears the read flags after writing), so written=1 seen next is this lap's.
        self._wait(lambda: meta[slot] == 0 and meta[0] == 1, deadline, slot)
        kind, n = _HEADER.unpack_from(chunk, 0)
        if kind == _KIND_INLINE:
            data = chunk[_HEADER.size : _HEADER.size + n].tobytes()
        else:
            assert kind == _KIND_OVERFLOW, f"corrupt chunk header kind={kind}"
            # A timeout here leaves the chunk unread, so the next dequeue resumes at this message.
            data = self._recv(self._data_sock, deadline)
            assert len(data) == n, f"overflow payload is {len(data)} bytes, header says {n}"
        meta[slot] = 1
        self._idx = (self._idx + 1) % self.max_chunks
        if self._sleeping[0]:
            _signal(self._wake_fds[0])
        return data

    def _wait(self, is_done: Callable[[], bool], deadline: float | None, slot: int) -> None:
        """Returns once is_done(): spins for _SPIN_S, then sleeps on this side's FIFO until woken."""
        if is_done():
            return
        spin_end = time.perf_counter() + _SPIN_S
        while time.perf_counter() < spin_end:
            os.sched_yield()
            if is_done():
                return
        self._sleeping[slot] = 1
        try:
            # The check after raising the flag closes the race with a signal sent just before.
            while not is_done():
                if self._poller.poll(_remaining(deadline) * 1000):
                    _drain(self._wake_fds[slot])
        finally:
            self._sleeping[slot] = 0

    @staticmethod
    def _recv(sock: zmq.Socket, deadline: float | None) -> bytes:
        with contextlib.suppress(zmq.Again):  # a queued message is returned even past the deadline
            return sock.recv(zmq.NOBLOCK)
        while not sock.poll(_remaining(deadline) * 1000):
            pass
        return sock.recv()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("MessageQueue is closed")

    def close(self) -> None:
        """Releases sockets and the segment (the writer unlinks it). Idempotent."""
        self._closed = True
        self._finalizer()

"""Tests of enginecore.shm_broadcast with real reader processes (multiprocessing spawn)."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from enginecore.shm_broadcast import MessageQueue

CTX = mp.get_context("spawn")
CHUNK = 4096  # small chunks make the ZMQ fallback cheap to exercise
N_WAKES = 8


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _messages(n: int, seed: int, max_size: int = 3 * CHUNK) -> list[bytes]:
    """n messages of random sizes, including 0, exactly one chunk, one byte over, and >> a chunk."""
    rng = random.Random(seed)
    edge = [0, 1, CHUNK, CHUNK + 1]
    sizes = edge + [
        rng.choice((rng.randrange(1, 200), rng.randrange(1, max_size)))
        for _ in range(n - len(edge))
    ]
    return [rng.randbytes(size) for size in sizes]


def _reader_main(
    handle, rank: int, n_msgs: int, results, go=None, slow_s: float = 0.0, n_slow: int = 0
) -> None:
    """Dequeues n_msgs messages and reports their digests in order (or the error)."""
    mq = MessageQueue.create_from_handle(handle, rank)
    try:
        mq.wait_until_ready(timeout=30)
        results.put(("ready", rank))
        if go is not None:
            assert go.wait(timeout=30)
        digests = []
        for i in range(n_msgs):
            digests.append(_digest(mq.dequeue(timeout=30)))
            if i < n_slow:
                time.sleep(slow_s)
        results.put(("done", rank, digests))
    except BaseException as e:  # reported to the test rather than lost in the child's stderr
        results.put(("error", rank, repr(e)))
        raise
    finally:
        mq.close()


def _timeout_reader_main(handle, results) -> None:
    mq = MessageQueue.create_from_handle(handle, 0)
    try:
        mq.wait_until_ready(timeout=30)
        t0 = time.monotonic()
        try:
            mq.dequeue(timeout=0.3)
            results.put(("no timeout",))
        except TimeoutError:
            results.put(("timed out", time.monotonic() - t0))
        for _ in range(N_WAKES):
            results.put(("idle", os.getpid()))  # the parent measures our CPU and wake-up latency
            data = mq.dequeue(timeout=30)
            results.put(("got", data, time.monotonic()))
    finally:
        mq.close()


def _get(results, kind: str, timeout: float = 60):
    msg = results.get(timeout=timeout)
    assert msg[0] == kind, msg
    return msg


@pytest.fixture
def procs():
    """Starts processes and, at the end of the test, checks that every one has exited cleanly."""
    started: list[mp.Process] = []

    def start(target, *args) -> mp.Process:
        p = CTX.Process(target=target, args=args, daemon=True)
        p.start()
        started.append(p)
        return p

    yield start
    for p in started:
        p.join(timeout=30)
    alive = [p for p in started if p.is_alive()]
    for p in alive:
        p.kill()
        p.join(timeout=10)
    assert not alive, f"processes still alive: {alive}"
    assert [p.exitcode for p in started] == [0] * len(started)


def _shm_exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


def _run_broadcast(procs, n_reader: int, n_local: int, n_msgs: int, seed: int) -> None:
    mq = MessageQueue(n_reader, n_local, max_chunk_bytes=CHUNK, max_chunks=8)
    results = CTX.Queue()
    msgs = _messages(n_msgs, seed)
    try:
        for rank in range(n_reader):
            procs(_reader_main, mq.export_handle(), rank, n_msgs, results)
        mq.wait_until_ready(timeout=60)
        for data in msgs:
            mq.enqueue(data, timeout=30)
        expected = [_digest(m) for m in msgs]
        ranks = set()
        for _ in range(2 * n_reader):
            msg = results.get(timeout=60)
            assert msg[0] != "error", msg
            if msg[0] == "done":
                assert msg[2] == expected, f"reader {msg[1]} got wrong or reordered messages"
                ranks.add(msg[1])
        assert ranks == set(range(n_reader))
    finally:
        mq.close()
    assert mq.shm_name is None or not _shm_exists(mq.shm_name)


@pytest.mark.parametrize("n_local", [1, 3])
def test_local_readers_receive_everything_in_order(procs, n_local: int) -> None:
    _run_broadcast(procs, n_local, n_local, n_msgs=3000, seed=n_local)


def test_remote_reader_over_zmq(procs) -> None:
    # rank 0 reads shared memory, rank 1 is "remote": every message over TCP on loopback.
    _run_broadcast(procs, n_reader=2, n_local=1, n_msgs=2000, seed=7)


def test_remote_only(procs) -> None:
    _run_broadcast(procs, n_reader=1, n_local=0, n_msgs=300, seed=8)


def test_wraparound_slow_reader_blocks_writer_without_spinning(procs) -> None:
    n_chunks, n_msgs, n_slow, slow_s = 2, 60, 30, 0.005
    mq = MessageQueue(1, 1, max_chunk_bytes=CHUNK, max_chunks=n_chunks)
    results, go = CTX.Queue(), CTX.Event()
    msgs = _messages(n_msgs, seed=3)
    try:
        procs(_reader_main, mq.export_handle(), 0, n_msgs, results, go, slow_s, n_slow)
        mq.wait_until_ready(timeout=60)
        _get(results, "ready")
        for data in msgs[:n_chunks]:  # fills the ring; the reader has not started
            mq.enqueue(data, timeout=5)
        cpu0, t0 = time.process_time(), time.monotonic()
        with pytest.raises(TimeoutError):
            mq.enqueue(msgs[n_chunks], timeout=1.0)
        waited, cpu = time.monotonic() - t0, time.process_time() - cpu0
        assert 0.9 <= waited < 2.0
        assert cpu < 0.1, f"writer burnt {cpu:.3f} s CPU in {waited:.2f} s waiting for a full ring"
        go.set()
        t0 = time.monotonic()
        for data in msgs[n_chunks:]:  # the timed-out message was never written: send it again
            mq.enqueue(data, timeout=30)
        # The writer can only finish once the slow reader has freed all but n_chunks chunks; the
        # reader wakes it after each read (a writer left to its 0.1 s re-check would take ~1.4 s).
        elapsed = time.monotonic() - t0
        assert (n_slow - n_chunks) * slow_s <= elapsed < 0.7, elapsed
        _, _, digests = _get(results, "done")
        assert digests == [_digest(m) for m in msgs]
    finally:
        mq.close()


def test_dequeue_timeout_and_idle_reader_cpu(procs) -> None:
    mq = MessageQueue(1, 1, max_chunk_bytes=CHUNK, max_chunks=4)
    results = CTX.Queue()
    try:
        procs(_timeout_reader_main, mq.export_handle(), results)
        mq.wait_until_ready(timeout=60)
        _, elapsed = _get(results, "timed out")
        assert 0.29 <= elapsed < 1.0
        _, pid = _get(results, "idle")
        reader = psutil.Process(pid)
        time.sleep(0.2)  # past the spin phase, into the blocking wait
        before = reader.cpu_times()
        time.sleep(1.0)
        after = reader.cpu_times()
        cpu = (after.user - before.user) + (after.system - before.system)
        assert cpu < 0.03, f"an idle reader used {cpu:.3f} s CPU in 1 s"
        # A blocked reader is woken by the writer's notification, not by its 0.1 s safety re-check:
        # without the notification each wake-up would take 0-100 ms at random.
        latencies = []
        for i in range(N_WAKES):
            if i > 0:
                _get(results, "idle")
                time.sleep(0.15)
            t_sent = time.monotonic()
            mq.enqueue(b"wake up %d" % i, timeout=5)
            _, data, t_got = _get(results, "got")
            assert data == b"wake up %d" % i
            latencies.append(t_got - t_sent)
        assert max(latencies) < 0.04, latencies
    finally:
        mq.close()


def test_reader_timeout_on_overflow_payload_keeps_position(procs) -> None:
    # Overflow round trip, then a timed-out dequeue, then ring wrap-around: the reader's position
    # survives the timeout.
    mq = MessageQueue(1, 1, max_chunk_bytes=64, max_chunks=2)
    reader = MessageQueue.create_from_handle(mq.export_handle(), 0)
    try:
        # Both ends live in this process: the writer's handshake runs in a thread.
        t = threading.Thread(target=mq.wait_until_ready, args=(10,))
        t.start()
        reader.wait_until_ready(timeout=10)
        t.join(timeout=10)
        big = bytes(range(256)) * 4
        mq.enqueue(big, timeout=5)
        assert reader.dequeue(timeout=5) == big
        with pytest.raises(TimeoutError):
            reader.dequeue(timeout=0.05)
        for i in range(5):  # wraps the 2-chunk ring
            mq.enqueue(bytes([i]) * (10 + 30 * i), timeout=5)
            assert reader.dequeue(timeout=5) == bytes([i]) * (10 + 30 * i)
    finally:
        reader.close()
        mq.close()


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError):
        MessageQueue(1, 2)
    with pytest.raises(ValueError):
        MessageQueue(0, 0)
    mq = MessageQueue(1, 1, max_chunk_bytes=64, max_chunks=2)
    try:
        with pytest.raises(ValueError):
            MessageQueue.create_from_handle(mq.export_handle(), 1)
    finally:
        mq.close()
    mq.close()  # idempotent
    with pytest.raises(RuntimeError):
        mq.enqueue(b"x")


_LIFECYCLE_SCRIPT = """
import multiprocessing as mp, sys
from enginecore.shm_broadcast import MessageQueue

def reader(handle):
    mq = MessageQueue.create_from_handle(handle, 0)
    mq.wait_until_ready(timeout=30)
    assert mq.dequeue(timeout=30) == b"x" * 10_000
    if sys.argv[1] == "close":
        mq.close()

if __name__ == "__main__":
    mq = MessageQueue(1, 1, max_chunk_bytes=1024, max_chunks=2)
    print(mq.shm_name, flush=True)
    p = mp.get_context("spawn").Process(target=reader, args=(mq.export_handle(),))
    p.start()
    mq.wait_until_ready(timeout=30)
    mq.enqueue(b"x" * 10_000, timeout=30)
    p.join(timeout=30)
    assert p.exitcode == 0, p.exitcode
    if sys.argv[1] == "close":
        mq.close()
        mq.close()
    # else: left to the finalizer at interpreter exit
"""


@pytest.mark.parametrize("mode", ["close", "exit"])
def test_no_segment_left_and_no_resource_tracker_warning(tmp_path: Path, mode: str) -> None:
    script = tmp_path / "lifecycle.py"
    script.write_text(textwrap.dedent(_LIFECYCLE_SCRIPT))
    proc = subprocess.run(
        [sys.executable, str(script), mode],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr  # resource_tracker leak warnings would land here
    name = proc.stdout.split()[0]
    assert name.startswith("tern_mq_")
    assert not _shm_exists(name)

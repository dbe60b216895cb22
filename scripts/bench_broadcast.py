"""Benchmark of enginecore.shm_broadcast: round-trip latency and throughput to N reader processes.

Latency: the writer enqueues a 64-byte message, every reader dequeues it and answers on a ZMQ PUSH
socket; one round-trip sample is the time until all answers are in. Readers also answer with the
time.perf_counter() (CLOCK_MONOTONIC, shared by all processes) at which dequeue returned, which
gives the one-way latency to the last reader without the ZMQ reply hop. "hot" sends the next message at once
(readers are still in their spin phase or just past it); "idle" waits 2 ms between messages so
readers are asleep in zmq poll and must be woken by the writer's notification.

Throughput: the writer enqueues a batch of messages of one size back to back; readers answer after
the batch's last message. 4 MB messages exceed the 1 MB chunk and take the ZMQ fallback.

    python scripts/bench_broadcast.py --readers 1 2 4 [--remote]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import struct
import tempfile
import time
import uuid

import zmq

from enginecore.shm_broadcast import MessageQueue

PING, BATCH_END, STOP = b"P", b"E", b"S"
SIZES = {"1 KB": 1 << 10, "64 KB": 64 << 10, "4 MB": 4 << 20}
BATCH_BYTES = 256 << 20  # per throughput measurement, capped by --max-batch messages


def _reader(handle, rank: int, reply_addr: str) -> None:
    mq = MessageQueue.create_from_handle(handle, rank)
    ctx = zmq.Context()
    reply = ctx.socket(zmq.PUSH)
    reply.connect(reply_addr)
    try:
        mq.wait_until_ready(timeout=60)
        while True:
            data = mq.dequeue(timeout=120)
            t_got = time.perf_counter()
            kind = data[:1]
            if kind == STOP:
                break
            if kind in (PING, BATCH_END):
                reply.send(struct.pack("<d", t_got))
    finally:
        reply.close(linger=0)
        ctx.term()
        mq.close()


class Bench:
    """A writer, n reader processes and the PULL socket their answers arrive on."""

    def __init__(self, n_readers: int, remote: bool) -> None:
        self.n = n_readers
        self.mq = MessageQueue(n_readers, 0 if remote else n_readers)
        self.ctx = zmq.Context()
        self.replies = self.ctx.socket(zmq.PULL)
        addr = f"ipc://{tempfile.gettempdir()}/tern-bench-{uuid.uuid4().hex[:12]}"
        self.replies.bind(addr)
        spawn = mp.get_context("spawn")
        handle = self.mq.export_handle()
        self.procs = [
            spawn.Process(target=_reader, args=(handle, r, addr)) for r in range(n_readers)
        ]
        for p in self.procs:
            p.start()
        self.mq.wait_until_ready(timeout=120)

    def gather(self) -> float:
        """Waits for every reader's answer; returns the latest time a reader got the message."""
        t_last = 0.0
        for _ in range(self.n):
            if not self.replies.poll(60_000):
                raise TimeoutError("a reader did not answer")
            t_last = max(t_last, struct.unpack("<d", self.replies.recv())[0])
        return t_last

    def latency_us(self, n_iters: int, gap_s: float) -> tuple[float, float, float]:
        """Median and p99 round trip, and median one-way latency, in microseconds."""
        msg = PING * 64
        samples, one_way = [], []
        for i in range(n_iters + n_iters // 10):  # the first tenth warms up
            if gap_s:
                time.sleep(gap_s)
            t0 = time.perf_counter()
            self.mq.enqueue(msg, timeout=60)
            t_got = self.gather()
            if i >= n_iters // 10:
                samples.append((time.perf_counter() - t0) * 1e6)
                one_way.append((t_got - t0) * 1e6)
        samples.sort()
        p99 = samples[int(0.99 * (len(samples) - 1))]
        return statistics.median(samples), p99, statistics.median(one_way)

    def throughput(self, size: int, max_batch: int) -> tuple[float, float]:
        n_msgs = max(10, min(max_batch, BATCH_BYTES // size))
        msg = b"T" * size
        t0 = time.perf_counter()
        for _ in range(n_msgs):
            self.mq.enqueue(msg, timeout=60)
        self.mq.enqueue(BATCH_END, timeout=60)
        self.gather()
        dt = time.perf_counter() - t0
        return n_msgs / dt, n_msgs * size / dt / 1e6

    def close(self) -> None:
        try:
            self.mq.enqueue(STOP, timeout=10)
        finally:
            for p in self.procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=10)
            self.replies.close(linger=0)
            self.ctx.term()
            self.mq.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--readers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--iters", type=int, default=2000, help="latency samples per row")
    parser.add_argument("--max-batch", type=int, default=20_000, help="messages per throughput row")
    parser.add_argument("--remote", action="store_true", help="readers take the remote (TCP) path")
    args = parser.parse_args()

    path = "remote TCP" if args.remote else "shared memory"
    print(f"MessageQueue broadcast ({path}), {mp.cpu_count()} CPUs")
    header = (
        f"{'readers':>7} | {'test':<23} | {'rtt median':>10} | {'p99 / rate':>12} | "
        f"{'one-way':>8} | {'MB/s':>6}"
    )
    print(header)
    print("-" * len(header))
    for n in args.readers:
        bench = Bench(n, args.remote)
        try:
            for label, gap in (("latency hot", 0.0), ("latency idle (2 ms gap)", 0.002)):
                n_iters = args.iters if gap == 0 else max(100, args.iters // 4)
                med, p99, one_way = bench.latency_us(n_iters, gap)
                print(
                    f"{n:>7} | {label:<23} | {med:>8.0f}us | {p99:>10.0f}us | "
                    f"{one_way:>6.0f}us | {'':>6}"
                )
            for label, size in SIZES.items():
                rate, mbps = bench.throughput(size, args.max_batch)
                row = f"throughput {label}"
                print(f"{n:>7} | {row:<23} | {'':>10} | {rate:>10.0f}/s | {'':>8} | {mbps:>6.0f}")
        finally:
            bench.close()


if __name__ == "__main__":
    main()

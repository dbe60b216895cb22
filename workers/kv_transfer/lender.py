"""Lends a producer rank's KV blocks: a thread answering KVPull on a ROUTER socket.

The engine core keeps lent blocks out of the pool until the consumer releases them (or the lease
ends), so this thread reads blocks no step writes. A consumer on this host gets the blocks in a
shared-memory file; one elsewhere in the reply's second frame.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable

import msgspec
import torch
import zmq

from enginecore.kv_transfer.files import host_name, new_path
from enginecore.messages import KVLayout, KVPull, KVPullReply
from workers.kv_transfer.layout import describe

logger = logging.getLogger("tern.worker")

POLL_MS = 200


class KVLender:
    def __init__(
        self, host: str, kv_cache: Callable[[], torch.Tensor | None], layout: KVLayout
    ) -> None:
        """host: the address consumers reach (bound there only); kv_cache: the rank's cache now
        (None while asleep)."""
        self._kv_cache = kv_cache
        self.layout = layout
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{socket.gethostbyname(host)}")
        self.endpoint = f"tcp://{host}:{port}"
        self._host = host_name()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="tern-kv-lender", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._sock.close(linger=0)
        self._ctx.term()

    def _serve(self) -> None:
        decoder = msgspec.msgpack.Decoder(KVPull)
        encoder = msgspec.msgpack.Encoder()
        while not self._stop.is_set():
            if not self._sock.poll(POLL_MS):
                continue
            *envelope, body = self._sock.recv_multipart()
            try:
                reply, data = self._answer(decoder.decode(body))
            except Exception as e:  # noqa: BLE001 - any failure goes back to the consumer
                logger.warning("KV pull failed: %s", e)
                reply, data = KVPullReply(error=f"{type(e).__name__}: {e}"), None
            frames = [*envelope, encoder.encode(reply)]
            self._sock.send_multipart(frames if data is None else [*frames, data], copy=False)

    def _answer(self, pull: KVPull) -> tuple[KVPullReply, memoryview | None]:
        if pull.layout != self.layout:
            return KVPullReply(
                error=f"KV layouts differ: producer {describe(self.layout)}; consumer "
                f"{describe(pull.layout)}"
            ), None
        kv_cache = self._kv_cache()
        if kv_cache is None:
            return KVPullReply(error="the producer is asleep: its KV cache is released"), None
        num_blocks = kv_cache.shape[2]
        if any(not 0 <= b < num_blocks for b in pull.block_ids):
            return KVPullReply(error=f"block ids outside the producer's {num_blocks}"), None
        ids = torch.tensor(pull.block_ids, dtype=torch.long, device=kv_cache.device)
        blocks = kv_cache.index_select(2, ids).cpu().contiguous()
        data = blocks.view(-1).view(torch.uint8).numpy()
        if pull.host == self._host:
            path = new_path()
            data.tofile(path)
            return KVPullReply(shm_path=path, num_bytes=data.nbytes), None
        return KVPullReply(num_bytes=data.nbytes), memoryview(data)

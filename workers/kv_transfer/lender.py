"""Lends a producer rank's KV blocks: a thread answering KVPull on a ROUTER socket.

The engine core keeps lent blocks out of the pool until the consumer releases them (or the lease
ends), so this thread reads blocks no step writes; a hybrid model's lease pins its state
checkpoint the same way. When both servers run the same draft model, its KV blocks follow the
served model's (the draft model addresses its cache through the same block ids). A consumer on
this host gets the blocks (and states) in shared-memory files; one elsewhere in the reply's
further frames.
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
from workers.kv_transfer.states import states_bytes

logger = logging.getLogger("tern.worker")

POLL_MS = 200


class KVLender:
    def __init__(
        self,
        host: str,
        kv_cache: Callable[[], torch.Tensor | None],
        layout: KVLayout,
        checkpoint_states: Callable[[int], list[torch.Tensor]],
        draft_kv_cache: Callable[[], torch.Tensor | None] = lambda: None,
    ) -> None:
        """host: the address consumers reach (bound there only); kv_cache: the rank's cache now
        (None while asleep); checkpoint_states: a state checkpoint's tensors on this rank;
        draft_kv_cache: the draft model's cache now (blocks on dimension 2, as kv_cache's)."""
        self._kv_cache = kv_cache
        self._draft_kv_cache = draft_kv_cache
        self._checkpoint_states = checkpoint_states
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
                reply, data = KVPullReply(error=f"{type(e).__name__}: {e}"), []
            frames = [*envelope, encoder.encode(reply), *data]
            self._sock.send_multipart(frames, copy=False)

    def _answer(self, pull: KVPull) -> tuple[KVPullReply, list[memoryview]]:
        if not pull.layout.blocks_agree(self.layout):
            return KVPullReply(
                error=f"KV layouts differ: producer {describe(self.layout)}; consumer "
                f"{describe(pull.layout)}"
            ), []
        kv_cache = self._kv_cache()
        if kv_cache is None:
            return KVPullReply(error="the producer is asleep: its KV cache is released"), []
        num_blocks = kv_cache.shape[2]
        if any(not 0 <= b < num_blocks for b in pull.block_ids):
            return KVPullReply(error=f"block ids outside the producer's {num_blocks}"), []
        ids = torch.tensor(pull.block_ids, dtype=torch.long, device=kv_cache.device)
        caches = [kv_cache]
        if pull.layout.drafts_agree(self.layout):
            draft_kv_cache = self._draft_kv_cache()
            if draft_kv_cache is None:
                return KVPullReply(error="the producer's draft model has no KV cache"), []
            caches.append(draft_kv_cache)
        blocks = [
            c.index_select(2, ids).cpu().contiguous().view(-1).view(torch.uint8) for c in caches
        ]
        # NOTE: cat copies: without a draft model's blocks the served model's go out as they are.
        parts = [(blocks[0] if len(blocks) == 1 else torch.cat(blocks)).numpy()]
        if pull.state_checkpoint >= 0:
            parts.append(states_bytes(self._checkpoint_states(pull.state_checkpoint)))
        reply = KVPullReply(num_bytes=parts[0].nbytes)
        if len(parts) > 1:
            reply.num_state_bytes = parts[1].nbytes
        if pull.host != self._host:
            return reply, [memoryview(part) for part in parts]
        paths = [new_path() for _ in parts]
        for path, part in zip(paths, parts):
            part.tofile(path)
        reply.shm_path = paths[0]
        if len(paths) > 1:
            reply.state_shm_path = paths[1]
        return reply, []

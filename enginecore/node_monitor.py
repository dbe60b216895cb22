"""Node 0's end of the other nodes' worker launchers (--nnodes > 1).

The executor starts node 0's ranks itself; each other node runs
`workers.worker_proc.run_worker_node`, which says hello here, receives the bootstrap (the step
broadcast's handle, where to reply, the store address) and then sends heartbeats and worker exits.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from enginecore.config import ParallelConfig
from enginecore.messages import (
    Codec,
    CoreToNode,
    NodeAck,
    NodeBootstrap,
    NodeHeartbeat,
    NodeHello,
    NodeStop,
    NodeToCore,
    NodeWorkerExited,
)

logger = logging.getLogger("tern.executor")

# A node whose launcher sends no heartbeat for this long counts as dead (and node 0, to the others).
NODE_TIMEOUT_S = 5.0


class NodeMonitor:
    """Node 0's end of the other nodes' worker launchers (--nnodes > 1), on a thread of its own so
    that heartbeats are answered while a step runs.

    Binds a ROUTER socket at --dist-init-addr, answers each node's `NodeHello` with the bootstrap,
    acknowledges heartbeats, and records what went wrong for `check_health` to raise: a node's
    worker exited, or a node fell silent for NODE_TIMEOUT_S. On close it tells every node to stop.
    """

    def __init__(
        self, ctx: zmq.Context, parallel: ParallelConfig, bootstrap: NodeBootstrap
    ) -> None:
        assert parallel.dist_init_addr is not None
        self.parallel = parallel
        self.bootstrap = bootstrap
        self.error: str | None = None  # the first failure of another node
        self.killed: str | None = None  # the same, when a worker died of a signal
        self.num_joined = 0
        self._last_seen: dict[int, float] = {}  # node rank -> monotonic time of its last message
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 1000)
        host, _, port = parallel.dist_init_addr.rpartition(":")
        try:
            self._sock.bind(f"tcp://{socket.gethostbyname(host)}:{port}")
        except zmq.ZMQError as e:
            self._sock.close(linger=0)
            raise ValueError(f"--dist-init-addr {parallel.dist_init_addr}: {e}") from None
        self._in = Codec(NodeToCore)
        self._out = Codec(CoreToNode)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tern-node-monitor", daemon=True)
        self._thread.start()

    def wait_for_nodes(self, timeout: float, check_health: Callable[[], None]) -> None:
        deadline = time.monotonic() + timeout
        while self.num_joined < self.parallel.nnodes - 1:
            check_health()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.num_joined} of {self.parallel.nnodes - 1} other nodes joined within "
                    f"{timeout:.0f} s (is `--node-rank N --dist-init-addr "
                    f"{self.parallel.dist_init_addr}` running on each?)"
                )
            time.sleep(0.05)

    def _fail(self, error: str, killed: bool = False) -> None:
        if self.error is None:
            logger.error("%s", error)
            self.error = error
        if killed and self.killed is None:
            self.killed = error

    def _handle(self, ident: bytes, msg: object, peers: dict[int, bytes]) -> None:
        if isinstance(msg, NodeHello):
            error = None
            if msg.world_size != self.parallel.world_size:
                error = f"node {msg.node_rank} runs tp x pp = {msg.world_size}, node 0 runs {self.parallel.world_size}"
            elif not 0 < msg.node_rank < self.parallel.nnodes or msg.node_rank in peers:
                error = f"unexpected or duplicate --node-rank {msg.node_rank}"
            reply = (
                self.bootstrap
                if error is None
                else msgspec.structs.replace(self.bootstrap, error=error)
            )
            self._sock.send_multipart([ident, self._out.encode(reply)])
            if error is None:
                peers[msg.node_rank] = ident
                self._last_seen[msg.node_rank] = time.monotonic()
                self.num_joined = len(peers)
            else:
                self._fail(error)
        elif isinstance(msg, NodeHeartbeat):
            self._last_seen[msg.node_rank] = time.monotonic()
            self._sock.send_multipart([ident, self._out.encode(NodeAck())])
        elif isinstance(msg, NodeWorkerExited):
            self._fail(
                f"worker tern-worker-{msg.rank} on node {msg.node_rank} died "
                f"(exit code {msg.exitcode})",
                killed=msg.exitcode not in (0, 1),
            )

    def _run(self) -> None:
        peers: dict[int, bytes] = {}
        try:
            while not self._stop.is_set():
                if self._sock.poll(100):
                    ident, data = self._sock.recv_multipart()
                    try:
                        self._handle(ident, self._in.decode(data), peers)
                    except msgspec.ValidationError as e:
                        logger.error("dropping a malformed node message: %s", e)
                now = time.monotonic()
                for node, seen in self._last_seen.items():
                    if now - seen > NODE_TIMEOUT_S:
                        self._fail(f"node {node} sent no heartbeat for {NODE_TIMEOUT_S:.0f} s")
            for ident in peers.values():
                self._sock.send_multipart([ident, self._out.encode(NodeStop())])
        finally:
            self._sock.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

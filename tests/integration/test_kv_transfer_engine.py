"""Prefill/decode disaggregation between two engine-core processes over their real sockets (no
frontend): a producer lends the prompt's blocks, a consumer pulls them from the producer's
worker and decodes; the tokens are those of one engine alone. The producer's bootstrap (the
frontend's part) is played by a small ROUTER thread that answers from the producer's outputs."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from enginecore.config import KVTransferConfig
from enginecore.messages import (
    BootstrapRequest,
    EngineCoreRequest,
    EngineReady,
    FinishReason,
    KVTransfer,
    LeaseQuery,
    LeaseReply,
    RequestType,
)
from tests.integration.test_engine_core_proc import CoreClient, config_for, greedy

BLOCK = 16


class Bootstrap:
    """The producer's lease registry, as its frontend keeps it: lease id -> reply."""

    def __init__(self, ready: EngineReady) -> None:
        self.ready = ready
        self.leases: dict[str, LeaseReply] = {}
        self.released: list[str] = []
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.addr = f"tcp://127.0.0.1:{self.port}"
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def lend(self, lease_id: str, block_ids: list[int], prompt: list[int]) -> None:
        self.leases[lease_id] = LeaseReply(
            "ready", block_ids, len(prompt), self.ready.kv_endpoints, self.ready.kv_layouts,
            prompt,
        )  # fmt: skip

    def _serve(self) -> None:
        decoder = msgspec.msgpack.Decoder(BootstrapRequest)
        while not self._stop.is_set():
            if not self.sock.poll(100):
                continue
            ident, empty, body = self.sock.recv_multipart()
            msg = decoder.decode(body)
            if isinstance(msg, LeaseQuery):
                reply = self.leases.get(msg.lease_id, LeaseReply("pending"))
            else:
                self.released.append(msg.lease_id)
                reply = LeaseReply("released")
            self.sock.send_multipart([ident, empty, msgspec.msgpack.encode(reply)])

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()


def kv_config(model_dir: Path, role: str, **kv) -> object:
    return config_for(model_dir, block_size=BLOCK).replace(
        kv_transfer=KVTransferConfig("TernConnector", role, **kv)
    )


@pytest.fixture(scope="module")
def pair(tiny_llama: Path):
    producer = CoreClient(kv_config(tiny_llama, "kv_producer"))
    consumer = CoreClient(kv_config(tiny_llama, "kv_consumer", reply_timeout_s=2.0))
    try:
        ready = producer.startup()
        assert isinstance(ready, EngineReady), ready
        assert len(ready.kv_endpoints) == 1 and ready.kv_endpoints[0].startswith("tcp://")
        assert isinstance(consumer.startup(), EngineReady)
        bootstrap = Bootstrap(ready)
        yield producer, consumer, bootstrap
        bootstrap.close()
    finally:
        producer.close()
        consumer.close()


def produce(
    producer: CoreClient, bootstrap: Bootstrap, lease_id: str, prompt: list[int]
) -> list[int]:
    """The producer computes the prompt (one token) and lends its blocks."""
    req = EngineCoreRequest(
        lease_id, prompt, greedy(lease_id, prompt, 1).sampling_params,
        kv_transfer=KVTransfer("produce", lease_id),
    )  # fmt: skip
    producer.send(RequestType.ADD, req)
    for _ in range(1000):
        for out in producer.recv().outputs:
            if out.finish_reason is not None:
                assert out.kv_lease_block_ids is not None
                bootstrap.lend(lease_id, out.kv_lease_block_ids, prompt)
                return out.kv_lease_block_ids
    raise AssertionError("the producer never finished")


@pytest.mark.parametrize("length", [3, 16, 40, 64])
def test_consumer_decodes_from_pulled_blocks_as_one_engine_does(pair, length: int):
    producer, consumer, bootstrap = pair
    prompt = [(5 * j + length) % 400 + 1 for j in range(length)]
    ref = producer.run({f"plain{length}": greedy(f"plain{length}", prompt, 12)})
    lease = f"lease{length}"
    block_ids = produce(producer, bootstrap, lease, prompt)
    assert len(block_ids) == length // BLOCK
    before = consumer.stats()
    req = greedy(f"c{length}", prompt, 12)
    req.kv_transfer = KVTransfer("consume", lease, bootstrap.addr, block_ids)
    got = consumer.run({req.request_id: req})
    assert got[req.request_id] == ref[f"plain{length}"]
    after = consumer.stats()
    pulled = min(len(block_ids), (length - 1) // BLOCK) * BLOCK
    assert after["external_prefix_cache_hits"] - before["external_prefix_cache_hits"] == pulled
    # the consumer computed the rest of the prompt only: at most one block and one token
    computed = after["num_prefill_tokens_total"] - before["num_prefill_tokens_total"]
    assert computed == length - pulled <= BLOCK
    assert lease in bootstrap.released
    if pulled:
        assert after["kv_pulls_total"] == before["kv_pulls_total"] + 1
        assert after["kv_pull_bytes_total"] > before["kv_pull_bytes_total"]


def test_a_silent_producer_fails_the_request_with_a_clear_error(pair):
    _, consumer, _ = pair
    silent = zmq.Context.instance().socket(zmq.ROUTER)  # takes the query, never answers
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        req = greedy("orphan", [1, 2, 3, 4], 4)
        req.kv_transfer = KVTransfer("consume", "nobody", f"tcp://127.0.0.1:{port}")
        consumer.send(RequestType.ADD, req)
        for _ in range(100):
            outs = [o for o in consumer.recv().outputs if o.request_id == "orphan"]
            if outs:
                assert outs[0].finish_reason == FinishReason.ERROR
                assert "did not answer" in outs[0].error
                break
        else:
            raise AssertionError("no output for the orphan")
    finally:
        silent.close(0)


@contextlib.contextmanager
def engine_pair(
    model_dir: Path, **changes: object
) -> Iterator[tuple[CoreClient, CoreClient, Bootstrap]]:
    """A producer and a consumer with these Config changes, and the producer's bootstrap."""
    producer = CoreClient(kv_config(model_dir, "kv_producer").replace(**changes))
    consumer = CoreClient(
        kv_config(model_dir, "kv_consumer", reply_timeout_s=5.0).replace(**changes)
    )
    try:
        ready = producer.startup()
        assert isinstance(ready, EngineReady), ready
        assert isinstance(consumer.startup(), EngineReady)
        bootstrap = Bootstrap(ready)
        try:
            yield producer, consumer, bootstrap
        finally:
            bootstrap.close()
    finally:
        producer.close()
        consumer.close()


def consumed_as_one_engine(
    producer: CoreClient, consumer: CoreClient, bootstrap: Bootstrap, prompt: list[int]
) -> None:
    """The consumer, from the producer's blocks, answers what the producer alone answers, and
    pulled every whole block but the one holding the prompt's last token."""
    ref = producer.run({"plain": greedy("plain", prompt, 10)})["plain"]
    block_ids = produce(producer, bootstrap, "lease", prompt)
    req = greedy("c", prompt, 10)
    req.kv_transfer = KVTransfer("consume", "lease", bootstrap.addr, block_ids)
    assert consumer.run({"c": req})["c"] == ref
    pulled = (len(prompt) - 1) // BLOCK * BLOCK
    assert consumer.stats()["external_prefix_cache_hits"] == pulled


def test_tp2_pp2_pairs_move_each_ranks_share_and_other_layouts_are_refused(pair, tiny_llama: Path):
    """A tp 2 x pp 2 producer and consumer: every rank pulls its own heads of its own stage's
    layers from the producer's rank of the same index. A consumer laid out otherwise than its
    producer (here: tp 2 x pp 2 against the tp 1 producer) is refused with the layouts named."""
    from enginecore.config import ParallelConfig

    tp1_producer, _, tp1_bootstrap = pair
    parallel = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    with engine_pair(tiny_llama, parallel=parallel) as (producer, consumer, bootstrap):
        assert len(bootstrap.ready.kv_endpoints) == 4
        consumed_as_one_engine(
            producer, consumer, bootstrap, [(3 * j + 11) % 400 + 1 for j in range(50)]
        )
        other = [(5 * j + 1) % 400 + 1 for j in range(40)]
        produce(tp1_producer, tp1_bootstrap, "tp1", other)
        req = greedy("mismatch", other, 4)
        req.kv_transfer = KVTransfer("consume", "tp1", tp1_bootstrap.addr)
        consumer.send(RequestType.ADD, req)
        for _ in range(100):
            outs = [o for o in consumer.recv().outputs if o.request_id == "mismatch"]
            if outs:
                assert outs[0].finish_reason == FinishReason.ERROR
                assert "layout differs" in outs[0].error and "tp" in outs[0].error
                break
        else:
            raise AssertionError("no output for the mismatched request")


def test_int8_kv_blocks_travel_with_their_scales(tiny_llama: Path):
    """int8 KV (each row's scale beside it): a pulled prompt decodes as one int8 engine does."""
    cache = dataclasses.replace(
        config_for(tiny_llama, block_size=BLOCK).cache, kv_cache_dtype="int8"
    )
    with engine_pair(tiny_llama, cache=cache) as (producer, consumer, bootstrap):
        assert bootstrap.ready.kv_layouts[0].dtype == "uint8"
        consumed_as_one_engine(
            producer, consumer, bootstrap, [(11 * j + 3) % 400 + 1 for j in range(37)]
        )

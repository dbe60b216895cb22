"""Prefill/decode disaggregation's request fields in the peers' three forms (vLLM's
kv_transfer_params, SGLang's bootstrap fields, TensorRT-LLM's disaggregated_params) to the engine
request's KVTransfer, on each server role; the 400s; and what a producer answers."""

from __future__ import annotations

import base64
import json
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from enginecore.config import KVTransferConfig
from enginecore.messages import KVTransfer
from frontend.common.errors import APIError
from frontend.disagg.requests import (
    KVRequest,
    KVSide,
    check_single,
    decode_opaque_state,
    encode_opaque_state,
    kv_request,
)
from frontend.openai.protocol import ChatCompletionRequest, CompletionRequest
from frontend.serving.kv_answers import kv_answer, kv_sampling
from frontend.serving.sampling import RequestSampling
from frontend.sglang.protocol import decode_sglang_generate


def side(role: str | None, port: int = 8998) -> KVSide:
    config = (
        KVTransferConfig()
        if role is None
        else KVTransferConfig("TernConnector", role, bootstrap_host="10.0.0.1", bootstrap_port=port)
    )
    return KVSide(config, "abc123", tp_size=2)


PRODUCER, CONSUMER, BOTH, OFF = (
    side("kv_producer"), side("kv_consumer"), side("kv_both"), side(None),
)  # fmt: skip

# What vllm-router sends (/work/notes/vllm_chat_bs9000rr.*.jsonl).
VLLM_PRODUCE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
VLLM_CONSUME = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "eng0",
    "remote_request_id": "req0",
    "remote_block_ids": [1, 2],
    "remote_host": "127.0.0.1",
    "remote_port": 5555,
    "tp_size": 1,
}


def bad(param: str, match: str, s: KVSide, **fields: Any) -> None:
    with pytest.raises(APIError, match=match) as e:
        kv_request(s, **fields)
    assert e.value.status == 400 and e.value.param == param


# --------------------------------------------------------------------------- vLLM


def test_vllm_produce_and_consume() -> None:
    kv = kv_request(PRODUCER, kv_transfer_params=VLLM_PRODUCE)
    assert kv is not None and kv.produces and kv.protocol == "vllm" and not kv.is_prompt_only
    other = kv_request(PRODUCER, kv_transfer_params=VLLM_PRODUCE)
    assert other is not None and other.transfer.lease_id != kv.transfer.lease_id  # fresh ids
    kv = kv_request(CONSUMER, kv_transfer_params=VLLM_CONSUME)
    assert kv is not None and kv.transfer == KVTransfer(
        "consume", "req0", "tcp://127.0.0.1:5555", [1, 2]
    )
    assert kv_request(BOTH, kv_transfer_params=VLLM_CONSUME) is not None
    assert kv_request(BOTH, kv_transfer_params=VLLM_PRODUCE) is not None


def test_vllm_nothing_asked() -> None:
    for params in (None, {}, {"do_remote_decode": False, "do_remote_prefill": None}):
        assert kv_request(OFF, kv_transfer_params=params) is None
        assert kv_request(PRODUCER, kv_transfer_params=params) is None


def test_vllm_errors() -> None:
    p = "kv_transfer_params"
    bad(p, "no KV transfer", OFF, kv_transfer_params=VLLM_PRODUCE)
    bad(p, "does not consume", PRODUCER, kv_transfer_params=VLLM_CONSUME)
    bad(p, "does not produce", CONSUMER, kv_transfer_params=VLLM_PRODUCE)
    bad(p, "both true", BOTH, kv_transfer_params={**VLLM_CONSUME, "do_remote_decode": True})
    bad(p, "remote_host", CONSUMER, kv_transfer_params={**VLLM_CONSUME, "remote_host": None})
    bad(p, "remote_request_id", CONSUMER,
        kv_transfer_params={k: v for k, v in VLLM_CONSUME.items() if k != "remote_request_id"})  # fmt: skip
    bad(p, "port", CONSUMER, kv_transfer_params={**VLLM_CONSUME, "remote_port": 70000})
    bad(p, "list of ints", CONSUMER,
        kv_transfer_params={**VLLM_CONSUME, "remote_block_ids": ["a"]})  # fmt: skip
    bad(p, "object", CONSUMER, kv_transfer_params=[1])


def test_vllm_producer_answer() -> None:
    kv = kv_request(PRODUCER, kv_transfer_params=VLLM_PRODUCE)
    assert kv is not None
    gen = SimpleNamespace(
        finish_reason="length", replica=1, kv_lease_block_ids=[4, 5, 6],
        output_token_ids=[9], prompt_token_ids=[1, 2, 3],
    )  # fmt: skip
    answer = kv_answer(PRODUCER, kv, gen, 1)  # type: ignore[arg-type]
    assert answer.finish_reason == "length"
    assert answer.kv_transfer_params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "abc123-dp1",
        "remote_request_id": kv.transfer.lease_id,
        "remote_block_ids": [4, 5, 6],
        "remote_host": "10.0.0.1",
        "remote_port": 8998,
        "tp_size": 2,
    }
    assert answer.disaggregated_params is msgspec.UNSET
    # What the router copies to the consumer maps back to the same lease there.
    consume = kv_request(CONSUMER, kv_transfer_params=answer.kv_transfer_params)
    assert consume is not None
    assert consume.transfer == KVTransfer(
        "consume", kv.transfer.lease_id, "tcp://10.0.0.1:8998", [4, 5, 6]
    )
    # Nothing lent (a stop string ended it first): no params, the consumer computes the prompt.
    unlent = SimpleNamespace(**{**vars(gen), "kv_lease_block_ids": None})
    assert kv_answer(PRODUCER, kv, unlent, 1).kv_transfer_params is msgspec.UNSET  # type: ignore[arg-type]
    # A consumer's answer carries nothing more.
    assert kv_answer(CONSUMER, consume, gen, 8).kv_transfer_params is msgspec.UNSET  # type: ignore[arg-type]


def test_vllm_router_bodies_decode() -> None:
    """The chat and completion bodies vllm-router sends (normalised fields included) decode."""
    chat = {
        "model": "tiny", "messages": [{"role": "user", "content": "Say hi"}],
        "temperature": 0.0, "stream": False, "max_tokens": 1, "logprobs": False,
        "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
        "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
        "return_hidden_states": False, "include_reasoning": True, "min_tokens": 1,
        "kv_transfer_params": VLLM_PRODUCE,
    }  # fmt: skip
    req = msgspec.json.decode(json.dumps(chat), type=ChatCompletionRequest)
    req.validate()
    kv = kv_request(PRODUCER, **req.kv_fields())
    assert kv is not None and kv.produces
    sampling = kv_sampling(req.to_sampling(), kv, req.stream)
    assert sampling.max_tokens == 1  # the client's (the router's) own
    completion = {
        "model": "tiny", "prompt": "Say hi", "max_tokens": 8, "temperature": 0.0,
        "stream": False, "echo": False, "no_stop_trim": False, "ignore_eos": False,
        "skip_special_tokens": True, "return_hidden_states": False,
        "kv_transfer_params": VLLM_CONSUME,
    }  # fmt: skip
    req2 = msgspec.json.decode(json.dumps(completion), type=CompletionRequest)
    req2.validate()
    kv = kv_request(CONSUMER, **req2.kv_fields())
    assert kv is not None and not kv.produces
    assert kv_sampling(req2.to_sampling(), kv, False).max_tokens == 8


# --------------------------------------------------------------------------- SGLang


def test_sglang_bootstrap_on_each_role() -> None:
    room = 2**63 - 1
    kv = kv_request(PRODUCER, bootstrap=("127.0.0.1", None, room))
    assert kv is not None and kv.transfer == KVTransfer("produce", f"room-{room}")
    assert kv.is_prompt_only
    kv = kv_request(CONSUMER, bootstrap=("localhost", 9000, 5))
    assert kv is not None and kv.transfer == KVTransfer("consume", "room-5", "tcp://localhost:9000")
    kv = kv_request(CONSUMER, bootstrap=("127.0.0.1", None, 5))
    assert kv is not None and kv.transfer.bootstrap_addr == "tcp://127.0.0.1:8998"
    kv = kv_request(side("kv_producer", 9000), bootstrap=("localhost", 9000, 5))
    assert kv is not None and kv.produces


def test_sglang_errors() -> None:
    bad("bootstrap_room", "no KV transfer", OFF, bootstrap=("127.0.0.1", None, 1))
    bad("bootstrap_room", "prefill or decode", BOTH, bootstrap=("127.0.0.1", None, 1))
    bad("bootstrap_room", "63-bit", CONSUMER, bootstrap=("127.0.0.1", None, 2**63))
    bad("bootstrap_room", "63-bit", CONSUMER, bootstrap=("127.0.0.1", None, -1))
    bad("bootstrap_room", "63-bit", CONSUMER, bootstrap=("127.0.0.1", None, None))
    bad("bootstrap_host", "host", CONSUMER, bootstrap=(None, None, 1))
    bad("bootstrap_port", "not this prefill server's", PRODUCER, bootstrap=("h", 9000, 1))


def test_sglang_forces_one_token_on_the_producer() -> None:
    kv = kv_request(PRODUCER, bootstrap=("127.0.0.1", None, 7))
    sampling = kv_sampling(RequestSampling(max_tokens=8, min_tokens=4), kv, False)
    assert (sampling.max_tokens, sampling.min_tokens) == (1, 1)
    kv = kv_request(CONSUMER, bootstrap=("127.0.0.1", None, 7))
    assert kv_sampling(RequestSampling(max_tokens=8), kv, False).max_tokens == 8


def test_sglang_router_bodies_decode() -> None:
    """sglang-router's /generate and chat bodies (/work/notes/sgl_*.jsonl) decode."""
    generate = {
        "text": "hi", "model": None, "sampling_params": {"max_new_tokens": 8},
        "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
        "return_hidden_states": False, "background": False, "no_logs": False,
        "return_bytes": False, "return_entropy": False, "bootstrap_host": "127.0.0.1",
        "bootstrap_port": None, "bootstrap_room": 3501034535018840507,
    }  # fmt: skip
    req = decode_sglang_generate(json.dumps(generate).encode())
    assert (req.bootstrap_host, req.bootstrap_port, req.bootstrap_room) == (
        "127.0.0.1", None, 3501034535018840507,
    )  # fmt: skip
    chat = {
        "messages": [{"role": "user", "content": "Say hi"}], "model": "tiny", "logprobs": False,
        "max_completion_tokens": 8, "stream": False, "temperature": 0.0, "no_stop_trim": False,
        "ignore_eos": False, "continue_final_message": False, "skip_special_tokens": True,
        "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False,
        "bootstrap_host": "localhost", "bootstrap_port": 9000, "bootstrap_room": 97335593942467071,
    }  # fmt: skip
    chat_req = msgspec.json.decode(json.dumps(chat), type=ChatCompletionRequest)
    chat_req.validate()
    kv = kv_request(CONSUMER, **chat_req.kv_fields())
    assert kv is not None
    assert kv.transfer == KVTransfer("consume", "room-97335593942467071", "tcp://localhost:9000")


# --------------------------------------------------------------------------- TensorRT-LLM


def test_trtllm_context_then_generation() -> None:
    kv = kv_request(PRODUCER, disaggregated_params={"request_type": "context_only"})
    assert kv is not None and kv.produces and kv.is_prompt_only and kv.protocol == "trtllm"
    assert isinstance(kv.ctx_request_id, int) and kv.transfer.lease_id == f"ctx-{kv.ctx_request_id}"
    sampling = kv_sampling(RequestSampling(max_tokens=16), kv, False)
    assert sampling.max_tokens == 1
    gen = SimpleNamespace(
        finish_reason="length", replica=0, kv_lease_block_ids=[3],
        output_token_ids=[42], prompt_token_ids=[1, 2, 3],
    )  # fmt: skip
    answer = kv_answer(PRODUCER, kv, gen, 16)  # type: ignore[arg-type]
    assert answer.finish_reason is None  # goes on at the generation server
    assert answer.prompt_token_ids == [1, 2, 3]
    params = answer.disaggregated_params
    assert isinstance(params, dict)
    assert params["request_type"] == "generation_only" and params["first_gen_tokens"] == [42]
    assert params["ctx_request_id"] == kv.ctx_request_id
    state = json.loads(base64.b64decode(params["encoded_opaque_state"]))
    assert state == {"bootstrap": "tcp://10.0.0.1:8998", "lease_id": kv.transfer.lease_id}
    # The orchestrator sends them back on the generation server.
    consume = kv_request(CONSUMER, disaggregated_params=params)
    assert consume is not None
    assert consume.transfer == KVTransfer("consume", kv.transfer.lease_id, "tcp://10.0.0.1:8998")


def test_trtllm_first_token_ends_at_the_context_server() -> None:
    kv = kv_request(PRODUCER, disaggregated_params={"request_type": "context_only"})
    eos = SimpleNamespace(
        finish_reason="stop", replica=0, kv_lease_block_ids=[],
        output_token_ids=[2], prompt_token_ids=[1],
    )  # fmt: skip
    assert kv_answer(PRODUCER, kv, eos, 16).finish_reason == "stop"  # type: ignore[arg-type]
    one = SimpleNamespace(**{**vars(eos), "finish_reason": "length"})
    assert kv_answer(PRODUCER, kv, one, 1).finish_reason == "length"  # type: ignore[arg-type]


def test_trtllm_errors() -> None:
    p = "disaggregated_params"
    bad(p, "no KV transfer", OFF, disaggregated_params={"request_type": "context_only"})
    bad(p, "does not produce", CONSUMER, disaggregated_params={"request_type": "context_only"})
    bad(p, "not served", PRODUCER, disaggregated_params={"request_type": "context_and_generation"})
    bad(p, "draft_tokens", PRODUCER,
        disaggregated_params={"request_type": "context_only", "draft_tokens": [1]})  # fmt: skip
    bad(p, "schedule_style", PRODUCER,
        disaggregated_params={"request_type": "context_only", "schedule_style": "x"})  # fmt: skip
    bad(p, "unknown", PRODUCER, disaggregated_params={"request_type": "context_only", "x": 1})
    state = base64.b64encode(b'{"bootstrap": "tcp://h:1", "lease_id": "ctx-1"}').decode()
    gen = {"request_type": "generation_only", "encoded_opaque_state": state}
    bad(p, "first_gen_tokens", CONSUMER, disaggregated_params={**gen, "first_gen_tokens": []})
    bad(p, "first_gen_tokens", CONSUMER, disaggregated_params=gen)
    ok = {**gen, "first_gen_tokens": [5]}
    assert kv_request(CONSUMER, disaggregated_params=ok) is not None
    bad(p, "opaque_state", CONSUMER, disaggregated_params={**ok, "encoded_opaque_state": "!!"})
    bad(p, "opaque_state", CONSUMER, disaggregated_params={**ok, "encoded_opaque_state": None})
    with pytest.raises(APIError, match="streamed"):
        kv = kv_request(PRODUCER, disaggregated_params={"request_type": "context_only"})
        kv_sampling(RequestSampling(), kv, True)


def test_opaque_state_round_trip() -> None:
    kv = KVRequest(KVTransfer("produce", "ctx-9"), "trtllm", 9)
    state = decode_opaque_state(encode_opaque_state(PRODUCER, kv))
    assert state == {"bootstrap": "tcp://10.0.0.1:8998", "lease_id": "ctx-9"}


def test_chat_takes_trtllm_fields() -> None:
    body = {
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
        "prompt_token_ids": [1, 2, 3], "max_tokens": 8,
        "disaggregated_params": {"request_type": "context_only"},
    }  # fmt: skip
    req = msgspec.json.decode(json.dumps(body), type=ChatCompletionRequest)
    req.validate()
    assert req.prompt_token_ids == [1, 2, 3]
    assert kv_request(PRODUCER, **req.kv_fields()) is not None


# --------------------------------------------------------------------------- shared


def test_one_form_and_one_prompt() -> None:
    bad("bootstrap_room", "use one", CONSUMER, kv_transfer_params=VLLM_CONSUME,
        bootstrap=("h", None, 1))  # fmt: skip
    kv = kv_request(PRODUCER, kv_transfer_params=VLLM_PRODUCE)
    check_single(kv, 1, "prompt")
    check_single(None, 4, "prompt")
    with pytest.raises(APIError, match="one prompt and n = 1") as e:
        check_single(kv, 2, "prompt")
    assert e.value.param == "kv_transfer_params"

"""Prefill/decode disaggregation's request fields, in the three peers' wire forms, to the one
`KVTransfer` an engine request carries; and the fields a producer's answer gives back.

- vLLM (`kv_transfer_params`, vllm-router's two stages): `do_remote_decode` asks a producer to
  compute the prompt and lend its blocks; the producer's response carries `kv_transfer_params`
  with `do_remote_prefill` and `remote_*`, which the router copies into the consumer's body.
- SGLang (`bootstrap_host`, `bootstrap_port`, `bootstrap_room`, sglang-router's one-shot dispatch
  to both servers): the server's own role says which side it is; the room keys the lease. A
  prefill server computes only the prompt (max tokens 1): the router ignores its answer.
- TensorRT-LLM (`disaggregated_params`): "context_only" produces (max tokens 1) and answers
  `disaggregated_params` for the generation server, with an opaque state naming this server's
  bootstrap and the lease; "generation_only" consumes from that state. The consumer recomputes the
  prompt's last position from the pulled blocks: under greedy or seeded sampling that yields the
  same first token the context server answered in `first_gen_tokens`.

A request may use one form. Fields a server's role cannot serve are 400s naming the field. This
module knows nothing about HTTP routes, tokenizers or the engine's sockets.
"""

from __future__ import annotations

import base64
import binascii
import json
import secrets
import uuid
from dataclasses import dataclass
from typing import Any

from enginecore.config import KVTransferConfig
from enginecore.messages import KVTransfer
from frontend.common.errors import bad_request

VLLM_PARAM = "kv_transfer_params"
TRTLLM_PARAM = "disaggregated_params"
SGLANG_DEFAULT_BOOTSTRAP_PORT = 8998
_MAX_ROOM = 2**63 - 1  # SGLang's rooms are unsigned 63-bit ints
_VLLM_CONSUME_FIELDS = ("remote_request_id", "remote_host", "remote_port")
_TRTLLM_FIELDS = {
    "request_type", "first_gen_tokens", "ctx_request_id", "encoded_opaque_state",
    "draft_tokens", "disagg_request_id", "ctx_dp_rank", "ctx_info_endpoint", "schedule_style",
}  # fmt: skip


@dataclass(frozen=True)
class KVSide:
    """This server's part in disaggregation, as its responses name it."""

    config: KVTransferConfig
    engine_id: str  # the server's instance id (a replica's is engine_id-dp<i>)
    tp_size: int = 1

    def replica_engine_id(self, replica: int) -> str:
        return f"{self.engine_id}-dp{replica}"


@dataclass(frozen=True)
class KVRequest:
    """What one request's disaggregation fields ask: its engine request's KVTransfer, in which
    peer's form it came (`protocol`: "vllm" | "sglang" | "trtllm"), and for a TRT-LLM context
    request the id its answer gives back."""

    transfer: KVTransfer
    protocol: str
    ctx_request_id: int | None = None

    @property
    def produces(self) -> bool:
        return self.transfer.role == "produce"

    @property
    def is_prompt_only(self) -> bool:
        """SGLang's and TRT-LLM's producers compute the prompt and one token, whatever the client
        asked (vllm-router sends max_tokens 1 itself, so vLLM's form keeps the client's)."""
        return self.produces and self.protocol != "vllm"


def kv_request(
    side: KVSide,
    *,
    kv_transfer_params: Any = None,
    bootstrap: tuple[Any, Any, Any] = (None, None, None),
    disaggregated_params: Any = None,
) -> KVRequest | None:
    """The KVRequest of a request's fields (None: it asks for no transfer); raises APIError 400.
    `bootstrap`: SGLang's (bootstrap_host, bootstrap_port, bootstrap_room)."""
    found = []
    vllm = _vllm_request(side.config, kv_transfer_params)
    if vllm is not None:
        found.append((VLLM_PARAM, vllm))
    if any(v is not None for v in bootstrap):
        found.append(("bootstrap_room", _sglang_request(side.config, *bootstrap)))
    if disaggregated_params is not None:
        found.append((TRTLLM_PARAM, _trtllm_request(side.config, disaggregated_params)))
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise bad_request(f"{names} both ask for a KV transfer: use one", found[1][0])
    return found[0][1] if found else None


def check_single(kv: KVRequest | None, num_requests: int, param: str) -> None:
    """A lease holds one prompt's blocks: a transfer takes one prompt and n = 1."""
    if kv is not None and num_requests != 1:
        raise bad_request(
            "a request with a KV transfer takes one prompt and n = 1", _param_of(kv, param)
        )


# --------------------------------------------------------------------------- vLLM


def _vllm_request(kv: KVTransferConfig, params: Any) -> KVRequest | None:
    if params is None:
        return None
    if not isinstance(params, dict):
        raise bad_request("kv_transfer_params must be an object", VLLM_PARAM)
    decode, prefill = bool(params.get("do_remote_decode")), bool(params.get("do_remote_prefill"))
    if not (decode or prefill):
        return None
    if decode and prefill:
        raise bad_request(
            "kv_transfer_params: do_remote_decode and do_remote_prefill are both true", VLLM_PARAM
        )
    _check_role(kv, "produce" if decode else "consume", VLLM_PARAM)
    if decode:
        return KVRequest(KVTransfer("produce", uuid.uuid4().hex), "vllm")
    missing = [name for name in _VLLM_CONSUME_FIELDS if params.get(name) is None]
    if missing:
        raise bad_request(
            f"kv_transfer_params with do_remote_prefill needs {', '.join(missing)}", VLLM_PARAM
        )
    block_ids = params.get("remote_block_ids")
    if block_ids is not None and not _is_int_list(block_ids):
        raise bad_request("kv_transfer_params.remote_block_ids must be a list of ints", VLLM_PARAM)
    addr = _bootstrap_addr(params["remote_host"], params["remote_port"], VLLM_PARAM)
    transfer = KVTransfer("consume", str(params["remote_request_id"]), addr, block_ids)
    return KVRequest(transfer, "vllm")


def vllm_producer_params(
    side: KVSide, kv: KVRequest, replica: int, block_ids: list[int] | None
) -> dict[str, Any]:
    """A producer's response `kv_transfer_params`, as vllm-router copies it to the consumer."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": side.replica_engine_id(replica),
        "remote_request_id": kv.transfer.lease_id,
        "remote_block_ids": list(block_ids or []),
        "remote_host": side.config.bootstrap_host,
        "remote_port": side.config.bootstrap_port,
        "tp_size": side.tp_size,
    }


# --------------------------------------------------------------------------- SGLang


def _sglang_request(kv: KVTransferConfig, host: Any, port: Any, room: Any) -> KVRequest:
    if not kv.enabled:
        _check_role(kv, "consume", "bootstrap_room")  # raises: no transfer configured
    if kv.produces and kv.consumes:
        raise bad_request(
            "bootstrap fields need a server started with --disaggregation-mode prefill or "
            "decode (this one is kv_both)",
            "bootstrap_room",
        )
    if not isinstance(room, int) or isinstance(room, bool) or not 0 <= room <= _MAX_ROOM:
        raise bad_request("bootstrap_room must be an unsigned 63-bit integer", "bootstrap_room")
    port = SGLANG_DEFAULT_BOOTSTRAP_PORT if port is None else port
    lease_id = f"room-{room}"
    if kv.produces:
        if port != kv.bootstrap_port:
            raise bad_request(
                f"bootstrap_port {port} is not this prefill server's bootstrap port "
                f"({kv.bootstrap_port}): give the router the port of --disaggregation-bootstrap-port",
                "bootstrap_port",
            )
        return KVRequest(KVTransfer("produce", lease_id), "sglang")
    if not isinstance(host, str) or not host:
        raise bad_request("bootstrap_host must name the prefill server's host", "bootstrap_host")
    addr = _bootstrap_addr(host, port, "bootstrap_port")
    return KVRequest(KVTransfer("consume", lease_id, addr), "sglang")


# --------------------------------------------------------------------------- TensorRT-LLM


def _trtllm_request(kv: KVTransferConfig, params: Any) -> KVRequest:
    if not isinstance(params, dict):
        raise bad_request("disaggregated_params must be an object", TRTLLM_PARAM)
    unknown = sorted(set(params) - _TRTLLM_FIELDS)
    if unknown:
        raise bad_request(f"disaggregated_params: unknown field(s) {unknown}", TRTLLM_PARAM)
    for name in ("draft_tokens", "schedule_style"):
        if params.get(name) is not None:
            raise bad_request(f"disaggregated_params.{name} is not supported by tern", TRTLLM_PARAM)
    kind = params.get("request_type")
    if kind == "context_only":
        _check_role(kv, "produce", TRTLLM_PARAM)
        ctx_id = secrets.randbits(63)
        return KVRequest(KVTransfer("produce", f"ctx-{ctx_id}"), "trtllm", ctx_id)
    if kind != "generation_only":
        raise bad_request(
            f"disaggregated_params.request_type {kind!r} is not served: tern serves "
            "'context_only' and 'generation_only'",
            TRTLLM_PARAM,
        )
    _check_role(kv, "consume", TRTLLM_PARAM)
    first = params.get("first_gen_tokens")
    if not _is_int_list(first) or not first:
        raise bad_request(
            "disaggregated_params.first_gen_tokens must be a non-empty list of token ids",
            TRTLLM_PARAM,
        )
    state = decode_opaque_state(params.get("encoded_opaque_state"))
    return KVRequest(KVTransfer("consume", state["lease_id"], state["bootstrap"]), "trtllm")


def encode_opaque_state(side: KVSide, kv: KVRequest) -> str:
    state = {
        "bootstrap": f"tcp://{side.config.bootstrap_host}:{side.config.bootstrap_port}",
        "lease_id": kv.transfer.lease_id,
    }
    return base64.b64encode(json.dumps(state).encode()).decode()


def decode_opaque_state(text: Any) -> dict[str, str]:
    """The context server's opaque state: its bootstrap address and the lease."""
    error = bad_request(
        "disaggregated_params.encoded_opaque_state must be the one a tern context server "
        "answered (base64 JSON with bootstrap and lease_id)",
        TRTLLM_PARAM,
    )
    if not isinstance(text, str):
        raise error
    try:
        state = json.loads(base64.b64decode(text, validate=True))
    except (binascii.Error, ValueError):
        raise error from None
    if not isinstance(state, dict) or not all(
        isinstance(state.get(k), str) and state.get(k) for k in ("bootstrap", "lease_id")
    ):
        raise error
    if not state["bootstrap"].startswith("tcp://"):
        raise error
    return state


def trtllm_context_answer(
    side: KVSide, kv: KVRequest, first_tokens: list[int], finish_reason: str | None,
    client_max_tokens: int | None,
) -> tuple[dict[str, Any], str | None]:  # fmt: skip
    """A context server's choice `disaggregated_params`, and the choice's finish reason: the
    request ends here (as trtllm-serve ends it) when its first token stopped it or the client
    asked for one token; otherwise it goes on at the generation server (None)."""
    params = {
        "request_type": "generation_only",
        "first_gen_tokens": list(first_tokens),
        "ctx_request_id": kv.ctx_request_id,
        "encoded_opaque_state": encode_opaque_state(side, kv),
    }
    ends_here = finish_reason not in ("length", None) or client_max_tokens == 1
    return params, finish_reason if ends_here else None


# --------------------------------------------------------------------------- shared


def _check_role(kv: KVTransferConfig, role: str, param: str) -> None:
    if not kv.enabled:
        raise bad_request(
            f"{param}: this server has no KV transfer (start it with --kv-transfer-config or "
            "--disaggregation-mode)",
            param,
        )
    if role == "produce" and not kv.produces:
        raise bad_request(f"{param}: this server's kv_role ({kv.role}) does not produce KV", param)
    if role == "consume" and not kv.consumes:
        raise bad_request(f"{param}: this server's kv_role ({kv.role}) does not consume KV", param)


def _bootstrap_addr(host: Any, port: Any, param: str) -> str:
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise bad_request(f"the producer's port must be in [1, 65535], not {port!r}", param)
    if not isinstance(host, str) or not host or any(c in host for c in "/ "):
        raise bad_request(f"the producer's host {host!r} is not a host name", param)
    return f"tcp://{host}:{port}"


def _param_of(kv: KVRequest, default: str) -> str:
    return {"vllm": VLLM_PARAM, "sglang": "bootstrap_room", "trtllm": TRTLLM_PARAM}.get(
        kv.protocol, default
    )


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    )

"""The field policy for request bodies: what tern does with fields that peers' routers and SDKs add.

Routers put their own fields into every body they forward: vllm-router 0.1.17 and sglang-router
(sgl-model-gateway) re-serialize /v1/chat/completions and /v1/completions through SGLang's request
structs, so each body gains `no_stop_trim`, `separate_reasoning`, `stream_reasoning`,
`return_hidden_states` (and, when a client set them, `lora_path`, `session_params`, `regex`,
`ebnf`, `json_schema`, `sampling_seed`, `rid`). The policy, decided here and nowhere else
(`lora_path`, the name of a LoRA adapter, is read with `model`: OpenAIServing.lora_of):

1. A peer's field that means something tern does is honoured under tern's name (`HONOURED`):
   `no_stop_trim` is `include_stop_str_in_output`, `sampling_seed` is `seed`, `rid` is
   `request_id`, `regex` / `ebnf` / `json_schema` are `structured_outputs` regex / grammar / json.
   A peer's default (`no_stop_trim: false`) asks for nothing and never overrides tern's field; a
   value that contradicts tern's field set in the same body is a 400 naming the peer's field.
2. A peer's field whose effect tern cannot deliver is accepted only at its neutral values
   (`NEUTRAL`: the values that mean "not used"), which routers send by default; any other value is
   a 400 naming it, never silently ignored.
3. Every other unknown field is a 400 (msgspec's forbid_unknown_fields in protocol.py), so a typo
   is never ignored.

`PeerFields` declares the fields (request structs inherit it) and `apply_peer_fields` runs the policy
at validation. This module knows nothing about tokenizers or the engine.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import msgspec
from msgspec import UNSET

from frontend.common.decoding import field_markers
from frontend.common.errors import bad_request

# Peer fields tern honours -> tern's field (how: apply_peer_fields).
HONOURED: dict[str, str] = {
    "no_stop_trim": "include_stop_str_in_output",
    "sampling_seed": "seed",
    "rid": "request_id",
    "regex": "structured_outputs",
    "ebnf": "structured_outputs",
    "json_schema": "structured_outputs",
}

# SGLang's constraint fields -> the key of vLLM's structured_outputs that means the same.
_CONSTRAINTS = {"regex": "regex", "ebnf": "grammar", "json_schema": "json"}
_OTHER_CONSTRAINTS = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


class Neutral:
    """The annotation of a peer's field tern cannot honour: the values that mean "not used"."""

    __slots__ = ("allowed",)

    def __init__(self, *allowed: Any) -> None:
        self.allowed = allowed


class PeerFields(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The fields routers and SGLang clients add to OpenAI bodies (see the module docstring)."""

    no_stop_trim: bool | None = None
    sampling_seed: int | None = None
    rid: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | dict[str, Any] | None = None
    # Fields tern cannot honour, with the values that mean "not used" (anything else is a 400).
    # SGLang splits reasoning (with a reasoning parser) and streams it as it comes: so does tern.
    separate_reasoning: Annotated[Any, Neutral(None, True)] = UNSET
    stream_reasoning: Annotated[Any, Neutral(None, True)] = UNSET
    return_hidden_states: Annotated[Any, Neutral(None, False)] = UNSET
    lora_path: Any = UNSET  # honoured: an adapter's name, read with `model` (OpenAIServing.lora_of)
    session_params: Annotated[Any, Neutral(None)] = UNSET


# Peer fields tern cannot honour -> the values that mean "not used" (anything else is a 400).
NEUTRAL: dict[str, tuple[Any, ...]] = {
    name: m.allowed for name, m in field_markers(PeerFields, Neutral).items()
}


def apply_peer_fields(req: Any) -> None:
    """Maps the honoured peer fields of `req` onto tern's, and 400s a neutral-only one set to
    anything else. `req` is a request struct inheriting PeerFields."""
    for name, allowed in NEUTRAL.items():
        value = getattr(req, name)
        if value is not UNSET and not _is_neutral(value, allowed):
            raise bad_request(
                f"'{name}' = {value!r} is not supported by this server "
                f"(accepted: {', '.join(json.dumps(a) for a in allowed)})",
                name,
            )
    if req.no_stop_trim:  # false is SGLang's default: it asks for nothing
        req.include_stop_str_in_output = True
    if req.sampling_seed is not None:
        if req.seed is not None and req.seed != req.sampling_seed:
            raise bad_request("seed and sampling_seed disagree: set one", "sampling_seed")
        req.seed = req.sampling_seed
    if req.rid is not None:
        if req.request_id is not None and req.request_id != req.rid:
            raise bad_request("request_id and rid disagree: set one", "rid")
        req.request_id = req.rid
    _apply_constraints(req)


def _is_neutral(value: Any, allowed: tuple[Any, ...]) -> bool:
    # NOTE: type-checked, so that 0 does not pass for False nor 1 for True.
    return any(value is a or (type(value) is type(a) and value == a) for a in allowed)


def _apply_constraints(req: Any) -> None:
    set_fields = [name for name in _CONSTRAINTS if getattr(req, name) is not None]
    if not set_fields:
        return
    others = [n for n in _OTHER_CONSTRAINTS if getattr(req, n, None) is not None]
    if len(set_fields) > 1 or others or req.structured_outputs is not None:
        clash = (set_fields[1:] + others + ["structured_outputs"])[0]
        raise bad_request(
            f"'{set_fields[0]}' and '{clash}' both constrain the output: set only one",
            set_fields[0],
        )
    name = set_fields[0]
    value = getattr(req, name)
    if name == "json_schema" and isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise bad_request(f"json_schema is not valid JSON: {e}", "json_schema") from None
    req.structured_outputs = {_CONSTRAINTS[name]: value}

"""What a KV producer's answer carries for the next stage, in the form its request came in:
vLLM's response `kv_transfer_params` (vllm-router copies it into the consumer's body), TensorRT-LLM's
choice `disaggregated_params` and response `prompt_token_ids` (with the choice's finish reason:
None when the request goes on at the generation server). SGLang's router ignores the prefill
server's answer: nothing is added (but a prefill server's refusal fails the room's lease, so that
the decode server stops waiting). Also the one place that says how a request's sampling changes
when it carries a transfer. This module knows nothing about HTTP.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from msgspec import UNSET, UnsetType

from frontend.common.errors import APIError, bad_request
from frontend.disagg.requests import (
    TRTLLM_PARAM,
    KVRequest,
    KVSide,
    trtllm_context_answer,
    vllm_producer_params,
)
from frontend.serving.generation import Generation
from frontend.serving.sampling import RequestSampling

if TYPE_CHECKING:
    from frontend.serving.base import OpenAIServing


def prompt_only(sampling: RequestSampling) -> RequestSampling:
    """The sampling of a prompt-only producer: one token (see KVRequest.is_prompt_only)."""
    sampling.max_tokens = 1
    if sampling.min_tokens is not None:
        sampling.min_tokens = min(sampling.min_tokens, 1)
    return sampling


@dataclass
class KVAnswer:
    """The fields one finished producing choice adds to its response."""

    finish_reason: str | None
    kv_transfer_params: dict[str, Any] | UnsetType = UNSET  # the response's (vLLM)
    disaggregated_params: dict[str, Any] | UnsetType = UNSET  # the choice's (TRT-LLM)
    prompt_token_ids: list[int] | UnsetType = UNSET  # the response's (TRT-LLM)


def kv_sampling(
    sampling: RequestSampling, kv: KVRequest | None, stream: bool | None
) -> RequestSampling:
    """`sampling` as the engine runs it: a prompt-only producer computes one token. A TRT-LLM
    context request is answered whole (its answer is read by an orchestrator, not streamed)."""
    if kv is None:
        return sampling
    if kv.protocol == "trtllm" and kv.produces and stream:
        raise bad_request("a context_only request cannot be streamed", TRTLLM_PARAM)
    return prompt_only(sampling) if kv.is_prompt_only else sampling


def kv_answer(
    side: KVSide, kv: KVRequest | None, gen: Generation, client_max_tokens: int | None
) -> KVAnswer:
    """The fields of a finished generation's answer (none unless it produced KV)."""
    answer = KVAnswer(gen.finish_reason)
    if kv is None or not kv.produces:
        return answer
    if kv.protocol == "vllm" and gen.kv_lease_block_ids is not None:
        # NOTE: none when nothing was lent (a stop string ended it here first): vllm-router then
        # sends the consumer a plain request, which computes the prompt itself.
        answer.kv_transfer_params = vllm_producer_params(
            side, kv, gen.replica, gen.kv_lease_block_ids
        )
    elif kv.protocol == "trtllm":
        params, finish = trtllm_context_answer(
            side, kv, gen.output_token_ids, gen.finish_reason, client_max_tokens
        )
        answer.disaggregated_params, answer.finish_reason = params, finish
        answer.prompt_token_ids = list(gen.prompt_token_ids)
    return answer


@contextlib.contextmanager
def refusal_fails_room(serving: OpenAIServing, room: Any) -> Iterator[None]:
    """On a prefill server, a request with SGLang's `bootstrap_room` that is refused (any 400 or
    503 before it starts) fails the room's lease: the decode server that sglang-router sent the
    same request to at once stops waiting instead of waiting out its wait_s."""
    try:
        yield
    except APIError as e:
        leases = serving.leases
        if leases is not None and isinstance(room, int) and not isinstance(room, bool):
            leases.fail(f"room-{room}", 0, f"the prefill server refused the request: {e.message}")
        raise

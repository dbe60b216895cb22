"""From an API request to what the engine needs beyond temperature and top-p: logits processing
(penalties, logit bias, allowed tokens, min_tokens), prompt truncation, and the parameters of each
of n parallel samples.

Parallel samples are separate engine requests sent together: the first computes the prompt, the
others find its full KV blocks in the prefix cache. With a seed, sample i uses seed + i, so n
samples with a seed are the same whatever else the engine runs. A request that wants prompt
logprobs bypasses the prefix cache (they need the logits of every prompt position), so then each
sample computes the prompt: each choice, streamed or not, has its prompt logprobs at once.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET

from enginecore.messages import SamplingParams
from frontend.server.errors import bad_request

_MAX_BIAS = 100.0  # OpenAI's range for logit_bias values; vLLM clamps to it


def request_field(req: Any, name: str) -> Any:
    """An optional field of a route's request: None when that route has no such field, or it was
    left out (known-but-unsupported fields are UNSET until the client sets them)."""
    value = getattr(req, name, None)
    return None if value is UNSET else value


def truncate_prompt(ids: list[int], k: int | None, max_model_len: int) -> list[int]:
    """truncate_prompt_tokens: keep the last k tokens (-1: as many as the context holds)."""
    if k is None:
        return ids
    if k > max_model_len:
        raise bad_request(
            f"truncate_prompt_tokens ({k}) exceeds the context length ({max_model_len})",
            "truncate_prompt_tokens",
        )
    keep = max_model_len if k == -1 else k
    return ids[-keep:] if len(ids) > keep else ids


def set_logits_processing(
    params: SamplingParams, req: Any, vocab_size: int, defaults: dict[str, Any]
) -> None:
    """Fills in the request's penalties, logit bias, allowed tokens and min_tokens (checked)."""
    rep = request_field(req, "repetition_penalty")
    if rep is None:
        rep = defaults.get("repetition_penalty", 1.0)
    params.repetition_penalty = float(rep)
    params.frequency_penalty = float(request_field(req, "frequency_penalty") or 0.0)
    params.presence_penalty = float(request_field(req, "presence_penalty") or 0.0)
    bias = request_field(req, "logit_bias") or {}
    params.logit_bias = {
        _token_id(key, vocab_size, "logit_bias"): min(_MAX_BIAS, max(-_MAX_BIAS, float(value)))
        for key, value in bias.items()
    }
    allowed = request_field(req, "allowed_token_ids") or []
    params.allowed_token_ids = [_token_id(t, vocab_size, "allowed_token_ids") for t in allowed]
    min_tokens = request_field(req, "min_tokens") or 0
    if min_tokens > params.max_tokens:
        raise bad_request(
            f"min_tokens ({min_tokens}) exceeds max_tokens ({params.max_tokens})", "min_tokens"
        )
    params.min_tokens = min_tokens


def _token_id(value: int | str, vocab_size: int, param: str) -> int:
    token_id = int(value)
    if not 0 <= token_id < vocab_size:
        raise bad_request(f"{param} token ids must be in [0, {vocab_size}); got {token_id}", param)
    return token_id


def for_sample(
    params: SamplingParams, index: int, logprobs: int | None, prompt_logprobs: int | None
) -> SamplingParams:
    """The parameters of parallel sample `index` of a prompt."""
    seed = params.seed
    if seed is not None and index:
        seed = (seed + index + 2**63) % 2**64 - 2**63  # stays a signed 64-bit integer
    return msgspec.structs.replace(
        params, seed=seed, logprobs=logprobs, prompt_logprobs=prompt_logprobs
    )

"""One request's sampling, whatever API it came in: the typed struct every protocol's
`to_sampling()` fills, its range checks (`verify()`, the only ones), and the step from it to the
engine's SamplingParams: logits processing, prompt truncation, and each of n parallel samples.

Where a peer API's ranges differ from vLLM's (SGLang's top_k has no 0, its repetition_penalty
stops at 2, LMDeploy's top_k has no -1...), the difference is data: a `SamplingRules`.

Parallel samples are separate engine requests sent together: the first computes the prompt, the
others find its full KV blocks in the prefix cache. With a seed, sample i uses seed + i, so n
samples with a seed are the same whatever else the engine runs. A request that wants prompt
logprobs bypasses the prefix cache (they need the logits of every prompt position), so then each
sample computes the prompt: each choice, streamed or not, has its prompt logprobs at once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import msgspec

from enginecore.messages import CrossAttentionRows, SamplingParams, TimestampRule
from frontend.common.errors import bad_request

_MAX_BIAS = 100.0  # OpenAI's range for logit_bias values; vLLM clamps to it
_INT32_MAX = 2**31 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_TOKEN_ID = re.compile(r"-?[0-9]+")  # str.isdigit() also takes "²", which int() refuses
MAX_N = 128  # samples per prompt


@dataclass(frozen=True)
class SamplingRules:
    """How one API's ranges and names differ from vLLM's."""

    top_k_disabled: tuple[int, ...] = (-1, 0)  # the values that mean "all tokens"
    max_repetition_penalty: float = float("inf")
    min_max_tokens: int = 1  # SGLang's max_new_tokens may be 0 (prefill only)
    param_prefix: str = ""  # SGLang names its fields sampling_params.<name>
    names: dict[str, str] = field(default_factory=dict)  # tern's field -> the API's name

    def param(self, name: str) -> str:
        return self.param_prefix + self.names.get(name, name)


VLLM_RULES = SamplingRules()
SGLANG_RULES = SamplingRules(
    top_k_disabled=(-1,),
    max_repetition_penalty=2.0,
    min_max_tokens=0,
    param_prefix="sampling_params.",
    names={
        "max_tokens": "max_new_tokens",
        "min_tokens": "min_new_tokens",
        "seed": "sampling_seed",
        "include_stop_str_in_output": "no_stop_trim",
    },
)
LMDEPLOY_RULES = SamplingRules(top_k_disabled=(0,))


class RequestSampling(msgspec.Struct, kw_only=True):
    """What a request asks of sampling and of the detokenizer. None: the model's default
    (generation_config.json), then the neutral value."""

    max_tokens: int | None = None  # None: as many as the context holds
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    n: int = 1
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    allowed_token_ids: list[int] | None = None
    min_tokens: int | None = None
    # Set by the server, not the client: the model's suppressed tokens (speech-to-text models).
    suppress_token_ids: list[int] = []
    begin_suppress_token_ids: list[int] = []
    timestamps: TimestampRule | None = None
    cross_attention: CrossAttentionRows | None = None  # word timestamps' alignment heads
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens (-1: the context)
    max_tokens_name: str = "max_tokens"  # the field the client set (max_completion_tokens...)
    rules: SamplingRules = VLLM_RULES

    def param(self, name: str) -> str:
        """The request field `name` is, as the client named it."""
        if name == "max_tokens":
            return self.rules.param_prefix + self.max_tokens_name
        return self.rules.param(name)

    def verify(self) -> None:
        """Raises APIError (400, naming the field) for a value out of its range."""
        self._verify_limits()
        self._verify_distribution()
        self._verify_processing()

    def _fail(self, name: str, message: str) -> None:
        param = self.param(name)
        raise bad_request(f"{param.rsplit('.', 1)[-1]} {message}", param)

    def _verify_limits(self) -> None:
        if not 1 <= self.n <= MAX_N:
            self._fail("n", f"must be in [1, {MAX_N}], got {self.n}")
        low = self.rules.min_max_tokens
        if self.max_tokens is not None and self.max_tokens < low:
            self._fail("max_tokens", f"must be at least {low}, got {self.max_tokens}")
        if self.min_tokens is not None:
            if self.min_tokens < 0 or (
                self.max_tokens is not None and self.min_tokens > self.max_tokens
            ):
                self._fail("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens}")
        k = self.truncate_prompt_tokens
        if k is not None and not (k == -1 or k >= 1):
            self._fail("truncate_prompt_tokens", f"must be -1 or positive, got {k}")
        if any(s == "" for s in self.stop):
            self._fail("stop", "strings must not be empty")

    def _verify_distribution(self) -> None:
        t, p, k = self.temperature, self.top_p, self.top_k
        if t is not None and not 0.0 <= t < float("inf"):
            self._fail("temperature", f"must be non-negative, got {t}")
        if p is not None and not 0.0 < p <= 1.0:
            self._fail("top_p", f"must be in (0, 1], got {p}")
        if k is not None and not (k in self.rules.top_k_disabled or 1 <= k <= _INT32_MAX):
            off = " or ".join(str(v) for v in self.rules.top_k_disabled)
            self._fail("top_k", f"must be {off} (disabled) or >= 1, got {k}")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            self._fail("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not _INT64_MIN <= self.seed <= _INT64_MAX:
            self._fail("seed", "must fit in a signed 64-bit integer")

    def _verify_processing(self) -> None:
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if value is not None and not -2.0 <= value <= 2.0:
                self._fail(name, f"must be in [-2, 2], got {value}")
        rep, top = self.repetition_penalty, self.rules.max_repetition_penalty
        if rep is not None and not 0.0 < rep <= top:
            bound = "positive" if top == float("inf") else f"in (0, {top:g}]"
            self._fail("repetition_penalty", f"must be {bound}, got {rep}")
        for key, bias in (self.logit_bias or {}).items():
            if not _TOKEN_ID.fullmatch(key) or bias != bias:
                self._fail("logit_bias", f"maps token ids to numbers; got {key!r}: {bias}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            self._fail("allowed_token_ids", "must not be empty")


def stop_list(stop: str | list[str] | None) -> list[str]:
    """OpenAI's `stop`: one string or a list of them."""
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


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
    params: SamplingParams, sampling: RequestSampling, vocab_size: int, defaults: dict[str, Any]
) -> None:
    """Fills in the request's penalties, logit bias, allowed tokens and min_tokens (checked)."""
    rep = sampling.repetition_penalty
    if rep is None:
        rep = defaults.get("repetition_penalty", 1.0)
    params.repetition_penalty = float(rep)
    params.frequency_penalty = float(sampling.frequency_penalty or 0.0)
    params.presence_penalty = float(sampling.presence_penalty or 0.0)
    bias = sampling.logit_bias or {}
    params.logit_bias = {
        _token_id(key, vocab_size, "logit_bias"): min(_MAX_BIAS, max(-_MAX_BIAS, float(value)))
        for key, value in bias.items()
    }
    allowed = sampling.allowed_token_ids or []
    params.allowed_token_ids = [_token_id(t, vocab_size, "allowed_token_ids") for t in allowed]
    min_tokens = sampling.min_tokens or 0
    if min_tokens > params.max_tokens:
        raise bad_request(
            f"min_tokens ({min_tokens}) exceeds max_tokens ({params.max_tokens})",
            sampling.param("min_tokens"),
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

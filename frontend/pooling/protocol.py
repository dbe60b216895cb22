"""Schemas of the pooling routes, and the arithmetic on the vectors the engine pools.

Whose shape each route has:
- POST /v1/embeddings: OpenAI's request and response (`data[i].embedding`, usage without
  completion tokens), with vLLM's extra fields: chat `messages` instead of `input`,
  `truncate_prompt_tokens`, `add_special_tokens`, and `normalize` (vLLM <= 0.10; newer vLLM calls it
  `use_activation`: both are accepted). OpenAI's `id`-less response gains vLLM's `id` and `created`.
- POST /pooling: vLLM's PoolingRequest / PoolingResponse. LMDeploy's /pooling takes a subset of the
  same request fields and answers the same fields, except that its `data[i].data` is one number (the
  reward) where vLLM's is a list: here it is vLLM's list (one float for a single-label head).
- POST /classify and POST /score: vLLM's.
- POST /v1/encode: LMDeploy's tokenization route (`input_ids` and `length`, flat for a string input).

The engine pools without post-processing (enginecore/messages.py EngineCoreOutput.pooled): L2
normalisation, `dimensions`, softmax and sigmoid happen here. This module knows nothing about the
engine or the tokenizer.
"""

from __future__ import annotations

import base64
import math
from typing import Annotated, Any, Literal, TypeVar

import msgspec
import numpy as np
from msgspec import UNSET, UnsetType

from frontend.common.decoding import Unsupported, check_unsupported, decode_request
from frontend.common.errors import APIError, bad_request
from frontend.common.protocol import UsageInfo

T = TypeVar("T")

MAX_INPUTS = 2048  # OpenAI's limit on the items of one embeddings request
TASKS = ("generate", "embed", "classify", "reward")
POOLING_TASKS = ("embed", "classify", "reward")

# Fields of the generating routes: on a pooling route, a 400 that says why rather than msgspec's
# "unknown field".
GENERATION_PARAMS = frozenset({
    "max_tokens", "max_completion_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p",
    "seed", "n", "best_of", "stop", "stop_token_ids", "ignore_eos", "stream", "stream_options",
    "logprobs", "top_logprobs", "prompt_logprobs", "echo", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "allowed_token_ids", "response_format", "tools",
    "tool_choice", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "skip_special_tokens", "include_stop_str_in_output",
})  # fmt: skip


# --------------------------------------------------------------------------- requests


class PoolingInput(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What every pooling route but /score runs the model on: `input` (text or token ids, one or a
    batch, as OpenAI's embeddings) or chat `messages` (one conversation, rendered by the chat
    template: how reward models are called)."""

    model: str | None = None
    input: str | list[Any] | UnsetType = UNSET
    messages: list[dict[str, Any]] | UnsetType = UNSET
    # None: vLLM's defaults, true for `input` and false for `messages` (the template has them).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = False  # vLLM's default on pooling routes: score the turns as sent
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    truncate_prompt_tokens: int | None = None  # keep the last k tokens (-1: the context length)
    user: str | None = None  # OpenAI's end-user id: accepted, no effect on the output
    request_id: str | None = None  # vLLM: the response id's base when there is no X-Request-Id

    priority: Annotated[Any, Unsupported(None, 0)] = UNSET
    chat_template: Annotated[Any, Unsupported(None)] = UNSET
    mm_processor_kwargs: Annotated[Any, Unsupported(None)] = UNSET
    cache_salt: Annotated[Any, Unsupported(None)] = UNSET

    def validate(self) -> None:
        check_unsupported(self)
        if (self.input is UNSET) == (self.messages is UNSET):
            raise bad_request("specify exactly one of input or messages", "input")
        if self.messages is UNSET:
            chat_only = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")
            for name in chat_only:
                if getattr(self, name):
                    raise bad_request(f"{name} applies to messages, not to input", name)
        elif not self.messages:
            raise bad_request("messages must not be empty", "messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true",
                "continue_final_message",
            )
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)

    @property
    def inputs(self) -> list[str | list[int]]:
        """`input` as a batch (call only without messages)."""
        assert not isinstance(self.input, UnsetType)
        return normalize_input(self.input)


class EmbeddingRequest(PoolingInput, forbid_unknown_fields=True, kw_only=True):
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # keep the first k dimensions, then normalise (Matryoshka)
    normalize: bool | None = None  # L2 normalisation, on by default (vLLM's name until 0.10)
    use_activation: bool | None = None  # the same, under vLLM's newer name

    def validate(self) -> None:
        super().validate()
        if self.dimensions is not None and self.dimensions < 1:
            raise bad_request(f"dimensions must be at least 1, got {self.dimensions}", "dimensions")
        both = (self.normalize, self.use_activation)
        if None not in both and both[0] != both[1]:
            raise bad_request(
                "normalize and use_activation are one setting under two names; they disagree",
                "use_activation",
            )

    @property
    def wants_normalized(self) -> bool:
        for value in (self.normalize, self.use_activation):
            if value is not None:
                return value
        return True


class PoolingRequest(EmbeddingRequest, forbid_unknown_fields=True, kw_only=True):
    """vLLM's /pooling (LMDeploy's takes model, input, encoding_format, dimensions, user)."""

    task: str | None = None  # vLLM: the pooling task asked for; must be the model's


class ClassificationRequest(PoolingInput, forbid_unknown_fields=True, kw_only=True):
    use_activation: bool | None = None  # false: the raw logits instead of probabilities


class ScoreRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's /score: text_1[i] against text_2[i]; a single text_1 against every text_2."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None  # cross-encoders: false gives the raw logit (no sigmoid)
    user: str | None = None
    request_id: str | None = None

    priority: Annotated[Any, Unsupported(None, 0)] = UNSET
    mm_processor_kwargs: Annotated[Any, Unsupported(None)] = UNSET

    def validate(self) -> None:
        check_unsupported(self)
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)

    def pairs(self) -> list[tuple[str, str]]:
        return score_pairs(self.text_1, self.text_2)


class EncodeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """LMDeploy's /v1/encode: tokenize text, optionally as a user turn of the chat template."""

    input: str | list[str]
    do_preprocess: bool | None = False  # render the text as a user message of the chat template
    add_bos: bool | None = True  # false: drop the tokenizer's leading BOS

    def validate(self) -> None:
        if isinstance(self.input, list) and not self.input:
            raise bad_request("input must not be empty", "input")


# --------------------------------------------------------------------------- responses


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingData(msgspec.Struct):
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32 (encoding_format base64)
    object: str = "embedding"


class EmbeddingResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
    object: str = "list"


class PoolingData(msgspec.Struct):
    index: int
    data: list[float] | str
    object: str = "pooling"


class PoolingResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[PoolingData]
    usage: UsageInfo
    object: str = "list"


class ClassificationData(msgspec.Struct):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[ClassificationData]
    usage: UsageInfo
    object: str = "list"


class ScoreData(msgspec.Struct):
    index: int
    score: float
    object: str = "score"


class ScoreResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[ScoreData]
    usage: UsageInfo
    object: str = "list"


class EncodeResponse(msgspec.Struct):
    input_ids: list[Any]  # list[int] for a string input, list[list[int]] for a list
    length: int | list[int]


# --------------------------------------------------------------------------- decoding


def decode_pooling_request(body: bytes, typ: type[T], route: str) -> T:
    """decode_request, with a 400 that explains a generation parameter sent to a pooling route."""
    try:
        return decode_request(body, typ)
    except APIError as e:
        if e.param in GENERATION_PARAMS and "unknown field" in e.message:
            raise bad_request(
                f"'{e.param}' is a generation parameter: {route} generates no tokens (the model "
                "runs once over the input)",
                e.param,
            ) from None
        raise


def check_truncate_prompt_tokens(k: int | None) -> None:
    if k is not None and not (k == -1 or k >= 1):
        raise bad_request(
            f"truncate_prompt_tokens must be -1 or positive, got {k}", "truncate_prompt_tokens"
        )


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def normalize_input(value: str | list[Any], param: str = "input") -> list[str | list[int]]:
    """`input` as a batch: each item a non-empty string or a non-empty list of token ids.

    One input may be a string or a list of token ids; a batch is a list of strings or a list of
    token-id lists (not mixed), as in OpenAI's embeddings API.
    """
    if isinstance(value, str):
        if not value:
            raise bad_request("input must not be an empty string", param)
        return [value]
    if not value:
        raise bad_request("input must not be empty", param)
    if len(value) > MAX_INPUTS:
        raise bad_request(f"input has {len(value)} items; at most {MAX_INPUTS} are allowed", param)
    if all(_is_int(t) for t in value):
        return [list(value)]
    if all(isinstance(p, str) for p in value):
        for i, p in enumerate(value):
            if not p:
                raise bad_request(f"input[{i}] is an empty string", param)
        return list(value)
    if all(isinstance(p, list) for p in value):
        for i, ids in enumerate(value):
            if not ids or not all(_is_int(t) for t in ids):
                raise bad_request(f"input[{i}] must be a non-empty list of token ids", param)
        return [list(p) for p in value]
    raise bad_request(
        "input must be a string, a list of strings, a list of token ids, or a list of token-id "
        "lists",
        param,
    )


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one text_1 scores against every text_2; lists of equal length pair up."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    for name, texts in (("text_1", firsts), ("text_2", seconds)):
        if not texts:
            raise bad_request(f"{name} must not be empty", name)
        if len(texts) > MAX_INPUTS:
            raise bad_request(f"{name} has more than {MAX_INPUTS} items", name)
        for i, text in enumerate(texts):
            if not text:
                raise bad_request(f"{name}[{i}] is an empty string", name)
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise bad_request(
            f"text_1 has {len(firsts)} items and text_2 {len(seconds)}: give one text_1, or as "
            "many as text_2",
            "text_1",
        )
    return list(zip(firsts, seconds))


# --------------------------------------------------------------------------- vector arithmetic


def embedding_vector(
    pooled: list[float], dimensions: int | None = None, normalize: bool = True
) -> np.ndarray:
    """The first `dimensions` values of a pooled hidden state (all: None), L2-normalised if asked
    (as torch's F.normalize: a zero vector stays zero). float64, so that the JSON keeps float32's
    precision after the division."""
    v = np.asarray(pooled, dtype=np.float64)
    if dimensions is not None:
        v = v[:dimensions]
    if normalize:
        v = v / max(float(np.linalg.norm(v)), 1e-12)
    return v


def encode_vector(v: np.ndarray | list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64_float32(v)
    return np.asarray(v, dtype=np.float64).tolist()


def base64_float32(v: np.ndarray | list[float]) -> str:
    """OpenAI's base64 embeddings: the raw bytes of little-endian float32 values."""
    return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii")


def softmax(logits: list[float]) -> list[float]:
    x = np.asarray(logits, dtype=np.float64)
    e = np.exp(x - x.max())
    return (e / e.sum()).tolist()


def sigmoid(x: float) -> float:
    # NOTE: the two branches keep exp() from overflowing for large |x|.
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def class_probabilities(logits: list[float]) -> list[float]:
    """vLLM's classifier activation: softmax over the labels; sigmoid for a single-label head (the
    softmax of one logit would always be 1)."""
    if len(logits) == 1:
        return [sigmoid(logits[0])]
    return softmax(logits)


def cosine_similarity(a: list[float], b: list[float]) -> float:
    x, y = embedding_vector(a), embedding_vector(b)
    return float(np.dot(x, y))

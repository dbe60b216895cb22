"""The OpenAI-compatible HTTP schemas, as msgspec structs: requests are decoded and validated here.

Request field names and types mirror vLLM's ChatCompletionRequest / CompletionRequest, so a client
written for vLLM works unchanged. Fields we implement are typed; every other field that OpenAI or
vLLM define is declared too, so that a request using one with a non-default value gets a 400 naming
it instead of being silently ignored. Fields that routers and SGLang clients add (no_stop_trim,
separate_reasoning, ...) follow the policy of frontend/openai/peer_fields.py; fields no client
sends are rejected by msgspec (forbid_unknown_fields). This module knows nothing about tokenizers or
the engine.
"""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

import msgspec
from msgspec import UNSET, UnsetType

from enginecore.messages import StructuredOutputSpec
from frontend.openai.peer_fields import PeerFields, apply_peer_fields
from frontend.server.errors import bad_request
from frontend.serving.sampling import RequestSampling, stop_list
from frontend.text.structured_outputs import structured_output_spec

T = TypeVar("T")

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_LOGPROBS = 20  # most likely tokens per position (vLLM's default --max-logprobs)

# Known fields we do not implement -> the values that mean "not used" (anything else is a 400).
_COMMON_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1),
    "early_stopping": (None, False),
    "bad_words": (None, []),
    "logits_processors": (None,),
    "guided_whitespace_pattern": (None,),
    "priority": (None, 0),
    "cache_salt": (None,),
    "kv_transfer_params": (None,),
    "vllm_xargs": (None,),
    "mm_processor_kwargs": (None,),
    "media_io_kwargs": (None,),
    "metadata": (None,),
    "store": (None, False),
    "service_tier": (None, "auto", "default"),
    "prediction": (None,),
}
_CHAT_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    **_COMMON_UNSUPPORTED,
    "functions": (None,),
    "function_call": (None, "none"),
    "documents": (None,),
    "chat_template": (None,),
    "reasoning_effort": (None,),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "web_search_options": (None,),
    "verbosity": (None,),
}
_COMPLETION_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    **_COMMON_UNSUPPORTED,
    "suffix": (None, ""),
    "prompt_embeds": (None,),
}


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool | None = True  # vLLM's default: `stream_options: {}` asks for usage
    continuous_usage_stats: bool | None = False


class _RequestBase(PeerFields, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    user: str | None = None  # accepted and ignored, as OpenAI and vLLM do
    # vLLM: the request id's base when there is no X-Request-Id header.
    request_id: str | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Routing / abuse-detection hints with no effect on the output.
    parallel_tool_calls: bool | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    # Structured output (frontend/text/structured_outputs.py reads and checks these).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None

    # Logits processing on the worker (enginecore/messages.py SamplingParams).
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    allowed_token_ids: list[int] | None = None
    min_tokens: int | None = None
    # The tokenizers backend never puts spaces around special tokens (as vLLM's fast detokenizer):
    # false is what it does; true matters only when special tokens are shown, and then is a 400.
    spaces_between_special_tokens: bool | UnsetType = UNSET
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens (-1: the context)
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool | None = None  # logprobs' tokens as "token_id:<id>"
    return_token_ids: bool | None = None  # prompt_token_ids and token_ids in the response
    echo: bool | None = False

    # Known but unsupported (see _COMMON_UNSUPPORTED): typed loosely, rejected when used.
    best_of: Any = UNSET
    use_beam_search: Any = UNSET
    length_penalty: Any = UNSET
    early_stopping: Any = UNSET
    bad_words: Any = UNSET
    logits_processors: Any = UNSET
    guided_whitespace_pattern: Any = UNSET
    priority: Any = UNSET
    cache_salt: Any = UNSET
    kv_transfer_params: Any = UNSET
    vllm_xargs: Any = UNSET
    mm_processor_kwargs: Any = UNSET
    media_io_kwargs: Any = UNSET
    metadata: Any = UNSET
    store: Any = UNSET
    service_tier: Any = UNSET
    prediction: Any = UNSET

    _unsupported = _COMMON_UNSUPPORTED

    @property
    def max_tokens_field(self) -> tuple[str, int | None]:
        """(the field that sets the output length, its value)."""
        return "max_tokens", self.max_tokens

    def output_constraint(self) -> StructuredOutputSpec | None:
        """response_format, structured_outputs or a guided_* field (at most one)."""
        guided = {
            "guided_json": self.guided_json,
            "guided_regex": self.guided_regex,
            "guided_choice": self.guided_choice,
            "guided_grammar": self.guided_grammar,
        }
        return structured_output_spec(
            self.response_format, self.structured_outputs, guided, self.guided_decoding_backend
        )

    def to_sampling(self) -> RequestSampling:
        name, max_tokens = self.max_tokens_field
        return RequestSampling(
            max_tokens=max_tokens,
            max_tokens_name=name,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            n=1 if self.n is None else self.n,
            stop=stop_list(self.stop),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            min_tokens=self.min_tokens,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
        )

    def validate(self) -> None:
        """Raises APIError (400) for unsupported fields and out-of-range values."""
        apply_peer_fields(self)
        check_unsupported(self, self._unsupported)
        if self.stream_options is not None and not self.stream:
            raise bad_request(
                "stream_options can only be set when stream is true", "stream_options"
            )
        self.to_sampling().verify()
        check_num_logprobs(self.prompt_logprobs, "prompt_logprobs")
        check_spaces_between_special_tokens(self)


class ChatCompletionRequest(_RequestBase, forbid_unknown_fields=True, kw_only=True):
    messages: list[dict[str, Any]] = []
    # The prompt as token ids: the chat template is skipped (and messages are not rendered).
    prompt_token_ids: list[int] | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    # Tool calling and reasoning (frontend/text/tool_calling.py, frontend/openai/chat_output.py).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    include_reasoning: bool = True
    functions: Any = UNSET
    function_call: Any = UNSET
    documents: Any = UNSET
    chat_template: Any = UNSET
    reasoning_effort: Any = UNSET
    modalities: Any = UNSET
    audio: Any = UNSET
    web_search_options: Any = UNSET
    verbosity: Any = UNSET

    _unsupported = _CHAT_UNSUPPORTED

    @property
    def max_tokens_field(self) -> tuple[str, int | None]:
        # vLLM: max_completion_tokens (the newer name) wins over the deprecated max_tokens.
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """How many most likely tokens each output token's logprobs show; None: no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def validate(self) -> None:
        super().validate()
        check_num_logprobs(self.top_logprobs, "top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise bad_request("prompt_token_ids must not be empty", "prompt_token_ids")
        if self.prompt_token_ids is None and not self.messages:
            raise bad_request("messages must not be empty", "messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true",
                "continue_final_message",
            )

    def normalized_messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template expects them: text-part lists joined into strings."""
        return normalize_messages(self.messages)


class CompletionRequest(_RequestBase, forbid_unknown_fields=True, kw_only=True):
    prompt: str | list[Any]
    add_special_tokens: bool = True
    logprobs: int | None = None  # the sampled token's, and this many most likely tokens'

    suffix: Any = UNSET
    prompt_embeds: Any = UNSET

    _unsupported = _COMPLETION_UNSUPPORTED

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def is_echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt back (with its logprobs), nothing generated."""
        return bool(self.echo) and self.max_tokens == 0

    @property
    def max_tokens_field(self) -> tuple[str, int | None]:
        return "max_tokens", 1 if self.is_echo_only else self.max_tokens

    def validate(self) -> None:
        super().validate()
        check_num_logprobs(self.logprobs, "logprobs")

    def normalized_prompts(self) -> list[str | list[int]]:
        """The prompts, in order: each a string or a list of token ids.

        `prompt` may be one prompt (a string, a list of token ids) or a batch of them (a list of
        strings, a list of token-id lists), as in OpenAI's API; a batch may not mix the two.
        """
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        if all(_is_int(t) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) for p in prompt):
            for i, ids in enumerate(prompt):
                if not ids or not all(_is_int(t) for t in ids):
                    raise bad_request(
                        f"prompt[{i}] must be a non-empty list of token ids", "prompt"
                    )
            return [list(p) for p in prompt]
        raise bad_request(
            "prompt must be a string, a list of token ids, or a list of either "
            "(strings, or lists of token ids)",
            "prompt",
        )


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_allowed(value: Any, allowed: tuple[Any, ...]) -> bool:
    # NOTE: type-checked equality, so that `1` does not pass for `True` nor `0` for `False`.
    for a in allowed:
        strict = value is None or a is None or isinstance(a, bool) or isinstance(value, bool)
        if (value is a) if strict else (value == a):
            return True
    return False


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as chat templates expect them, from any form OpenAI's API allows.

    `content` is always there and a string (templates index it): text-part lists are joined,
    an assistant's absent or null content (a turn of tool calls only) is "", and an assistant's
    `refusal` stands in for its content; tool calls' arguments become objects. Raises APIError
    (400, param messages[i].<field>) for what the API forbids: a missing or unknown role, content
    missing where it is required, non-text parts, tool calls off an assistant message.
    """
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    return [_normalize_message(i, m) for i, m in enumerate(messages)]


def _normalize_message(i: int, message: Any) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise bad_request("each message must be an object", f"messages[{i}]")
    role = message.get("role")
    if not isinstance(role, str):
        raise bad_request("each message needs a string 'role'", f"messages[{i}].role")
    if role not in CHAT_ROLES:
        raise bad_request(
            f"unsupported role {role!r}; expected one of {', '.join(CHAT_ROLES)}",
            f"messages[{i}].role",
        )
    for name in ("name", "tool_call_id", "refusal"):
        value = message.get(name)
        if value is not None and not isinstance(value, str):
            raise bad_request(f"{name} must be a string", f"messages[{i}].{name}")
    out = {k: v for k, v in message.items() if k != "refusal"}
    out["content"] = _content_text(i, role, message)
    if role == "developer":  # OpenAI's newer name for system instructions; templates know system
        out["role"] = "system"
    if message.get("tool_calls") is not None:
        out["tool_calls"] = _template_tool_calls(i, message)
    elif "tool_calls" in out:
        del out["tool_calls"]  # null: templates test for the key
    return out


def _content_text(i: int, role: str, message: dict[str, Any]) -> str:
    """The message's content as one string (absent or null only on an assistant turn)."""
    content = message.get("content")
    if content is None:
        if role != "assistant":
            raise bad_request(f"a {role} message needs 'content'", f"messages[{i}].content")
        return message.get("refusal") or ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("content must be a string or a list of parts", f"messages[{i}].content")
    texts = []
    for j, part in enumerate(content):
        param = f"messages[{i}].content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        # An assistant's parts may be refusals (OpenAI's ChatCompletionContentPartRefusal).
        key = "refusal" if kind == "refusal" and role == "assistant" else "text"
        if kind != key:
            raise bad_request(f"content part type {kind!r} is not supported (text only)", param)
        if not isinstance(part.get(key), str):
            raise bad_request(f"a {kind} content part needs a string {key!r}", param)
        texts.append(part[key])
    # vLLM joins the text parts of a message with newlines for string-content templates.
    return "\n".join(texts)


def _template_tool_calls(i: int, message: dict[str, Any]) -> list[dict[str, Any]]:
    """An assistant message's tool calls as chat templates read them: arguments as an object (as
    vLLM passes them; templates render them with tojson), not OpenAI's JSON string."""
    param = f"messages[{i}].tool_calls"
    calls = message["tool_calls"]
    if message.get("role") != "assistant" or not isinstance(calls, list):
        raise bad_request("tool_calls must be a list, on an assistant message", param)
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request("a tool call needs function.name", f"{param}[{j}]")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except json.JSONDecodeError as e:
                raise bad_request(
                    f"function.arguments is not valid JSON: {e}", f"{param}[{j}]"
                ) from None
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


# --------------------------------------------------------------------------- request decoding

_PARAM_RE = re.compile(r"at `\$\.([A-Za-z_][A-Za-z0-9_]*)")
_FIELD_RE = re.compile(r"field `([A-Za-z_][A-Za-z0-9_]*)`")

_decoders: dict[type, msgspec.json.Decoder[Any]] = {}


def decode_request(body: bytes, typ: type[T]) -> T:
    """Decodes a request body into `typ` and runs its validate() if it has one.

    Raises APIError(400) with `param` set when the offending field is known.
    """
    decoder = _decoders.get(typ)
    if decoder is None:
        decoder = _decoders[typ] = msgspec.json.Decoder(typ)
    try:
        req = decoder.decode(body)
    except msgspec.ValidationError as e:
        msg = str(e)
        m = _PARAM_RE.search(msg) or _FIELD_RE.search(msg)
        raise bad_request(msg, m.group(1) if m else None) from None
    except msgspec.DecodeError as e:
        raise bad_request(f"malformed JSON body: {e}") from None
    except UnicodeDecodeError as e:  # msgspec's error for strings that are not UTF-8
        raise bad_request(f"the request body is not valid UTF-8: {e}") from None
    validate = getattr(req, "validate", None)
    if validate is not None:
        validate()
    return req


def check_spaces_between_special_tokens(req: Any) -> None:
    """Spaces around shown special tokens are what the tokenizers backend cannot do."""
    if req.spaces_between_special_tokens is True and req.skip_special_tokens is False:
        raise bad_request(
            "spaces_between_special_tokens: true is not supported with skip_special_tokens: "
            "false (special tokens are joined to the text without spaces)",
            "spaces_between_special_tokens",
        )


def check_num_logprobs(k: int | None, param: str) -> None:
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise bad_request(f"{param} must be in [0, {MAX_LOGPROBS}], got {k}", param)


def check_unsupported(req: Any, unsupported: dict[str, tuple[Any, ...]]) -> None:
    """400 naming the first field of `unsupported` set to a value other than its "not used" ones."""
    for name, allowed in unsupported.items():
        value = getattr(req, name)
        if value is not UNSET and not _is_allowed(value, allowed):
            raise bad_request(f"'{name}' is not supported by this server", name)


# --------------------------------------------------------------------------- responses


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class UsageInfo(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ChatCompletionLogProb(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[ChatCompletionLogProb] = []


class ChatCompletionLogProbs(msgspec.Struct):
    content: list[ChatCompletionLogProbsContent] | None = None


class CompletionLogProbs(msgspec.Struct):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class PromptLogprob(msgspec.Struct):
    """vLLM's Logprob, in prompt_logprobs: [None, {token id: PromptLogprob}, ...]."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobsList = list[dict[str, PromptLogprob] | None]


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class ChatMessage(msgspec.Struct):
    role: str
    content: str | None
    # With --reasoning-parser: the model's reasoning, under the names vLLM has used for it.
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = []


class DeltaFunctionCall(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    """A streamed tool call: index, id, type and name on its first chunk, then argument pieces."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


class ChatCompletionResponseChoice(msgspec.Struct):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids
    # --enable-return-routed-experts: base64 .npy (tokens - 1, MoE layers, top_k), vLLM's field
    routed_experts: str | None = None


class ChatCompletionResponse(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    weight_version: str | None = None  # the weights that produced it (SGLang's field)
    prompt_logprobs: PromptLogprobsList | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    lora_version: str | UnsetType = UNSET  # the LoRA adapter's version, on an adapter's answers


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionResponseStreamChoice(msgspec.Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids: this chunk's tokens


class ChatCompletionStreamResponse(msgspec.Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    weight_version: str | None = None  # on a choice's last chunk
    prompt_token_ids: list[int] | None = None  # with return_token_ids, on the first chunk
    lora_version: str | UnsetType = UNSET  # on a choice's last chunk (an adapter's answers)


class CompletionResponseChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsList | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids (a stream's first chunk)
    token_ids: list[int] | None = None  # with return_token_ids
    # --enable-return-routed-experts: base64 .npy (tokens - 1, MoE layers, top_k), vLLM's field;
    # on a stream's last chunk of the choice
    routed_experts: str | None = None


class CompletionResponse(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    weight_version: str | None = None  # the weights that produced it (SGLang's field)
    lora_version: str | UnsetType = UNSET  # the LoRA adapter's version, on an adapter's answers


class CompletionStreamResponse(msgspec.Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None
    weight_version: str | None = None  # on a choice's last chunk
    lora_version: str | UnsetType = UNSET  # on a choice's last chunk (an adapter's answers)


class ModelCard(msgspec.Struct):
    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "tern"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"

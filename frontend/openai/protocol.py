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

from typing import Annotated, Any

import msgspec
from msgspec import UNSET, UnsetType

from enginecore.messages import StructuredOutputSpec
from frontend.common.decoding import (
    MediaRef,
    Unsupported,
    check_num_logprobs,
    check_spaces_between_special_tokens,
    check_unsupported,
    normalize_messages,
)
from frontend.common.errors import bad_request
from frontend.common.protocol import (
    ChatCompletionLogProbsContent,
    CompletionLogProbs,
    DeltaMessage,
    PromptLogprobsList,
    ToolCall,
    UsageInfo,
)
from frontend.openai.peer_fields import PeerFields, apply_peer_fields
from frontend.serving.sampling import RequestSampling, stop_list
from frontend.text.structured_outputs import structured_output_spec


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

    # Known but unsupported: typed loosely, rejected when set to other than the values listed.
    best_of: Annotated[Any, Unsupported(None, 1)] = UNSET
    use_beam_search: Annotated[Any, Unsupported(None, False)] = UNSET
    length_penalty: Annotated[Any, Unsupported(None, 1)] = UNSET
    early_stopping: Annotated[Any, Unsupported(None, False)] = UNSET
    bad_words: Annotated[Any, Unsupported(None, [])] = UNSET
    logits_processors: Annotated[Any, Unsupported(None)] = UNSET
    guided_whitespace_pattern: Annotated[Any, Unsupported(None)] = UNSET
    priority: Annotated[Any, Unsupported(None, 0)] = UNSET
    cache_salt: Annotated[Any, Unsupported(None)] = UNSET
    # Prefill/decode disaggregation, in each peer's form (frontend/disagg/requests.py):
    # vLLM's, SGLang's bootstrap (sglang-router sends them on OpenAI bodies too), TensorRT-LLM's.
    kv_transfer_params: dict[str, Any] | None = None
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    disaggregated_params: dict[str, Any] | None = None
    vllm_xargs: Annotated[Any, Unsupported(None)] = UNSET
    media_io_kwargs: Annotated[Any, Unsupported(None)] = UNSET
    metadata: Annotated[Any, Unsupported(None)] = UNSET
    store: Annotated[Any, Unsupported(None, False)] = UNSET
    service_tier: Annotated[Any, Unsupported(None, "auto", "default")] = UNSET
    prediction: Annotated[Any, Unsupported(None)] = UNSET

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

    def kv_fields(self) -> dict[str, Any]:
        """The disaggregation fields, as frontend.disagg.requests.kv_request takes them."""
        return {
            "kv_transfer_params": self.kv_transfer_params,
            "bootstrap": (self.bootstrap_host, self.bootstrap_port, self.bootstrap_room),
            "disaggregated_params": self.disaggregated_params,
        }

    def validate(self) -> None:
        """Raises APIError (400) for unsupported fields and out-of-range values."""
        apply_peer_fields(self)
        check_unsupported(self)
        if self.stream_options is not None and not self.stream:
            raise bad_request(
                "stream_options can only be set when stream is true", "stream_options"
            )
        self.to_sampling().verify()
        check_num_logprobs(self.prompt_logprobs, "prompt_logprobs")
        check_spaces_between_special_tokens(self)


class ChatCompletionRequest(_RequestBase, forbid_unknown_fields=True, kw_only=True):
    messages: list[dict[str, Any]] = []
    # Passed to the model's image processor with the request's images (as vLLM).
    mm_processor_kwargs: dict[str, Any] | None = None
    # The prompt as token ids: the chat template is skipped (and messages are not rendered).
    prompt_token_ids: list[int] | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    # Tool calling and reasoning (frontend/text/tool_calling.py, frontend/text/chat_output.py).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    include_reasoning: bool = True
    functions: Annotated[Any, Unsupported(None)] = UNSET
    function_call: Annotated[Any, Unsupported(None, "none")] = UNSET
    documents: Annotated[Any, Unsupported(None)] = UNSET
    chat_template: Annotated[Any, Unsupported(None)] = UNSET
    reasoning_effort: Annotated[Any, Unsupported(None)] = UNSET
    modalities: Annotated[Any, Unsupported(None, ["text"])] = UNSET
    audio: Annotated[Any, Unsupported(None)] = UNSET
    web_search_options: Annotated[Any, Unsupported(None)] = UNSET
    verbosity: Annotated[Any, Unsupported(None)] = UNSET

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

    def normalized_messages(
        self, media: list[MediaRef] | None = None, modalities: tuple[str, ...] = ("image",)
    ) -> list[dict[str, Any]]:
        """The messages as the chat template expects them: text-part lists joined into strings
        (see normalize_messages for `media`)."""
        return normalize_messages(self.messages, media, modalities)


class CompletionRequest(_RequestBase, forbid_unknown_fields=True, kw_only=True):
    prompt: str | list[Any]
    add_special_tokens: bool = True
    mm_processor_kwargs: Annotated[Any, Unsupported(None)] = UNSET  # completions carry no images
    logprobs: int | None = None  # the sampled token's, and this many most likely tokens'

    suffix: Annotated[Any, Unsupported(None, "")] = UNSET
    prompt_embeds: Annotated[Any, Unsupported(None)] = UNSET

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


def usage_options(req: ChatCompletionRequest | CompletionRequest) -> tuple[bool, bool]:
    """stream_options: (include_usage, continuous_usage_stats)."""
    opts = req.stream_options
    if opts is None:
        return False, False
    return bool(opts.include_usage), bool(opts.include_usage and opts.continuous_usage_stats)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# --------------------------------------------------------------------------- responses


class ChatCompletionLogProbs(msgspec.Struct):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | None
    # With --reasoning-parser: the model's reasoning, under the names vLLM has used for it.
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = []


class ChatCompletionResponseChoice(msgspec.Struct):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids
    # --enable-return-routed-experts: base64 .npy (tokens - 1, MoE layers, top_k), vLLM's field
    routed_experts: str | None = None
    # A TensorRT-LLM context request's answer: what the generation server needs.
    disaggregated_params: dict[str, Any] | UnsetType = UNSET


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
    # A vLLM-form KV producer's answer: what vllm-router copies into the consumer's body.
    kv_transfer_params: dict[str, Any] | UnsetType = UNSET


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
    kv_transfer_params: dict[str, Any] | UnsetType = UNSET  # a KV producer's, on the last chunk


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
    # A TensorRT-LLM context request's answer: what the generation server needs.
    disaggregated_params: dict[str, Any] | UnsetType = UNSET


class CompletionResponse(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    weight_version: str | None = None  # the weights that produced it (SGLang's field)
    lora_version: str | UnsetType = UNSET  # the LoRA adapter's version, on an adapter's answers
    kv_transfer_params: dict[str, Any] | UnsetType = UNSET  # a vLLM-form KV producer's
    # A TensorRT-LLM context request's prompt (its generation server need not tokenize).
    prompt_token_ids: list[int] | UnsetType = UNSET


class CompletionStreamResponse(msgspec.Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None
    weight_version: str | None = None  # on a choice's last chunk
    lora_version: str | UnsetType = UNSET  # on a choice's last chunk (an adapter's answers)
    kv_transfer_params: dict[str, Any] | UnsetType = UNSET  # a KV producer's, on the last chunk


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

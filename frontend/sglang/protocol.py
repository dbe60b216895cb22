"""Schemas of SGLang's native POST /generate (its GenerateReqInput and SamplingParams, and the
output dicts its TokenizerManager builds). LMDeploy's /generate shares the path: the rule that tells
their bodies apart is server/generate.py's.

Names, defaults and ranges are SGLang's (python/sglang/srt/managers/io_struct.py GenerateReqInput,
python/sglang/srt/sampling/sampling_params.py SamplingParams): unset sampling fields take SGLang's
defaults, not the model's generation_config.json (SGLang's /generate does not read it). A known
field this server cannot honour is a 400 naming it unless set to its neutral value; an unknown field
is a 400. This module knows nothing about tokenizers or the engine.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec
from msgspec import UNSET, UnsetType

from frontend.common.decoding import (
    MAX_LOGPROBS,
    MediaRef,
    Unsupported,
    check_spaces_between_special_tokens,
    check_unsupported,
    decode_request,
)
from frontend.common.errors import APIError, bad_request
from frontend.media.sources import audio_data_url, image_data_url, video_data_url
from frontend.serving.sampling import SGLANG_RULES, RequestSampling, stop_list

ANY_JSON = "$$ANY$$"  # SGLang's json_schema for "any JSON value"


class SGLangSamplingParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """SGLang's SamplingParams. It is also the SamplingRequest OpenAIServing reads (properties
    below map SGLang's names to tern's)."""

    max_new_tokens: int | None = 128  # None: as many as the context holds
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = -1  # -1: all tokens
    min_p: float | None = 0.0
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0
    min_new_tokens: int | None = 0
    n: int | None = 1
    # Output constraints, at most one (a JSON schema as text, or "$$ANY$$").
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None  # the JSON of a response_format {"type": "structural_tag"}
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    # SGLang's default is true; the tokenizers backend never adds those spaces (see openai/protocol.py).
    spaces_between_special_tokens: bool | UnsetType | None = UNSET
    no_stop_trim: bool | None = False  # keep the matched stop string (or token) in the text
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None

    stop_regex: Annotated[Any, Unsupported(None, [])] = UNSET
    custom_params: Annotated[Any, Unsupported(None)] = UNSET
    stream_interval: Annotated[Any, Unsupported(None, 1)] = UNSET  # tern streams every engine step

    def __post_init__(self) -> None:
        # As SGLang: null is the default, never "the model's default".
        defaults = {
            "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
            "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
            "min_new_tokens": 0, "n": 1, "ignore_eos": False, "skip_special_tokens": True,
            "no_stop_trim": False,
        }  # fmt: skip
        for name, value in defaults.items():
            if getattr(self, name) is None:
                setattr(self, name, value)

    def to_sampling(self) -> RequestSampling:
        return RequestSampling(
            max_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.sampling_seed,
            n=1 if self.n is None else self.n,
            stop=stop_list(self.stop),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=bool(self.ignore_eos),
            skip_special_tokens=self.skip_special_tokens is not False,
            include_stop_str_in_output=bool(self.no_stop_trim),
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self.logit_bias,
            min_tokens=self.min_new_tokens,
            rules=SGLANG_RULES,
        )

    @property
    def constraints(self) -> dict[str, str]:
        """The output constraints set: name -> value."""
        names = ("json_schema", "regex", "ebnf", "structural_tag")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}

    def validate(self) -> None:
        """SGLang's SamplingParams.verify, with tern's limits; params are named
        sampling_params.<field>."""
        try:
            check_unsupported(self)
            check_spaces_between_special_tokens(self)
            names = list(self.constraints)
            if len(names) > 1:
                raise bad_request(
                    f"set at most one of json_schema, regex, ebnf, structural_tag; got "
                    f"{', '.join(names)}",
                    names[1],
                )
        except APIError as e:
            if e.param is not None:
                e.message = e.message.replace(f"'{e.param}'", f"'sampling_params.{e.param}'")
                e.param = f"sampling_params.{e.param}"
            raise
        self.to_sampling().verify()


class SGLangGenerateRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """SGLang's GenerateReqInput: one prompt or a batch, as text or token ids."""

    text: str | list[str] | None = None
    input_ids: list[Any] | None = None  # token ids, or a batch of token-id lists
    sampling_params: SGLangSamplingParams | list[SGLangSamplingParams] | None = None
    rid: str | list[str] | None = None
    # sglang-router sends `model: null`; a name must be the served model's (adapters: lora_path).
    model: str | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None  # -1 (default): output logprobs only
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = False
    stream: bool | None = False
    # Routing replay (--enable-return-routed-experts): meta_info.routed_experts from this position.
    return_routed_experts: bool | None = False
    routed_experts_start_len: int | None = 0
    # Tracking and logging hints with no effect on the output (tern logs no request content).
    conversation_id: str | None = None
    no_logs: bool | None = False

    # Images: one for a single prompt, a list (a single prompt's images, or one per prompt of a
    # batch), or a list of lists (each prompt's images); see image_refs. Videos alike (the Qwen
    # VL models'): video_refs.
    image_data: Any = UNSET
    video_data: Any = UNSET
    # Audio (an audio-language model's): one or a list of the (one) text prompt's audios.
    audio_data: Any = UNSET

    # Fields tern cannot honour: other multimodal inputs, LoRA ids (lora_path, an adapter's name, is
    # honoured), sessions, disaggregation and routing, hidden states, extra outputs...
    input_embeds: Annotated[Any, Unsupported(None)] = UNSET
    mm_hashes: Annotated[Any, Unsupported(None)] = UNSET
    mm_content_hashes: Annotated[Any, Unsupported(None)] = UNSET
    use_audio_in_video: Annotated[Any, Unsupported(False)] = UNSET
    video_config: Annotated[Any, Unsupported(None)] = UNSET
    token_ids_logprob: Annotated[Any, Unsupported(None, [])] = UNSET
    return_sampling_mask: Annotated[Any, Unsupported(None, False)] = UNSET
    return_flat_raw_top_logprobs: Annotated[Any, Unsupported(False)] = UNSET
    return_flat_raw_top_logprobs_b64: Annotated[Any, Unsupported(False)] = UNSET
    log_metrics: Annotated[Any, Unsupported(True)] = UNSET  # tern records every request's metrics
    return_hidden_states: Annotated[Any, Unsupported(False)] = UNSET
    return_indexer_topk: Annotated[Any, Unsupported(False)] = UNSET
    modalities: Annotated[Any, Unsupported(None, [])] = UNSET
    session_id: Annotated[Any, Unsupported(None)] = UNSET
    session_params: Annotated[Any, Unsupported(None)] = UNSET
    lora_path: Any = UNSET
    lora_id: Annotated[Any, Unsupported(None)] = UNSET
    custom_logit_processor: Annotated[Any, Unsupported(None)] = UNSET
    positional_embed_overrides: Annotated[Any, Unsupported(None)] = UNSET
    # Prefill/decode disaggregation (sglang-router's one-shot dispatch): frontend/disagg/.
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    bootstrap_pair_key: Annotated[Any, Unsupported(None)] = UNSET
    # vllm-router's PD mode (--vllm-pd-disaggregation) on /generate: vLLM's transfer fields
    # beside SGLang's body; for the producer's stage it also sets max_tokens and min_tokens (1),
    # which then stand for sampling_params' max_new_tokens and min_new_tokens.
    kv_transfer_params: dict[str, Any] | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    decode_tp_size: Annotated[Any, Unsupported(None)] = UNSET
    routed_dp_rank: Annotated[Any, Unsupported(None, 0)] = (
        UNSET  # one data-parallel rank: rank 0 is this server
    )
    data_parallel_rank: Annotated[Any, Unsupported(None, 0)] = UNSET
    disagg_prefill_dp_rank: Annotated[Any, Unsupported(None)] = UNSET
    kv_router_hint: Annotated[Any, Unsupported(None)] = UNSET
    routing_key: Annotated[Any, Unsupported(None)] = UNSET
    http_worker_ipc: Annotated[Any, Unsupported(None)] = UNSET
    background: Annotated[Any, Unsupported(False)] = UNSET
    require_reasoning: Annotated[Any, Unsupported(False)] = UNSET
    max_thinking_tokens: Annotated[Any, Unsupported(None)] = UNSET
    priority: Annotated[Any, Unsupported(None, 0)] = UNSET
    extra_key: Annotated[Any, Unsupported(None, "")] = UNSET
    custom_labels: Annotated[Any, Unsupported(None)] = UNSET
    return_bytes: Annotated[Any, Unsupported(False)] = UNSET
    return_entropy: Annotated[Any, Unsupported(False)] = UNSET
    return_prompt_token_ids: Annotated[Any, Unsupported(False)] = UNSET
    external_trace_header: Annotated[Any, Unsupported(None)] = UNSET
    received_time: Annotated[Any, Unsupported(None)] = UNSET
    need_wait_for_mm_inputs: Annotated[Any, Unsupported(None)] = UNSET
    num_items_assigned: Annotated[Any, Unsupported(None)] = UNSET
    encoder_urls: Annotated[Any, Unsupported(None)] = UNSET
    max_dynamic_patch: Annotated[Any, Unsupported(None)] = UNSET
    min_dynamic_patch: Annotated[Any, Unsupported(None)] = UNSET
    image_max_dynamic_patch: Annotated[Any, Unsupported(None)] = UNSET
    video_max_dynamic_patch: Annotated[Any, Unsupported(None)] = UNSET
    images_config: Annotated[Any, Unsupported(None)] = UNSET
    multi_item_delimiter_indices: Annotated[Any, Unsupported(None)] = UNSET
    cache_salt: Annotated[Any, Unsupported(None, "")] = UNSET

    @property
    def is_batch(self) -> bool:
        """A list of prompts (SGLang answers a list, even for one)."""
        if self.text is not None:
            return not isinstance(self.text, str)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    @property
    def prompt_param(self) -> str:
        return "text" if self.text is not None else "input_ids"

    @property
    def num_logprobs(self) -> int | None:
        """How many most likely tokens each position's logprobs show; None: no logprobs."""
        return (self.top_logprobs_num or 0) if self.return_logprob else None

    def prompts(self) -> list[str | list[int]]:
        """The prompts, in order: strings or token-id lists (checked by validate)."""
        if self.text is not None:
            return [self.text] if isinstance(self.text, str) else list(self.text)
        assert self.input_ids is not None
        return [list(p) for p in self.input_ids] if self.is_batch else [list(self.input_ids)]

    def image_refs(self) -> list[list[MediaRef]]:
        """Each prompt's images, as SGLang's GenerateReqInput._normalize_image_data reads
        image_data (io_struct.py): null or [] is none; a string is one image (for every prompt of
        a batch); a single prompt's list is its images; a batch's list has one entry per prompt:
        a list of images, one image, or null."""
        return self._media_refs(self.image_data, "image_data", "image")

    def video_refs(self) -> list[list[MediaRef]]:
        """Each prompt's videos, read as image_data is (SGLang's _normalize_video_data)."""
        return self._media_refs(self.video_data, "video_data", "video")

    def _media_refs(self, data: Any, field: str, modality: str) -> list[list[MediaRef]]:
        num_prompts = len(self.prompts())
        if data is UNSET or data is None or data == []:
            return [[] for _ in range(num_prompts)]
        if not isinstance(data, list):
            return [[_ref(data, field, modality)]] * num_prompts
        if not self.is_batch:
            if len(data) == 1 and isinstance(data[0], list):  # [[...]]: a batch of one
                return [_refs(data[0], f"{field}[0]", modality)]
            return [_refs(data, field, modality)]
        if len(data) != num_prompts:
            raise bad_request(
                f"{field} has {len(data)} entries for {num_prompts} prompts (give one per "
                f"prompt, a list of {modality}s or null)",
                field,
            )
        refs = []
        for i, entry in enumerate(data):
            param = f"{field}[{i}]"
            if entry is None:
                refs.append([])
            elif isinstance(entry, list):
                refs.append(_refs(entry, param, modality))
            else:
                refs.append([_ref(entry, param, modality)])
        return refs

    def audio_refs(self) -> list[MediaRef]:
        """The prompt's audios: a string is one, a list is several (null or [] none); they go
        with one text prompt, whose text holds the model's audio marker once per audio."""
        data = self.audio_data
        if data is UNSET or data is None or data == []:
            return []
        if self.is_batch or not isinstance(self.text, str):
            raise bad_request("audio_data goes with one text prompt", "audio_data")
        items = data if isinstance(data, list) else [data]
        params = [f"audio_data[{j}]" if isinstance(data, list) else "audio_data"
                  for j in range(len(items))]  # fmt: skip
        return [MediaRef(audio_data_url(x, p), p, "audio") for x, p in zip(items, params)]

    def sampling_params_list(self) -> list[SGLangSamplingParams]:
        """One per prompt (with vllm-router's producer-stage lengths, when it set them)."""
        sp = self.sampling_params
        params = (
            sp if isinstance(sp, list) else [sp or SGLangSamplingParams()] * len(self.prompts())
        )
        if self.max_tokens is None and self.min_tokens is None:
            return params
        return [
            msgspec.structs.replace(
                p,
                max_new_tokens=p.max_new_tokens if self.max_tokens is None else self.max_tokens,
                min_new_tokens=p.min_new_tokens if self.min_tokens is None else self.min_tokens,
            )
            for p in params
        ]

    @property
    def n(self) -> int:
        return self.sampling_params_list()[0].n or 1

    def validate(self) -> None:
        check_unsupported(self)
        self._check_prompts()
        producing = bool((self.kv_transfer_params or {}).get("do_remote_decode"))
        for name in ("max_tokens", "min_tokens"):
            if getattr(self, name) is not None and not producing:
                raise bad_request(
                    f"{name} is vllm-router's field for a producer's stage (with "
                    "kv_transfer_params.do_remote_decode); SGLang's lengths are in "
                    "sampling_params (max_new_tokens, min_new_tokens)",
                    name,
                )
        num_prompts = len(self.prompts())
        sp = self.sampling_params
        if isinstance(sp, list):
            if len(sp) != num_prompts:
                raise bad_request(
                    f"sampling_params has {len(sp)} items for {num_prompts} prompts",
                    "sampling_params",
                )
            if len({p.n for p in sp}) > 1:
                raise bad_request("every item of sampling_params must have the same n", "n")
        for params in self.sampling_params_list():
            params.validate()
        if isinstance(self.rid, list):
            if len(self.rid) != num_prompts:
                raise bad_request(f"rid has {len(self.rid)} ids for {num_prompts} prompts", "rid")
            if len(set(self.rid)) != len(self.rid):
                raise bad_request("the request ids in rid must be unique", "rid")
        if (self.routed_experts_start_len or 0) < 0:
            raise bad_request(
                "routed_experts_start_len must be a token position (>= 0), got "
                f"{self.routed_experts_start_len}",
                "routed_experts_start_len",
            )
        if self.return_logprob:
            k, start = self.top_logprobs_num, self.logprob_start_len
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise bad_request(
                    f"top_logprobs_num must be in [0, {MAX_LOGPROBS}], got {k}", "top_logprobs_num"
                )
            if start is not None and start < -1:
                raise bad_request(
                    f"logprob_start_len must be -1 or a prompt position, got {start}",
                    "logprob_start_len",
                )

    def _check_prompts(self) -> None:
        if (self.text is None) == (self.input_ids is None):
            raise bad_request("give exactly one of text and input_ids", "text")
        if isinstance(self.text, list) and not self.text:
            raise bad_request("text must not be an empty list", "text")
        ids = self.input_ids
        if ids is None:
            return
        if not ids:
            raise bad_request("input_ids cannot be empty", "input_ids")
        if all(_is_int(t) for t in ids):
            return
        if all(isinstance(p, list) for p in ids):
            for i, p in enumerate(ids):
                if not p or not all(_is_int(t) for t in p):
                    raise bad_request(
                        f"input_ids[{i}] must be a non-empty list of token ids", "input_ids"
                    )
            return
        raise bad_request(
            "input_ids must be a list of token ids or a list of such lists", "input_ids"
        )


def _refs(items: list[Any], param: str, modality: str) -> list[MediaRef]:
    """One prompt's images (videos); null entries are none (SGLang's [None])."""
    return [
        _ref(item, f"{param}[{j}]", modality) for j, item in enumerate(items) if item is not None
    ]


def _ref(item: Any, param: str, modality: str) -> MediaRef:
    url_of = video_data_url if modality == "video" else image_data_url
    return MediaRef(url_of(item, param), param, modality)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# --------------------------------------------------------------------------- responses

# A logprob entry: [logprob (null for a prompt's first token), token id, token text or null].
LogprobEntry = tuple[float | None, int, str | None]


class SGLangMetaInfo(msgspec.Struct):
    """The meta_info of SGLang's TokenizerManager (the keys it always sends, and those of
    return_logprob / top_logprobs_num)."""

    id: str
    finish_reason: dict[str, Any] | None  # {"type": "stop" | "length" | "abort", ...} once finished
    prompt_tokens: int
    weight_version: str | None
    completion_tokens: int
    cached_tokens: int
    input_token_logprobs: list[LogprobEntry] | UnsetType = UNSET
    output_token_logprobs: list[LogprobEntry] | UnsetType = UNSET
    output_token_logprobs_length: int | UnsetType = UNSET
    lora_version: str | UnsetType = UNSET  # the LoRA adapter's version, on an adapter's answers
    input_top_logprobs: list[list[LogprobEntry] | None] | UnsetType = UNSET
    output_top_logprobs: list[list[LogprobEntry] | None] | UnsetType = UNSET
    e2e_latency: float | UnsetType = UNSET  # seconds, once finished
    routed_experts: str | None | UnsetType = UNSET  # with return_routed_experts, once finished


class SGLangGenerateOutput(msgspec.Struct):
    text: str
    output_ids: list[int]
    meta_info: SGLangMetaInfo
    index: int | UnsetType = UNSET  # streamed batches: which output this event is of
    # A producer's answer to vllm-router's PD stage: what the router copies to the consumer.
    kv_transfer_params: dict[str, Any] | UnsetType = UNSET


_MSGSPEC_PATH = re.compile(r"at `\$\.([\w.\[\]]+)`")
_UNKNOWN_FIELD = re.compile(r"unknown field `(\w+)`")


def decode_sglang_generate(body: bytes) -> SGLangGenerateRequest:
    """Decodes and checks a body server/generate.py told SGLang's. Raises APIError (400) naming the
    field, nested ones as sampling_params.<field>."""
    try:
        return decode_request(body, SGLangGenerateRequest)
    except APIError as e:
        path = _MSGSPEC_PATH.search(e.message)
        unknown = _UNKNOWN_FIELD.search(e.message)
        if unknown is not None:
            e.param = f"{path.group(1)}.{unknown.group(1)}" if path else unknown.group(1)
        elif path is not None:
            e.param = path.group(1)
        raise

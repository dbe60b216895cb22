"""Schemas of LMDeploy's own routes: /generate and /abort_request.

Field names and defaults are theirs, so that their clients work unchanged. As elsewhere, a known
field this server does not implement is a 400 naming it when set to anything but its neutral value.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import UNSET, UnsetType

from frontend.common.decoding import (
    MediaRef,
    Unsupported,
    check_spaces_between_special_tokens,
    check_unsupported,
)
from frontend.common.errors import bad_request
from frontend.media.sources import image_data_url
from frontend.serving.sampling import LMDEPLOY_RULES, RequestSampling, stop_list


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """LMDeploy's GenerateReqInput: exactly one of `prompt` (text, tokenized as is: no chat
    template) and `input_ids`."""

    session_id: int | None = -1  # -1: the server picks one
    prompt: str | None = None
    input_ids: list[int] | None = None
    max_tokens: int = 128
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool | None = False
    temperature: float = 1.0
    ignore_eos: bool | None = False
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    repetition_penalty: float | None = 1.0
    # The tokenizers backend never puts spaces around special tokens (see openai/protocol.py).
    spaces_between_special_tokens: bool | UnsetType | None = UNSET
    return_logprob: bool | None = None  # meta_info.output_token_logprobs: [logprob, token id]
    # LMDeploy's chat route has it: json_schema, regex_schema or json_object (text/structured_outputs.py).
    response_format: dict[str, Any] | None = None
    adapter_name: str | None = None  # the LoRA adapter to run on (None: the base model)

    # One image or a list of the prompt's images (LMDeploy's ImageDataFormat; items are strings
    # here: a URL, a file path or base64, see image_refs).
    image_data: Any = UNSET
    top_logprobs_num: Annotated[Any, Unsupported(None, 0)] = UNSET
    logprob_start_len: Annotated[Any, Unsupported(None, -1)] = UNSET
    return_routed_experts: Annotated[Any, Unsupported(None, False)] = UNSET
    mm_processor_kwargs: Annotated[Any, Unsupported(None, {})] = UNSET
    media_io_kwargs: Annotated[Any, Unsupported(None, {})] = UNSET

    def to_sampling(self) -> RequestSampling:
        # LMDeploy's /generate has no seed: every request gets a random one.
        return RequestSampling(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            stop=stop_list(self.stop),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=bool(self.ignore_eos),
            skip_special_tokens=self.skip_special_tokens is not False,
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            repetition_penalty=self.repetition_penalty,
            rules=LMDEPLOY_RULES,
        )

    def image_refs(self) -> list[MediaRef]:
        """The prompt's images: none for null or [], else one string or a list of them."""
        data = self.image_data
        if data is UNSET or data is None:
            return []
        if not isinstance(data, list):
            return [MediaRef(image_data_url(data, "image_data"), "image_data")]
        return [
            MediaRef(image_data_url(item, f"image_data[{i}]"), f"image_data[{i}]")
            for i, item in enumerate(data)
        ]

    def validate(self) -> None:
        check_unsupported(self)
        if (self.prompt is None) == (self.input_ids is None):
            raise bad_request("specify exactly one of prompt or input_ids", "prompt")
        if self.prompt == "":
            raise bad_request("prompt must not be empty", "prompt")
        if self.input_ids is not None and not self.input_ids:
            raise bad_request("input_ids must not be empty", "input_ids")
        self.to_sampling().verify()
        check_spaces_between_special_tokens(self)


class GenerateMetaInfo(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    finish_reason: dict[str, Any] | None  # {"type": "stop" | "length" | "abort"} once finished
    output_token_logprobs: list[list[float | int]] | None = None  # with return_logprob
    routed_experts: None = None  # no mixture-of-experts models


class GenerateResponse(msgspec.Struct):
    text: str
    output_ids: list[int]
    meta_info: GenerateMetaInfo


class AbortRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """LMDeploy's (and SGLang's) abort: one session, one request id, or everything."""

    abort_all: bool = False
    session_id: int | None = -1
    request_id: str | None = None  # a response id ("cmpl-...", "resp_...") or an X-Request-Id
    rid: str | None = None  # SGLang's name for request_id
    abort_message: str | None = None  # reported in /generate's meta_info.finish_reason
    finished_reason: dict[str, Any] | None = None  # merged into it, as SGLang does

    @property
    def target_request_id(self) -> str | None:
        return self.request_id if self.request_id is not None else self.rid

    def validate(self) -> None:
        if self.request_id is not None and self.rid is not None:
            raise bad_request("give request_id or rid, not both", "rid")
        has_session = self.session_id is not None and self.session_id != -1
        if not (self.abort_all or has_session or self.target_request_id is not None):
            raise bad_request(
                "name what to abort: session_id, request_id, or abort_all: true", "session_id"
            )

    def finish_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"type": "abort"}
        if self.abort_message is not None:
            info["message"] = self.abort_message
        info.update(self.finished_reason or {})
        return info

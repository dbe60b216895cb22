"""SGLang's POST /generate (lmdeploy/serving.py hands it the bodies sglang/protocol.py recognises
as SGLang's).

A request is one prompt or a batch (text, or token ids: tokenized with special tokens, no chat
template), each sampled n times, prompt by prompt. Models served with images take `image_data`
(SGLangGenerateRequest.image_refs reads its shapes): text holds one image marker per image, token
ids come expanded by the client's own HF processor (RL trainers'), ImagePrompts.make_for_generate.
One prompt with n = 1 answers one
{"text", "output_ids", "meta_info"}; a batch or n > 1 answers a list of them, prompt 0's samples
first. meta_info has SGLang's keys: id (the request's `rid`; `rid_i` for item i of a batch under one
rid; a random hex id per sample when n > 1, as SGLang regenerates them), finish_reason ({"type":
"stop", "matched": token id or stop string} | {"type": "length", "length": max_new_tokens} |
{"type": "abort", ...}), prompt_tokens, completion_tokens, cached_tokens, weight_version (of the
weights that finished the output: null in a stream's earlier events, where SGLang already shows the
server's version), e2e_latency once finished; with return_logprob the [logprob, token id, text or
null] entries of the output tokens (and their count) and of the prompt from logprob_start_len (the
first shown prompt token's logprob is null, as SGLang's); with top_logprobs_num the most likely
tokens of each position.

Streaming follows SGLang's default (its --incremental-streaming-output is off): every event carries
the whole text so far, all output_ids so far and meta_info with all logprobs so far, so the last
event is the non-streamed output; a batch or n > 1 streams each output's events interleaved, tagged
with "index"; then `data: [DONE]`. Source read: SGLang's
python/sglang/srt/managers/tokenizer_manager_components/output_processor.py
(OutputProcessor.handle_batch_output: `incremental = incremental_streaming_output and is_stream`,
else "text": state.get_text(), "output_ids": state.output_ids) and response_emitter.py
(_handle_batch_request adds "index").

max_new_tokens is clamped to what the context leaves (SGLang does the same); 0 runs the prompt only
(for its logprobs). Seeds: sample i of a prompt uses sampling_seed + i, as the OpenAI routes do. The
request can be aborted (POST /abort_request) by its rid, an item's id or its X-Request-Id: the
outputs then end with finish_reason type "abort" and what they had so far.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType
from starlette.requests import Request
from starlette.responses import Response

from enginecore.messages import Logprobs, MultiModalItem, StructuredOutputSpec
from frontend.common.decoding import MediaRef
from frontend.common.errors import bad_request
from frontend.common.http import REQUEST_ID_HEADER, json_response, sse
from frontend.disagg.requests import KVRequest, check_single, kv_request
from frontend.serving.base import OpenAIServing
from frontend.serving.generation import Generation, RequestGroup
from frontend.serving.kv_answers import kv_answer, kv_sampling, refusal_fails_room
from frontend.serving.routed_experts import sglang_routed_experts
from frontend.sglang.protocol import (
    ANY_JSON,
    LogprobEntry,
    SGLangGenerateOutput,
    SGLangGenerateRequest,
    SGLangMetaInfo,
    SGLangSamplingParams,
    decode_sglang_generate,
)
from frontend.text.logprobs import TokenStrings
from frontend.text.structured_outputs import from_response_format, json_schema_spec

_MIN_LOGPROB = -9999.0  # JSON has no -inf (as frontend/text/logprobs.py)


@dataclasses.dataclass(frozen=True)
class _Item:
    """What one output shows beyond its Generation."""

    id: str
    max_new_tokens: int  # the limit after clamping: finish_reason "length" reports it
    logprob_start: int  # the first prompt position input_token_logprobs shows


@dataclasses.dataclass(frozen=True)
class _Prompt:
    ids: list[int]
    params: SGLangSamplingParams  # max_new_tokens clamped to the context (>= 1)
    is_prefill_only: bool  # max_new_tokens 0: nothing is generated
    structured_output: StructuredOutputSpec | None
    mm_items: list[MultiModalItem]  # the prompt's images or audios


class SGLangServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def generate(self, http_request: Request, body: bytes) -> Response:
        s = self.serving
        arrival = time.monotonic()
        req = decode_sglang_generate(body)
        with refusal_fails_room(s, req.bootstrap_room):
            return await self._generate(http_request, req, arrival)

    async def _generate(
        self, http_request: Request, req: SGLangGenerateRequest, arrival: float
    ) -> Response:
        s = self.serving
        if req.model is not None and req.model not in s.model_names:
            raise bad_request(
                f"model {req.model!r} is not served here ({', '.join(s.model_names)}); "
                "LoRA adapters are named by lora_path",
                "model",
            )
        if req.return_routed_experts and not s.records_routing:
            raise bad_request(
                "return_routed_experts needs the server started with "
                "--enable-return-routed-experts",
                "return_routed_experts",
            )
        refs = req.image_refs()
        if any(refs) and s.images is None:
            raise bad_request("this model is served without image inputs", "image_data")
        videos = req.video_refs()
        if any(videos) and (s.images is None or not s.images.takes_video):
            raise bad_request("this model is served without video inputs", "video_data")
        refs = [images + prompt_videos for images, prompt_videos in zip(refs, videos)]
        audio = req.audio_refs()
        if audio and s.audio is None:
            raise bad_request("this model is served without audio inputs", "audio_data")
        prompts = [
            await self._prompt(req, p, params, prompt_refs, audio)
            for p, params, prompt_refs in zip(req.prompts(), req.sampling_params_list(), refs)
        ]
        items = _items(req, prompts, s.max_model_len)
        keys = self._keys(req, items)
        client_id = http_request.headers.get(REQUEST_ID_HEADER)
        if client_id and client_id not in keys:
            keys.append(client_id)
        headers = {REQUEST_ID_HEADER: client_id or keys[0]}
        kv = kv_request(
            s.kv, kv_transfer_params=req.kv_transfer_params,
            bootstrap=(req.bootstrap_host, req.bootstrap_port, req.bootstrap_room),
        )  # fmt: skip
        group = self._start(req, prompts, items, keys, kv)
        view = _OutputView(req, TokenStrings(s.tokenizer.backend), arrival)
        is_list = req.is_batch or req.n > 1
        if req.stream:
            return s.sse_response(self._stream(group, view, items, is_list), group, headers)
        texts = await group.collect_unless_disconnected(http_request)
        if texts is None:
            return Response(status_code=499)
        outputs = [view.output(g, item, t) for g, item, t in zip(group.gens, items, texts)]
        if kv is not None:  # one prompt: what vllm-router copies to the consumer, if it asked
            outputs[0].kv_transfer_params = kv_answer(
                s.kv, kv, group.gens[0], None
            ).kv_transfer_params
        return json_response(outputs if is_list else outputs[0], headers=headers)

    async def _prompt(
        self,
        req: SGLangGenerateRequest,
        prompt: str | list[int],
        params: SGLangSamplingParams,
        refs: list[MediaRef],
        audio: list[MediaRef] | None = None,
    ) -> _Prompt:
        s = self.serving
        ids = s.encode_prompt(prompt, True, req.prompt_param)
        mm_items: list[MultiModalItem] = []
        if audio:
            assert s.audio is not None and isinstance(prompt, str)  # checked by generate
            ids, mm_items = await s.audio.make(prompt, list(audio), "audio_data")
        elif refs:
            assert s.images is not None  # checked by generate
            ids, mm_items = await s.images.make_for_generate(prompt, refs, "image_data")
        limit = params.max_new_tokens
        room = s.max_model_len - len(ids)
        if limit is not None and room >= 1:  # else sampling_params names the prompt's length
            limit = max(min(limit, room), 1)
        bounded = msgspec.structs.replace(params, max_new_tokens=limit)
        s.sampling_params(
            bounded.to_sampling(), ids, req.prompt_param
        )  # its 400s, before anything starts
        return _Prompt(ids, bounded, params.max_new_tokens == 0, _constraint(params), mm_items)

    def _keys(self, req: SGLangGenerateRequest, items: list[_Item]) -> list[str]:
        """Every id /abort_request finds the request by; a client's rid must not be in flight."""
        keys = [req.rid] if isinstance(req.rid, str) and req.rid else []
        keys += [item.id for item in items if item.id not in keys]
        if req.rid:
            taken = [k for k in keys if self.serving.inflight.find(k)]
            if taken:
                raise bad_request(f"Duplicate request ID detected: {taken[0]}", "rid")
        return keys

    def _start(
        self,
        req: SGLangGenerateRequest,
        prompts: list[_Prompt],
        items: list[_Item],
        keys: list[str],
        kv: KVRequest | None = None,
    ) -> RequestGroup:
        """Starts every prompt's n samples as one RequestGroup (one start per prompt: each has its
        own sampling parameters and its own clamped max_new_tokens). `kv`: the (one) prompt's KV
        transfer (bootstrap fields)."""
        s = self.serving
        n, k = req.n, req.num_logprobs
        check_single(kv, len(prompts) * n, req.prompt_param)
        loras = self._loras(req, len(prompts))
        groups: list[RequestGroup] = []
        try:
            for i, p in enumerate(prompts):
                first = items[i * n]
                wants_prompt = k is not None and first.logprob_start < len(p.ids) - 1
                groups.append(
                    s.start(
                        first.id, keys, kv_sampling(p.params.to_sampling(), kv, req.stream),
                        [p.ids], req.prompt_param, n=n, logprobs=k,
                        prompt_logprobs=k if wants_prompt else None,
                        discard_output=p.is_prefill_only, structured_output=p.structured_output,
                        lora=loras[i], mm_items=p.mm_items, kv=kv,
                    )
                )  # fmt: skip
        except BaseException:
            for group in groups:
                group.close()
            raise
        for group in groups:
            s.inflight.remove(group)
        return RequestGroup(keys, [gen for g in groups for gen in g.gens], s.inflight, None, n)

    def _loras(self, req: SGLangGenerateRequest, num_prompts: int) -> list[str | None]:
        """lora_path: one adapter name for every prompt, or one per prompt (None: the base)."""
        paths = req.lora_path
        if paths is UNSET or paths is None or isinstance(paths, str):
            paths = [None if paths is UNSET else paths] * num_prompts
        if not isinstance(paths, list) or len(paths) != num_prompts:
            raise bad_request(
                f"lora_path must be an adapter name or a list of {num_prompts} (one per prompt)",
                "lora_path",
            )
        if not all(p is None or isinstance(p, str) for p in paths):
            raise bad_request("lora_path entries must be adapter names or null", "lora_path")
        return [self.serving.check_adapter(p, "lora_path") for p in paths]

    async def _stream(
        self, group: RequestGroup, view: _OutputView, items: list[_Item], is_list: bool
    ) -> AsyncIterator[bytes]:
        texts = [""] * len(group.gens)
        async for i, text in group.merged():
            gen = group.gens[i]
            texts[i] += text
            if text or gen.new_token_ids or gen.is_finished:
                yield sse(view.output(gen, items[i], texts[i], i if is_list else UNSET))


def _items(req: SGLangGenerateRequest, prompts: list[_Prompt], max_model_len: int) -> list[_Item]:
    """One per output: n per prompt, prompt by prompt."""
    n, rid = req.n, req.rid
    if n > 1:
        ids = [uuid.uuid4().hex for _ in range(len(prompts) * n)]
    elif isinstance(rid, list):
        ids = [r or uuid.uuid4().hex for r in rid]
    elif not req.is_batch:
        ids = [rid or uuid.uuid4().hex]
    else:
        ids = [f"{rid}_{i}" if rid else uuid.uuid4().hex for i in range(len(prompts))]
    items = []
    for i, p in enumerate(prompts):
        start = _logprob_start(req, len(p.ids))
        limit = 0 if p.is_prefill_only else p.params.max_new_tokens
        if limit is None:
            limit = max_model_len - len(p.ids)
        items += [_Item(ids[i * n + j], limit, start) for j in range(n)]
    return items


def _logprob_start(req: SGLangGenerateRequest, num_prompt: int) -> int:
    start = req.logprob_start_len
    if not req.return_logprob or start is None or start == -1:
        return num_prompt - 1  # SGLang's default: the last prompt token only
    if start >= num_prompt:
        raise bad_request(
            f"logprob_start_len ({start}) is higher than the number of input tokens "
            f"({num_prompt}). Request with a lower logprob_start_len.",
            "logprob_start_len",
        )
    return start


def _constraint(params: SGLangSamplingParams) -> StructuredOutputSpec | None:
    """The output constraint of SGLang's json_schema / regex / ebnf / structural_tag (checked)."""
    for name, value in params.constraints.items():
        param = f"sampling_params.{name}"
        if name == "json_schema":
            if value == ANY_JSON:
                return from_response_format({"type": "json_object"}, param)
            return json_schema_spec(_json(value, param), param)
        if name == "structural_tag":
            tag = _json(value, param)
            if not isinstance(tag, dict) or tag.get("type") != "structural_tag":
                raise bad_request(f'{param} must be a {{"type": "structural_tag", ...}}', param)
            return from_response_format(tag, param)
        kind = {"regex": "regex", "ebnf": "ebnf"}[name]
        return from_response_format({"type": kind, kind: value}, "sampling_params")
    return None


def _json(text: str, param: str) -> Any:
    try:
        return msgspec.json.decode(text)
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"{param} is not valid JSON: {e}", param) from None


class _OutputView:
    """One generation as SGLang's output dict (its state so far, while streaming)."""

    def __init__(self, req: SGLangGenerateRequest, strings: TokenStrings, arrival: float) -> None:
        self.num_logprobs = req.num_logprobs
        self.with_text = bool(req.return_text_in_logprobs)
        self.routed_start = req.routed_experts_start_len or 0 if req.return_routed_experts else None
        self.strings = strings
        self.arrival = arrival

    def output(
        self, gen: Generation, item: _Item, text: str, index: int | UnsetType = UNSET
    ) -> SGLangGenerateOutput:
        meta = SGLangMetaInfo(
            item.id, _finish_reason(gen, item), gen.num_prompt_tokens, gen.weight_version,
            gen.num_output_tokens, gen.num_cached_tokens,
        )  # fmt: skip
        if gen.lora_version is not None:
            meta.lora_version = gen.lora_version
        if self.num_logprobs is not None:
            self._add_logprobs(meta, gen, item)
        if gen.is_finished:
            meta.e2e_latency = time.monotonic() - self.arrival
            rows = gen.routed_experts()
            if self.routed_start is not None and rows is not None:
                meta.routed_experts = sglang_routed_experts(rows, self.routed_start)
        return SGLangGenerateOutput(text, list(gen.output_token_ids), meta, index)

    def _add_logprobs(self, meta: SGLangMetaInfo, gen: Generation, item: _Item) -> None:
        out = gen.all_output_logprobs or Logprobs()
        meta.output_token_logprobs = [
            self._entry(v, t) for v, t in zip(out.logprobs, out.token_ids)
        ]
        meta.output_token_logprobs_length = out.num_positions
        prompt, start = gen.prompt_token_ids, item.logprob_start
        # Prompt logprobs hold tokens 1..n-1 (token j's at j - 1), once the prompt has run.
        lp = gen.prompt_logprobs or Logprobs()
        shown = range(start + 1, len(prompt) if lp.num_positions else 0)
        first = (None, prompt[start], self._text(prompt[start]))
        meta.input_token_logprobs = [first] + [
            self._entry(lp.logprobs[j - 1], prompt[j]) for j in shown
        ]
        if self.num_logprobs:
            meta.output_top_logprobs = [self._top(out, i) for i in range(out.num_positions)]
            meta.input_top_logprobs = [None] + [self._top(lp, j - 1) for j in shown]

    def _top(self, lp: Logprobs, i: int) -> list[LogprobEntry]:
        return [self._entry(v, t) for t, v in lp.top(i)[: self.num_logprobs]]

    def _entry(self, logprob: float, token_id: int) -> LogprobEntry:
        return (max(logprob, _MIN_LOGPROB), token_id, self._text(token_id))

    def _text(self, token_id: int) -> str | None:
        return self.strings.text(token_id) if self.with_text else None


def _finish_reason(gen: Generation, item: _Item) -> dict[str, Any] | None:
    if not gen.is_finished:
        return None
    if gen.finish_reason == "stop":
        # A stop string, a stop token id, or else the token that ended it (EOS): SGLang's matched.
        matched = gen.stop_reason
        if matched is None and gen.output_token_ids:
            matched = gen.output_token_ids[-1]
        return {"type": "stop", "matched": matched}
    if gen.finish_reason == "length":
        return {"type": "length", "length": item.max_new_tokens}
    if gen.finish_reason == "abort" and gen.abort_info is not None:
        return dict(gen.abort_info)
    return {"type": gen.finish_reason}

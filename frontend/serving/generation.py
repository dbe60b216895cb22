"""Requests in flight: one `Generation` per engine request, grouped per HTTP request.

A Generation turns the engine's token ids into released text (detokenizer, stop strings), knows when
and why its request finished, keeps the logprobs the request asked for, and reports its timings and
token counts to the metrics. A `RequestGroup` holds the generations of one HTTP request (several
for batched prompts or n > 1): it merges their outputs, collects them, and when the HTTP request
ends for any reason (answered, client gone, error) aborts whatever still runs in the engine core. `InflightRequests` finds groups by request id
for POST /abort_request. This module knows nothing about the shape of any API's responses.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from msgspec import UNSET, UnsetType
from starlette.requests import Request

from enginecore.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    KVTransfer,
    Logprobs,
    MultiModalItem,
    SamplingParams,
    StructuredOutputSpec,
)
from frontend.common.errors import APIError, engine_dead_error
from frontend.common.protocol import PromptTokensDetails, UsageInfo
from frontend.engine.client import EngineClient, EngineDeadError
from frontend.serving.routed_experts import RoutingRows
from frontend.text.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from frontend.common.metrics import Metrics
    from frontend.disagg.bootstrap import LeaseRegistry


class RequestFailedError(RuntimeError):
    """The engine ended one request with an error while staying up."""


class Generation:
    """One engine request: engine outputs in, released text out, and why it finished."""

    def __init__(
        self,
        engine: EngineClient,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        detokenizer: IncrementalDetokenizer,
        metrics: Metrics | None = None,
        discard_output: bool = False,
        structured_output: StructuredOutputSpec | None = None,
        lora_name: str | None = None,
        mm_items: list[MultiModalItem] | None = None,
        kv_transfer: KVTransfer | None = None,
        leases: LeaseRegistry | None = None,
    ) -> None:
        """`lora_name`: the LoRA adapter it runs on (None: the base model). `mm_items`: its
        prompt's images. `kv_transfer`: its part in prefill/decode disaggregation; a producing
        request's lease (lent or failed) goes into `leases` when it ends (frontend/disagg/).
        `discard_output`: the output is not wanted (completions' echo with max_tokens 0): the
        request runs only for its prompt logprobs, and finishes with "length" and no tokens."""
        self.engine = engine
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self.discard_output = discard_output
        self.params = params
        self.user_stop_token_ids = set(params.stop_token_ids)
        self.detokenizer = detokenizer
        self.metrics = metrics
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.weight_version: str | None = None  # of the weights that computed the last tokens
        self.lora_name = lora_name
        self.lora_version: str | None = None  # of the adapter, once finished
        self.output_token_ids: list[int] = []  # the tokens counted in usage, stop token included
        # Logprobs, when the request asked: of output_token_ids, and of prompt tokens 1..n-1.
        self.output_logprobs: list[Logprobs] = []
        self.prompt_logprobs: Logprobs | None = None
        # What the last next_text() consumed: its tokens and their logprobs.
        self.new_token_ids: list[int] = []
        self.new_logprobs: Logprobs | None = None
        # --enable-return-routed-experts: the routing rows the outputs carried.
        self.routing = RoutingRows()
        # SamplingParams.cross_attention: the rows of the output positions read so far.
        self.cross_attention = bytearray()
        # Set by POST /abort_request: LMDeploy's meta_info.finish_reason for this request.
        self.abort_info: dict[str, Any] | None = None
        self._arrival = time.monotonic()
        self._first_token_time: float | None = None
        self._is_recorded = False
        self.kv_transfer = kv_transfer
        self.leases = leases if kv_transfer is not None and kv_transfer.role == "produce" else None
        self.kv_lease_block_ids: list[int] | None = None  # a producer's, once it lent them
        self._is_lease_recorded = False
        self.stream = engine.add_request(
            EngineCoreRequest(
                request_id,
                prompt_token_ids,
                params,
                arrival_time=time.time(),
                structured_output=structured_output,
                lora_name=lora_name,
                mm_items=mm_items or [],
                kv_transfer=kv_transfer,
            )
        )

    @property
    def replica(self) -> int:
        """The data-parallel replica serving it."""
        return self.stream.replica

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_output_tokens(self) -> int:
        return self.detokenizer.num_tokens

    def routed_experts(self) -> np.ndarray | None:
        """The routing of the tokens answered (routed_experts.py), once finished; None when the
        engine records none."""
        if not self.is_finished:
            return None
        return self.routing.array(self.num_prompt_tokens + len(self.output_token_ids))

    def usage(self) -> UsageInfo:
        n_in, n_out = self.num_prompt_tokens, self.num_output_tokens
        return UsageInfo(n_in, n_in + n_out, n_out, PromptTokensDetails(self.num_cached_tokens))

    async def next_text(self) -> str:
        """Waits for the engine's next tokens; returns the text they release (may be empty).

        Raises EngineDeadError or RequestFailedError. Sets finish_reason on the last call.
        """
        try:
            out = await self.stream.next()
        except EngineDeadError as e:
            self._fail_lease(f"the producer's engine died: {e}")
            raise
        if out.finish_reason is not None:
            self._record_lease(out)
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if out.weight_version is not None:
            self.weight_version = out.weight_version
        if out.lora_version is not None:
            self.lora_version = out.lora_version
        if out.finish_reason == FinishReason.ERROR:
            self.finish_reason = "error"
            raise RequestFailedError(out.error or "the engine failed to serve this request")
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.routed_experts is not None:
            self.routing.add(out.routed_experts)
        self.cross_attention += out.cross_attention
        tokens = [] if self.discard_output else out.new_token_ids
        by_stop_token = out.finish_reason == FinishReason.STOP and bool(tokens)
        num_before = self.detokenizer.num_tokens
        self.detokenizer.update(tokens, ends_with_stop_token=by_stop_token)
        num_new = self.detokenizer.num_tokens - num_before
        self.new_token_ids = tokens[:num_new]
        self.output_token_ids += self.new_token_ids
        self.new_logprobs = None
        if out.new_logprobs is not None and num_new:
            self.new_logprobs = out.new_logprobs.slice(0, num_new)
            self.output_logprobs.append(self.new_logprobs)
        if self.discard_output and out.finish_reason is not None:
            self.finish_reason = FinishReason.LENGTH.value
        elif self.detokenizer.is_stopped:
            self.finish_reason = FinishReason.STOP.value
            self.stop_reason = self.detokenizer.stop_reason
            self.abort()  # the engine would go on generating: a stop string is ours to find
        elif out.finish_reason is not None:
            self.finish_reason = out.finish_reason.value
            if by_stop_token and out.new_token_ids[-1] in self.user_stop_token_ids:
                self.stop_reason = out.new_token_ids[-1]  # vLLM: the stop token id; None for EOS
        if self.metrics is not None:
            self._observe(out.queued_time, out.first_scheduled_time, num_new)
        return self.detokenizer.take_new_text(final=self.is_finished)

    @property
    def all_output_logprobs(self) -> Logprobs | None:
        return Logprobs.concat(self.output_logprobs) if self.params.logprobs is not None else None

    async def collect(self) -> str:
        parts = []
        while not self.is_finished:
            parts.append(await self.next_text())
        return "".join(parts)

    def abort(self) -> None:
        """Stops the request in the engine if it is still running there (no-op otherwise).

        Its stream is dropped: the generation reads nothing more (the client is gone, or the
        frontend decided it is finished).
        """
        self.engine.abort([self.request_id])
        if not self.is_finished:
            # NOTE: its last output may be on the way (blocks lent): release them in any case.
            self._fail_lease("the producing request was aborted", release=True)
        if not self.is_finished and not self.engine.is_dead:
            self._record_finish("abort")

    def _record_lease(self, out: EngineCoreOutput) -> None:
        """A producing request's last output: its blocks (of each KV-cache group, with a hybrid
        model's state checkpoint and the positions' routing rows) are lent, or it failed."""
        assert out.finish_reason is not None
        if out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            if self.leases is not None and not self._is_lease_recorded:
                assert self.kv_transfer is not None
                self._is_lease_recorded = True
                self.kv_lease_block_ids = list(out.kv_lease_block_ids or [])
                self.leases.lend(
                    self.kv_transfer.lease_id, self.replica, self.prompt_token_ids,
                    self.kv_lease_block_ids, out.kv_lease_other_block_ids,
                    out.kv_lease_state_checkpoint, out.kv_lease_routing,
                )  # fmt: skip
            return
        why = out.error or f"the producing request ended with {out.finish_reason.value}"
        self._fail_lease(why)

    def _fail_lease(self, error: str, release: bool = False) -> None:
        if self.leases is not None and not self._is_lease_recorded:
            assert self.kv_transfer is not None
            self._is_lease_recorded = True
            self.leases.fail(self.kv_transfer.lease_id, self.replica, error, release)

    def cancel(self, info: dict[str, Any]) -> None:
        """Asks the engine to stop the request; the generation then finishes with "abort"."""
        if not self.is_finished:
            self.abort_info = info
            self.engine.cancel([self.request_id])

    def _observe(self, queued: float | None, scheduled: float | None, num_new: int) -> None:
        assert self.metrics is not None
        now = time.monotonic()
        if num_new and self._first_token_time is None:
            self._first_token_time = now
            self.metrics.on_first_token(now - self._arrival, self.num_prompt_tokens)
        if queued is not None and scheduled is not None:
            self.metrics.on_scheduled(max(scheduled - queued, 0.0))
        if num_new:
            self.metrics.on_new_tokens(num_new)
        if self.finish_reason in ("stop", "length", "abort"):
            self._record_finish(self.finish_reason)

    def _record_finish(self, reason: str) -> None:
        if self._is_recorded or self.metrics is None:
            return
        self._is_recorded = True
        now = time.monotonic()
        decode_time = None
        if self._first_token_time is not None and self.num_output_tokens > 1:
            decode_time = (now - self._first_token_time) / (self.num_output_tokens - 1)
        self.metrics.on_finish(reason, now - self._arrival, decode_time)


class RequestGroup:
    """The generations of one HTTP request, registered for abort while the request lasts."""

    def __init__(
        self,
        keys: list[str],
        gens: list[Generation],
        registry: InflightRequests,
        session_id: int | None = None,
        n: int = 1,
    ) -> None:
        self.keys = keys  # keys[0] is the response id
        self.gens = gens  # n per prompt, prompt by prompt
        self.model_name = ""  # what responses call the model: the served name, or the adapter's
        self.n = n
        self.registry = registry
        self.session_id = session_id  # LMDeploy's /generate session
        registry.add(self)

    @property
    def weight_version(self) -> str | None:
        versions = [g.weight_version for g in self.gens if g.weight_version is not None]
        return versions[-1] if versions else None

    @property
    def lora_version(self) -> str | UnsetType:
        """The version of the LoRA adapter its requests ran on (the last one's), or UNSET."""
        versions = [g.lora_version for g in self.gens if g.lora_version is not None]
        return versions[-1] if versions else UNSET

    def usage(self) -> UsageInfo:
        # A prompt counts once, however many samples it has (as vLLM); its first sample shows
        # what the prefix cache held before this request.
        firsts = self.gens[:: self.n]
        n_in = sum(g.num_prompt_tokens for g in firsts)
        n_out = sum(g.num_output_tokens for g in self.gens)
        cached = sum(g.num_cached_tokens for g in firsts)
        return UsageInfo(n_in, n_in + n_out, n_out, PromptTokensDetails(cached))

    async def merged(self) -> AsyncIterator[tuple[int, str]]:
        """(index, text) as each generation releases text, until all have finished."""
        if len(self.gens) == 1:  # the common case: no task per output
            gen = self.gens[0]
            while not gen.is_finished:
                yield 0, await gen.next_text()
            return
        pending = {
            asyncio.ensure_future(g.next_text()): i
            for i, g in enumerate(self.gens)
            if not g.is_finished
        }
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=pending.__getitem__):
                    i = pending.pop(task)
                    text = task.result()
                    yield i, text
                    if not self.gens[i].is_finished:
                        pending[asyncio.ensure_future(self.gens[i].next_text())] = i
        finally:
            # NOTE: a task waiting in RequestStream.next loses nothing when cancelled: it has not
            # taken an item off the queue yet.
            for task in pending:
                task.cancel()

    async def collect_unless_disconnected(self, http_request: Request) -> list[str] | None:
        """Every generation's whole text, or None if the client went away first.

        Engine failures become APIErrors (503 engine dead, 500 request failed).
        """
        collect = asyncio.ensure_future(asyncio.gather(*(g.collect() for g in self.gens)))
        disconnect = asyncio.ensure_future(_wait_for_disconnect(http_request.receive))
        try:
            await asyncio.wait({collect, disconnect}, return_when=asyncio.FIRST_COMPLETED)
            if collect.done():
                try:
                    return list(collect.result())
                except EngineDeadError as e:
                    raise engine_dead_error(str(e)) from e
                except RequestFailedError as e:
                    raise APIError(str(e), 500, None, "engine_error") from e
            return None
        finally:
            collect.cancel()
            disconnect.cancel()
            self.close()

    def cancel(self, info: dict[str, Any]) -> None:
        for gen in self.gens:
            gen.cancel(info)

    def close(self) -> None:
        """The HTTP request is over: stop what still runs and forget the group (idempotent)."""
        for gen in self.gens:
            gen.abort()
        self.registry.remove(self)


class InflightRequests:
    """Request groups by every id a client may use to abort them: response id, X-Request-Id, and
    LMDeploy session id."""

    def __init__(self) -> None:
        self._by_key: dict[str, list[RequestGroup]] = {}
        self._by_session: dict[int, RequestGroup] = {}

    def add(self, group: RequestGroup) -> None:
        if group.session_id is not None:
            assert group.session_id not in self._by_session, "session ids are checked first"
            self._by_session[group.session_id] = group
        for key in group.keys:
            self._by_key.setdefault(key, []).append(group)

    def remove(self, group: RequestGroup) -> None:
        if group.session_id is not None and self._by_session.get(group.session_id) is group:
            del self._by_session[group.session_id]
        for key in group.keys:
            groups = self._by_key.get(key, [])
            if group in groups:
                groups.remove(group)
            if not groups:
                self._by_key.pop(key, None)

    def find(self, key: str) -> list[RequestGroup]:
        return list(self._by_key.get(key, []))

    def find_session(self, session_id: int) -> RequestGroup | None:
        return self._by_session.get(session_id)

    def all(self) -> list[RequestGroup]:
        return list({id(g): g for gs in self._by_key.values() for g in gs}.values())


async def stream_and_close(body: AsyncIterator[bytes], group: RequestGroup) -> AsyncIterator[bytes]:
    """Passes `body` through; closes the group when the stream ends, fails or is cancelled."""
    try:
        async for chunk in body:
            yield chunk
    finally:
        # NOTE: runs when the client disconnects too (starlette cancels the stream task).
        group.close()


def unique_ids(base: str, count: int, is_taken: Callable[[str], bool]) -> list[str]:
    """Engine request ids for `count` prompts of one request: base, or base-i for a batch.

    Clients may reuse an X-Request-Id; a taken id gets a counter suffix (the engine needs unique ids).
    """
    ids = [base] if count == 1 else [f"{base}-{i}" for i in range(count)]
    out = []
    for rid in ids:
        candidate, n = rid, 1
        while is_taken(candidate) or candidate in out:
            candidate, n = f"{rid}.{n}", n + 1
        out.append(candidate)
    return out


async def _wait_for_disconnect(receive: Callable[[], Any]) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return

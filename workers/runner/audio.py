"""An encoder-decoder's audio (Whisper): each running request's cross-attention keys and values.

A request carries one audio item (MultiModalItem, modality "audio", no placeholder spans: the
audio conditions every decoder position) whose tensors are the window's log-mel features. When
the request is scheduled first (or again after a preemption), its audio is encoded and every
decoder layer's keys and values over the encoder's states are computed once; they are kept by
the audio's content hash (a repeated audio is not encoded again) and, per request, until it
finishes. The cache is emptied when the weights change: keys of old weights must not be served.

Every tensor-parallel rank runs this in the same order on the same steps, so their caches make
the same choices (an encoder call is a collective).

Requests that ask for word timestamps (SamplingParams.cross_attention) also get the decoder's
cross-attention probabilities at the model's alignment heads for every token of their chunk:
the decoder layers fill a `CrossAttentionCapture` per step, and the rows of heads split over
tensor-parallel ranks are summed (each rank fills its own heads; a collective on every rank).
"""

from __future__ import annotations

import torch

from enginecore.messages import (
    CROSS_ATTENTION_FRAMES,
    SamplingParams,
    ScheduledRequest,
    SchedulerOutput,
)
from workers.distributed import ParallelContext
from workers.layers.attention import CrossAttentionCapture
from workers.runner.images import EncoderCache, tensor_from_data

# Keys and values kept for reuse beyond the running requests' (bytes); one whisper-base window
# is 6 layers x 2 x 1500 x 512 float32 = 37 MB.
CROSS_KV_CACHE_BYTES = 256 << 20

CrossKV = list[tuple[torch.Tensor, torch.Tensor]]  # per decoder layer: (H, S, D) keys, values


class AudioInputs:
    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.by_request: dict[str, CrossKV] = {}
        self.cache = EncoderCache(CROSS_KV_CACHE_BYTES)

    def update(self, step: SchedulerOutput) -> None:
        """Forgets the finished requests' audio; encodes that of the requests (re)started."""
        for req_id in step.finished_req_ids:
            self.by_request.pop(req_id, None)
        for r in step.requests:
            if r.sampling_params is not None:
                self.by_request[r.req_id] = self._cross_kv(r)

    def batch(self, reqs: list[ScheduledRequest]) -> list[CrossKV]:
        """The step's sequences' keys and values, in batch order."""
        missing = [r.req_id for r in reqs if r.req_id not in self.by_request]
        if missing:
            raise ValueError(f"request {missing[0]!r} runs without its audio")
        return [self.by_request[r.req_id] for r in reqs]

    def capture(
        self, reqs: list[ScheduledRequest], params: list[SamplingParams]
    ) -> CrossAttentionCapture | None:
        """The step's sequences whose cross-attention probabilities are kept (those that asked
        and sample: a chunk that samples nothing holds prompt positions, or positions recomputed
        after a preemption whose rows the engine core already has); None when none."""
        heads = {
            i: list(q.cross_attention.heads)
            for i, (r, q) in enumerate(zip(reqs, params))
            if q.cross_attention is not None and r.sample_index >= 0
        }
        if not heads:
            return None
        rows = {
            i: torch.zeros(
                len(reqs[i].token_ids), len(pairs), CROSS_ATTENTION_FRAMES, device=self.device
            )
            for i, pairs in heads.items()
        }
        return CrossAttentionCapture(heads, rows)

    @staticmethod
    def captured(
        capture: CrossAttentionCapture | None, reqs: list[ScheduledRequest], p: ParallelContext
    ) -> dict[str, bytes]:
        """The rows by request id on the driver (empty elsewhere); sums them over the
        tensor-parallel group first (every rank calls this)."""
        if capture is None:
            return {}
        seqs = sorted(capture.rows)
        # One collective for the step: every sequence's rows, flat, summed at once.
        flat = p.all_reduce(torch.cat([capture.rows[i].flatten() for i in seqs]))
        if not p.is_driver:
            return {}
        sizes = [capture.rows[i].numel() for i in seqs]
        parts = flat.cpu().split(sizes)
        return {reqs[i].req_id: part.numpy().tobytes() for i, part in zip(seqs, parts)}

    def weights_changed(self) -> None:
        self.cache.clear()

    def _cross_kv(self, r: ScheduledRequest) -> CrossKV:
        audio = [item for item in r.mm_items if item.modality == "audio"]
        if len(audio) != 1 or any(item.modality != "audio" for item in r.mm_items):
            raise ValueError(f"request {r.req_id!r} needs exactly one audio item, and nothing else")
        item = audio[0]
        kv = self.cache.get(item.content_hash)
        if kv is not None:
            return kv
        features = item.tensors.get("input_features")
        if features is None:
            raise ValueError(f"audio {item.content_hash[:12]} arrived without input_features")
        kv = self.model.cross_attention_kv(
            self.model.encode(tensor_from_data(features, self.device))
        )
        self.cache.put(item.content_hash, kv)
        return kv

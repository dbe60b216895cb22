"""The step's image inputs: each running request's images (kept from the step that schedules it
until the one that finishes or preempts it), their encoder outputs, and the rows of the flat
batch those outputs fill.

An image is encoded once, when the first chunk that holds one of its placeholders runs; its output
is kept under the image's content hash (EncoderCache), so a repeated image, in this request or a
later one, is not encoded again. The cache is emptied when the weights change. A chunk takes the
slice of an image's rows its placeholders cover, so chunked prefill may split an image (models
that forbid it are never sent a split one: enginecore/scheduler.py).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from enginecore.messages import MultiModalItem, ScheduledRequest, SchedulerOutput, TensorData
from workers.runner.mrope import (
    MRopeLayout,
    VisionGrid,
    mrope_positions,
    text_tail,
    vision_grids,
)
from workers.vision.encoders import ImageEncoder

# Encoder outputs kept for reuse (bytes); one 448x448 image of a 1B model is ~1 MiB of fp32 rows.
ENCODER_CACHE_BYTES = 256 << 20


class EncoderCache:
    """Encoder outputs by content hash, the least recently used dropped past a byte budget. An
    output is a tensor, or a list of tensor pairs (an encoder-decoder's per-layer cross-attention
    keys and values: workers/runner/audio.py)."""

    def __init__(self, max_bytes: int = ENCODER_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._outputs: OrderedDict[str, Any] = OrderedDict()

    def get(self, content_hash: str) -> Any:
        output = self._outputs.get(content_hash)
        if output is not None:
            self._outputs.move_to_end(content_hash)
        return output

    def put(self, content_hash: str, output: Any) -> None:
        self._outputs[content_hash] = output
        self.num_bytes += _num_bytes(output)
        while self.num_bytes > self.max_bytes and len(self._outputs) > 1:
            _, dropped = self._outputs.popitem(last=False)
            self.num_bytes -= _num_bytes(dropped)

    def clear(self) -> None:
        self._outputs.clear()
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._outputs)


class ImageInputs:
    """The running requests' images and, each step, the encoder rows their placeholders take
    (first pipeline stage: `encoder`) and the spans attention sees in both directions (every
    stage, on models that attend so inside an image: `bidirectional`), and on models that rotate
    by multimodal positions (`mrope`: what places their vision tokens) each token's (t, h, w)
    rotary positions (workers/runner/mrope.py). Videos are items too (Qwen VL: their own
    placeholder runs and grids)."""

    def __init__(
        self,
        encoder: ImageEncoder | None,
        device: torch.device,
        bidirectional: bool,
        mrope: MRopeLayout | None = None,
    ) -> None:
        self.encoder = encoder
        self.device = device
        self.bidirectional = bidirectional
        self.mrope = mrope
        self.cache = EncoderCache()
        self.items: dict[str, list[MultiModalItem]] = {}
        self.grids: dict[str, list[VisionGrid]] = {}  # M-RoPE models: each request's vision runs
        # ... and where its text after them starts, with its delta (text_tail): decode steps.
        self.tails: dict[str, tuple[int, int]] = {}

    def update(self, step: SchedulerOutput) -> None:
        """Forgets the finished requests' images; keeps those of the requests (re)started."""
        for req_id in step.finished_req_ids:
            self.items.pop(req_id, None)
            self.grids.pop(req_id, None)
            self.tails.pop(req_id, None)
        for r in step.requests:
            if r.sampling_params is not None:
                self.grids.pop(r.req_id, None)
                self.tails.pop(r.req_id, None)
                if r.mm_items:
                    self.items[r.req_id] = list(r.mm_items)
                    if self.mrope is not None:
                        grids = self.grids[r.req_id] = vision_grids(r.mm_items, self.mrope)
                        self.tails[r.req_id] = text_tail(grids)
                else:
                    self.items.pop(r.req_id, None)

    def rope_positions(self, reqs: list[ScheduledRequest]) -> torch.Tensor | None:
        """The flat batch's (3, T) M-RoPE positions; None when no request of the step has an
        image (every token's three positions are then its index: the plain rotation)."""
        if self.mrope is None or not any(r.req_id in self.grids for r in reqs):
            return None
        positions = []
        for r in reqs:
            begin, end = r.start_pos, r.start_pos + len(r.token_ids)
            tail, delta = self.tails.get(r.req_id, (0, 0))
            if begin >= tail:  # past every image and video (decode): no run to walk
                positions.append(torch.arange(begin + delta, end + delta).expand(3, -1))
            else:
                positions.append(mrope_positions(self.grids[r.req_id], begin, end))
        return torch.cat(positions, dim=1).to(self.device)

    def weights_changed(self) -> None:
        """Outputs of the old weights must not be served again."""
        self.cache.clear()

    def bidirectional_spans(
        self, reqs: list[ScheduledRequest]
    ) -> list[list[tuple[int, int]]] | None:
        """Each request's image placeholder runs, for attention (None: the model is causal)."""
        if not self.bidirectional:
            return None
        return [
            [span for item in self.items.get(r.req_id, ()) for span in item.spans] for r in reqs
        ]

    def embeddings(self, reqs: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The flat batch's placeholder rows (R,) and the encoder features that fill them
        (R, hidden), encoding the images not cached; None when no chunk holds a placeholder, and
        on later pipeline stages (they take the first stage's hidden states)."""
        if self.encoder is None:
            return None
        rows: list[torch.Tensor] = []
        features: list[torch.Tensor] = []
        first = 0  # the chunk's first row in the flat batch
        for r in reqs:
            items = self.items.get(r.req_id)
            if items:
                begin = r.start_pos
                end = begin + len(r.token_ids) - r.num_draft_tokens
                for item in items:
                    self._take(item, begin, end, first, rows, features)
            first += len(r.token_ids)
        if not rows:
            return None
        return torch.cat(rows).to(self.device), torch.cat(features)

    def _take(
        self,
        item: MultiModalItem,
        begin: int,
        end: int,
        first: int,
        rows: list[torch.Tensor],
        features: list[torch.Tensor],
    ) -> None:
        """Appends the rows of `item` that positions [begin, end) of a chunk starting at flat row
        `first` hold."""
        output = None
        row = 0  # the item's encoder row of the span's first placeholder
        for start, length in item.spans:
            lo, hi = max(begin, start), min(end, start + length)
            if lo < hi:
                output = output if output is not None else self._output(item)
                rows.append(torch.arange(first + lo - begin, first + hi - begin))
                features.append(output[row + lo - start : row + hi - start])
            row += length

    def _output(self, item: MultiModalItem) -> torch.Tensor:
        output = self.cache.get(item.content_hash)
        if output is not None:
            return output
        assert self.encoder is not None
        if not item.tensors:
            raise ValueError(f"image {item.content_hash[:12]} arrived without its tensors")
        tensors = {name: tensor_from_data(t, self.device) for name, t in item.tensors.items()}
        output = self.encoder.encode(tensors)
        expected = sum(length for _, length in item.spans)
        if output.shape[0] != expected:
            raise ValueError(
                f"the image encoder gave {output.shape[0]} rows for {expected} placeholders"
            )
        self.cache.put(item.content_hash, output)
        return output


def _num_bytes(output: Any) -> int:
    if isinstance(output, torch.Tensor):
        return output.numel() * output.element_size()
    return sum(_num_bytes(part) for part in output)


def tensor_from_data(t: TensorData, device: torch.device) -> torch.Tensor:
    """A TensorData's tensor (a copy: the message's bytes are read-only)."""
    dtype = getattr(torch, t.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {t.dtype!r}")
    flat = (
        torch.frombuffer(bytearray(t.data), dtype=dtype) if t.data else torch.empty(0, dtype=dtype)
    )
    return flat.reshape(t.shape).to(device)

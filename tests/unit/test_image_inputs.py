"""The workers' image inputs (workers/runner/images.py): each image encoded once, its output reused by
content hash across requests until the weights change; a chunk takes the rows its placeholders
cover, across several runs of one image; and the encoder cache's byte budget."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from enginecore.messages import (
    MultiModalItem,
    SamplingParams,
    ScheduledRequest,
    SchedulerOutput,
    TensorData,
)
from workers.runner.images import EncoderCache, ImageInputs, tensor_from_data

HIDDEN = 3


class CountingEncoder:
    """Row i of an image's output is (seed, i, i): which image and which row, readable back."""

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        self.calls += 1
        seed, rows = tensors["pixel_values"].tolist()
        return torch.tensor([[seed, i, i] for i in range(int(rows))], dtype=torch.float32)


def _item(seed: int, spans: list[tuple[int, int]]) -> MultiModalItem:
    rows = sum(n for _, n in spans)
    pixels = np.array([seed, rows], dtype=np.float32)
    tensors = {"pixel_values": TensorData("float32", [2], pixels.tobytes())}
    return MultiModalItem("image", f"hash-{seed}", spans, tensors)


def _first_chunk(
    req_id: str, start: int, num: int, items: list[MultiModalItem]
) -> ScheduledRequest:
    return ScheduledRequest(req_id, [0] * num, start, [], -1, SamplingParams(), mm_items=items)


def _chunk(req_id: str, start: int, num: int) -> ScheduledRequest:
    return ScheduledRequest(req_id, [0] * num, start, [], -1)


def _inputs() -> tuple[ImageInputs, CountingEncoder]:
    encoder = CountingEncoder()
    return ImageInputs(encoder, torch.device("cpu"), bidirectional=False), encoder  # type: ignore[arg-type]


def test_chunks_take_their_rows_across_runs_of_one_image() -> None:
    inputs, encoder = _inputs()
    item = _item(7, [(2, 3), (8, 2)])  # runs at 2..4 and 8..9: rows 0-2, then 3-4
    first = _first_chunk("a", 0, 4, [item])  # positions 0..3: rows 0, 1 at flat rows 2, 3
    inputs.update(SchedulerOutput(1, [first]))
    rows, features = inputs.embeddings([first])
    assert rows.tolist() == [2, 3] and features[:, 1].tolist() == [0, 1]
    second = _chunk("a", 4, 6)  # positions 4..9: row 2 at 4, rows 3, 4 at 8, 9
    other = _first_chunk("b", 0, 2, [])  # before it in the batch: flat rows shift by 2
    inputs.update(SchedulerOutput(2, [other, second]))
    rows, features = inputs.embeddings([other, second])
    assert rows.tolist() == [2, 6, 7] and features[:, 1].tolist() == [2, 3, 4]
    assert encoder.calls == 1  # encoded once, by the chunk that reached it first


def test_a_repeated_image_is_not_encoded_again_until_the_weights_change() -> None:
    inputs, encoder = _inputs()
    for i, req_id in enumerate(("a", "b")):  # two conversations, the same image
        chunk = _first_chunk(req_id, 0, 6, [_item(5, [(1, 4)])])
        inputs.update(SchedulerOutput(i, [chunk], finished_req_ids=["a"] if i else []))
        assert inputs.embeddings([chunk])[1][:, 0].tolist() == [5, 5, 5, 5]
    assert encoder.calls == 1 and "a" not in inputs.items
    inputs.weights_changed()
    chunk = _first_chunk("c", 0, 6, [_item(5, [(1, 4)])])
    inputs.update(SchedulerOutput(3, [chunk]))
    inputs.embeddings([chunk])
    assert encoder.calls == 2


def test_a_step_without_placeholders_has_no_rows() -> None:
    inputs, encoder = _inputs()
    chunk = _first_chunk("a", 0, 4, [_item(1, [(10, 4)])])
    inputs.update(SchedulerOutput(1, [chunk]))
    assert inputs.embeddings([chunk]) is None and encoder.calls == 0


def test_an_encoder_that_gives_the_wrong_rows_is_an_error() -> None:
    inputs, _ = _inputs()
    item = _item(1, [(0, 4)])
    item.spans = [(0, 5)]  # placeholders the tensors do not produce
    chunk = _first_chunk("a", 0, 5, [item])
    inputs.update(SchedulerOutput(1, [chunk]))
    with pytest.raises(ValueError, match="4 rows for 5 placeholders"):
        inputs.embeddings([chunk])


def test_the_encoder_cache_drops_the_least_recently_used_past_its_budget() -> None:
    cache = EncoderCache(max_bytes=3 * 4 * HIDDEN)  # three rows of float32
    cache.put("a", torch.zeros(1, HIDDEN))
    cache.put("b", torch.zeros(1, HIDDEN))
    assert cache.get("a") is not None  # now the most recently used
    cache.put("c", torch.zeros(2, HIDDEN))
    assert cache.get("b") is None and cache.get("a") is not None and len(cache) == 2


def test_tensor_data_round_trips() -> None:
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    data = TensorData("float32", [2, 3], array.tobytes())
    assert tensor_from_data(data, torch.device("cpu")).tolist() == array.tolist()
    with pytest.raises(ValueError, match="dtype"):
        tensor_from_data(TensorData("complex_floaty", [1], b"\0"), torch.device("cpu"))

"""Multimodal rotary positions (M-RoPE, Qwen3.5's and Qwen2.5-VL's language models): each token rotates by three
positions, (temporal, height, width), instead of one. A text token's three are equal; an image's
placeholders take its merged patch grid's coordinates, offset by the position the image starts
at; the text after an image resumes at that start + max(grid height, grid width). Videos:
Qwen2-VL's and Qwen2.5-VL's run is one (t, h, w) grid whose time coordinate steps by
`time_interval` (Qwen2.5-VL: tokens_per_second * second_per_grid_ts; Qwen2-VL: 1); Qwen3-VL's and
Qwen3.5's put each temporal patch in its own run (timestamps between), each a (1, h, w) grid.
Positions past the prompt (decode, drafts) continue from its last token's: index + delta, where
delta is what the prompt's images and videos took away. NOTE: that is Hugging Face's `generate`
(each new position is the last one + 1), not its get_rope_index's rope_deltas (the largest
position + 1 - the prompt's length), which differ when a video's time coordinates reach past the
text after it; `generate` is the oracle.

Only the rotation reads these positions: a token's KV-cache slot stays its index in the sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from enginecore.messages import MultiModalItem, TensorData


@dataclass(frozen=True)
class MRopeLayout:
    """What places a checkpoint's vision tokens: its tower's spatial merge size and, for
    Qwen2.5-VL's videos, the rotary time steps a second of video takes."""

    spatial_merge_size: int
    tokens_per_second: float = 1.0


def mrope_layout(image_config: dict) -> MRopeLayout | None:
    """The layout of a checkpoint whose language model rotates by multimodal positions
    (`mrope_section` in its text config's rope parameters); None otherwise."""
    text = image_config.get("text_config") or image_config  # flat: transformers-4 Qwen2.5-VL
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if "mrope_section" not in rope:
        return None
    vision = image_config.get("vision_config") or {}
    # Qwen2.5-VL's vision config has tokens_per_second (Qwen2_5_VLVisionConfig's default: 4).
    per_second = vision.get("tokens_per_second", 4 if "window_size" in vision else 1)
    return MRopeLayout(int(vision.get("spatial_merge_size", 2)), float(per_second))


@dataclass(frozen=True)
class VisionGrid:
    """One run of vision placeholders: its first position, its merged grid (t, h, w) and how far
    apart its time coordinates are."""

    start: int
    thw: tuple[int, int, int]
    time_interval: float = 1.0

    @property
    def num_tokens(self) -> int:
        t, h, w = self.thw
        return t * h * w

    def time_offsets(self) -> torch.Tensor:
        """Each temporal patch's time coordinate, as get_vision_position_ids quantises it."""
        t = self.thw[0]
        if self.time_interval == 1.0:
            return torch.arange(t)
        interval = torch.tensor(self.time_interval, dtype=torch.float32)
        return (torch.arange(t) * interval).long()


def vision_grids(items: list[MultiModalItem], layout: MRopeLayout) -> list[VisionGrid]:
    """Each image's and video's runs of placeholders with their grids, in prompt order (from
    `image_grid_thw` / `video_grid_thw`, and Qwen2.5-VL's `second_per_grid_ts`)."""
    m = layout.spatial_merge_size
    grids = []
    for item in items:
        name = "video_grid_thw" if item.modality == "video" else "image_grid_thw"
        if name not in item.tensors:
            raise ValueError(f"{item.modality} {item.content_hash[:12]} arrived without its {name}")
        t, h, w = (int(v) for v in _values(item.tensors[name]))
        h, w = h // m, w // m
        if len(item.spans) == 1:  # one (t, h, w) run
            seconds = item.tensors.get("second_per_grid_ts")
            interval = (
                layout.tokens_per_second * float(_values(seconds)[0])
                if seconds is not None
                else 1.0
            )
            runs = [VisionGrid(item.spans[0][0], (t, h, w), interval)]
        else:  # Qwen3-VL's video: a run per temporal patch
            runs = [VisionGrid(start, (1, h, w)) for start, _ in item.spans]
        if [(g.start, g.num_tokens) for g in runs] != [tuple(span) for span in item.spans]:
            raise ValueError(f"spans {item.spans} do not hold a {(t, h, w)} grid of placeholders")
        grids += runs
    return sorted(grids, key=lambda g: g.start)


def _values(data: TensorData) -> torch.Tensor:
    return torch.frombuffer(bytearray(data.data), dtype=getattr(torch, data.dtype)).flatten()


def text_tail(grids: list[VisionGrid]) -> tuple[int, int]:
    """Where the last vision run ends, and what every later position adds to its index (the
    delta mrope_positions reaches there): decode steps take their positions from it at once."""
    if not grids:
        return 0, 0
    delta = sum(max(g.thw[1], g.thw[2]) - g.num_tokens for g in grids)
    return max(g.start + g.num_tokens for g in grids), delta


def mrope_positions(grids: list[VisionGrid], begin: int, end: int) -> torch.Tensor:
    """(3, end - begin) int64: the (t, h, w) positions of sequence positions [begin, end)."""
    out = torch.empty(3, end - begin, dtype=torch.int64)
    delta = 0  # a text token's position minus its index
    cursor = begin  # the first position not yet written

    def text(lo: int, hi: int) -> None:
        if lo < hi:
            out[:, lo - begin : hi - begin] = torch.arange(lo + delta, hi + delta)

    for grid in grids:
        if grid.start >= end:
            break
        (_, h, w), start = grid.thw, grid.start
        text(cursor, start)
        lo, hi = max(start, begin), min(start + grid.num_tokens, end)
        if lo < hi:
            k = torch.arange(lo - start, hi - start)  # placeholders, row-major over (t, h, w)
            first = start + delta
            out[0, lo - begin : hi - begin] = first + grid.time_offsets()[k // (h * w)]
            out[1, lo - begin : hi - begin] = first + (k // w) % h
            out[2, lo - begin : hi - begin] = first + k % w
        delta += max(h, w) - grid.num_tokens
        cursor = max(cursor, start + grid.num_tokens)
    text(cursor, end)
    return out

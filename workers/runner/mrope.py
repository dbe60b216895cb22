"""Multimodal rotary positions (M-RoPE, Qwen3.5's and Qwen2.5-VL's language models): each token rotates by three
positions, (temporal, height, width), instead of one. A text token's three are equal; an image's
placeholders take its merged patch grid's coordinates, offset by the position the image starts
at; the text after an image resumes at that start + max(grid height, grid width). Positions past
the prompt (decode, drafts) are index + delta, where delta is what the prompt's images took away
(the largest position + 1 - the prompt's length), as Hugging Face's get_rope_index and its
rope_deltas compute them.

Only the rotation reads these positions: a token's KV-cache slot stays its index in the sequence.
"""

from __future__ import annotations

import torch

from enginecore.messages import MultiModalItem


def mrope_merge_size(image_config: dict) -> int | None:
    """The vision tower's spatial merge size of a checkpoint whose language model rotates by
    multimodal positions (`mrope_section` in its text config's rope parameters); None otherwise."""
    text = image_config.get("text_config") or image_config  # flat: transformers-4 Qwen2.5-VL
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if "mrope_section" not in rope:
        return None
    return int((image_config.get("vision_config") or {}).get("spatial_merge_size", 2))


# One image in a prompt: (first placeholder position, llm grid (t, h, w) after merging).
ImageGrid = tuple[int, tuple[int, int, int]]


def image_grids(items: list[MultiModalItem], spatial_merge_size: int) -> list[ImageGrid]:
    """Each image's first placeholder and merged grid, in prompt order (from `image_grid_thw`)."""
    grids = []
    for item in items:
        if "image_grid_thw" not in item.tensors:
            raise ValueError(f"image {item.content_hash[:12]} arrived without its image_grid_thw")
        data = item.tensors["image_grid_thw"]
        t, h, w = torch.frombuffer(bytearray(data.data), dtype=getattr(torch, data.dtype)).view(3)
        grid = (int(t), int(h) // spatial_merge_size, int(w) // spatial_merge_size)
        (start, length), *rest = item.spans
        if rest or length != grid[0] * grid[1] * grid[2]:
            raise ValueError(f"spans {item.spans} do not hold one {grid} grid of placeholders")
        grids.append((start, grid))
    return sorted(grids)


def mrope_positions(grids: list[ImageGrid], begin: int, end: int) -> torch.Tensor:
    """(3, end - begin) int64: the (t, h, w) positions of sequence positions [begin, end)."""
    out = torch.empty(3, end - begin, dtype=torch.int64)
    delta = 0  # a text token's position minus its index
    cursor = begin  # the first position not yet written

    def text(lo: int, hi: int) -> None:
        if lo < hi:
            out[:, lo - begin : hi - begin] = torch.arange(lo + delta, hi + delta)

    for start, (t, h, w) in grids:
        if start >= end:
            break
        num_tokens = t * h * w
        text(cursor, start)
        lo, hi = max(start, begin), min(start + num_tokens, end)
        if lo < hi:
            k = torch.arange(lo - start, hi - start)  # placeholders, row-major over (t, h, w)
            first = start + delta
            out[0, lo - begin : hi - begin] = first + k // (h * w)
            out[1, lo - begin : hi - begin] = first + (k // w) % h
            out[2, lo - begin : hi - begin] = first + k % w
        delta += max(h, w) - num_tokens
        cursor = max(cursor, start + num_tokens)
    text(cursor, end)
    return out

"""Prompts with images, made as the checkpoint's own Hugging Face processor makes them: the chat
template's text with one image marker per image goes through `AutoProcessor`, which expands each
marker into the model's placeholder tokens; each image's tensors (pixel_values, ...) become a
MultiModalItem with the runs of placeholders its encoder output fills and a hash of its tensors.

The tensors travel to the workers as raw bytes in msgspec messages (enginecore/messages.py
TensorData), never pickled.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from enginecore.messages import MultiModalItem, TensorData
from frontend.common.errors import bad_request
from frontend.media.qwen_vl import QwenVLImageProcessor, is_qwen_vl


class ImageProcessor:
    """The checkpoint's processor (its preprocessor_config.json and processor_config.json)."""

    def __init__(self, model_path: str | Path) -> None:
        from transformers import AutoProcessor  # only servers of image models pay for its import

        try:
            self.hf = (
                QwenVLImageProcessor(model_path)
                if is_qwen_vl(model_path)
                else AutoProcessor.from_pretrained(str(model_path))
            )
        except Exception as e:
            raise ValueError(f"cannot load the image processor of {model_path}: {e}") from e
        self.placeholder_id = int(self.hf.image_token_id)
        # The text that stands for one image in a prompt (Gemma 3's processor expands its
        # begin-of-image token; LLaVA's and Qwen's their image token, which Qwen's chat template
        # writes between <|vision_start|> and <|vision_end|>).
        self.marker = getattr(self.hf, "boi_token", None) or self.hf.image_token

    def process(
        self,
        prompt: str,
        images: list[Image.Image],
        options: dict[str, Any],
        param: str,
        add_special_tokens: bool = False,
    ) -> tuple[list[int], list[MultiModalItem]]:
        """The prompt's token ids, placeholders expanded, and its images' items. `options`:
        mm_processor_kwargs, passed to the processor as vLLM does (only the image processor's own
        settings: anything else is a 400)."""
        self._check_options(options)
        try:
            whole = self.hf(
                text=[prompt], images=[images] if images else None,
                add_special_tokens=add_special_tokens, return_tensors="np", **options,
            )  # fmt: skip
            per_image = [self._image_tensors(image, options) for image in images]
        except (ValueError, TypeError, KeyError) as e:
            raise bad_request(f"the image processor failed: {e}", param) from e
        prompt_ids = [int(t) for t in whole["input_ids"][0]]
        runs = _placeholder_runs(prompt_ids, self.placeholder_id)
        items = []
        for tensors, num_rows in per_image:
            spans, taken = [], 0
            while taken < num_rows and runs:
                start, length = runs.pop(0)
                spans.append((start, length))
                taken += length
            if taken != num_rows:
                break
            items.append(MultiModalItem("image", _content_hash(tensors), spans, tensors))
        if len(items) != len(images) or runs:
            raise bad_request(
                "the prompt's image placeholders do not match its images (does the text itself "
                f"hold {self.marker!r}?)",
                param,
            )
        return prompt_ids, items

    def _check_options(self, options: dict[str, Any]) -> None:
        known = self.hf.image_processor.to_dict()
        unknown = sorted(k for k in options if k not in known)
        if unknown:
            raise bad_request(
                f"mm_processor_kwargs: {', '.join(unknown)} is not a setting of this model's "
                f"image processor ({type(self.hf.image_processor).__name__})",
                "mm_processor_kwargs",
            )

    def _image_tensors(
        self, image: Image.Image, options: dict[str, Any]
    ) -> tuple[dict[str, TensorData], int]:
        """One image's tensors as the processor makes them for it alone, and the placeholder
        tokens it expands to."""
        out = self.hf(
            text=[self.marker], images=[[image]], add_special_tokens=False, return_tensors="np",
            **options,
        )  # fmt: skip
        num_rows = int((out["input_ids"][0] == self.placeholder_id).sum())
        tensors = {
            name: _tensor_data(np.asarray(value))
            for name, value in out.items()
            if name not in ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")
        }
        return tensors, num_rows


def _placeholder_runs(ids: list[int], placeholder: int) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for pos, token in enumerate(ids):
        if token != placeholder:
            continue
        if runs and runs[-1][0] + runs[-1][1] == pos:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((pos, 1))
    return runs


def _tensor_data(array: np.ndarray) -> TensorData:
    array = np.ascontiguousarray(array)
    return TensorData(str(array.dtype), list(array.shape), array.tobytes())


def _content_hash(tensors: dict[str, TensorData]) -> str:
    """Names the processed image: the same pixels under the same processing, the same hash."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}:{t.dtype}:{t.shape};".encode())
        h.update(t.data)
    return h.hexdigest()

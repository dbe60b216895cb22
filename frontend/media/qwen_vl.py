"""The image half of the Qwen VL processors (transformers' Qwen3VLProcessor for Qwen3-VL and
Qwen3.5, Qwen2_5_VLProcessor, Qwen2VLProcessor), for servers without torchvision: none can be built
without its video processor, which needs it, while tern takes images only. Same contract as the
processor's image path: each `<|image_pad|>` in the text, in order, becomes as many copies as its
image has merged patches (image_grid_thw's product / merge_size^2); the image processor's tensors
come back beside the ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from PIL import Image

from frontend.media.markers import expand_markers

# Checkpoints whose processor this stands in for (config.json's first architecture).
QWEN_VL_ARCHITECTURES = (
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
    "Qwen2VLForConditionalGeneration",
)


def is_qwen_vl(model_path: str | Path) -> bool:
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return False
    archs = json.loads(config.read_text()).get("architectures") or []
    return bool(archs) and archs[0] in QWEN_VL_ARCHITECTURES


class QwenVLImageProcessor:
    def __init__(self, model_path: str | Path) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer

        self.image_processor = AutoImageProcessor.from_pretrained(str(model_path))
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self.image_token = getattr(self.tokenizer, "image_token", None) or "<|image_pad|>"
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.image_token)
        self.merge_size = int(self.image_processor.merge_size)

    def __call__(
        self,
        text: list[str],
        images: list[list[Image.Image]] | None = None,
        add_special_tokens: bool = False,
        return_tensors: str = "np",
        **options: Any,
    ) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if images:
            flat = [image for group in images for image in group]
            out.update(self.image_processor(flat, return_tensors=return_tensors, **options))
            counts = [int(g.prod()) // self.merge_size**2 for g in out["image_grid_thw"]]
            text = expand_markers(text, self.image_token, [self.image_token * n for n in counts])
        ids = self.tokenizer(
            text, add_special_tokens=add_special_tokens, return_tensors=return_tensors
        )
        return {**ids, **out}

"""The image half of the Qwen VL processors (transformers' Qwen3VLProcessor for Qwen3-VL and
Qwen3.5, Qwen2_5_VLProcessor, Qwen2VLProcessor), for servers without torchvision: none can be built
without its video processor, which needs it (tern's video half: qwen_video.py). Same contract as
the processor's image path: each `<|image_pad|>` in the text, in order, becomes as many copies as
its image has merged patches (image_grid_thw's product / merge_size^2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from enginecore.model_task import QWEN_VL_ARCHITECTURES
from frontend.media.stand_in import StandInProcessor, first_architecture


def is_qwen_vl(model_path: str | Path) -> bool:
    return first_architecture(model_path) in QWEN_VL_ARCHITECTURES


class QwenVLImageProcessor(StandInProcessor):
    def __init__(self, model_path: str | Path) -> None:
        super().__init__(model_path)
        self.image_token = getattr(self.tokenizer, "image_token", None) or "<|image_pad|>"
        self.merge_size = int(self.image_processor.merge_size)

    def image_texts(self, processed: dict[str, Any]) -> list[str]:
        counts = [int(g.prod()) // self.merge_size**2 for g in processed["image_grid_thw"]]
        return [self.image_token * n for n in counts]

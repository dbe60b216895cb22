"""LLaVA-OneVision's processor (transformers' LlavaOnevisionProcessor) for servers without
torchvision, which its video processor needs: the image path's contract. The checkpoint's image
processor (its PIL backend) takes a prompt's images together, because what it makes of each depends
on the others: one image alone is "anyres" (its base view and the grid's views), each of several is
its base view only, padded to a square. Each `<image>` of the text, in order, becomes as many copies
as its image has features, counted by the processor's own methods (borrowed below, not rewritten):
the base view, the unpadded grid shrunk to the `anyres_max_N` budget, and a newline a row.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import LlavaOnevisionProcessor

from frontend.media.stand_in import StandInProcessor, first_architecture

# LlavaOnevisionProcessor.__init__'s defaults, for what processor_config.json leaves out.
_DEFAULTS = {"image_token": "<image>", "vision_aspect_ratio": "anyres_max_9"}


def is_llava_onevision(model_path: str | Path) -> bool:
    return first_architecture(model_path) == "LlavaOnevisionForConditionalGeneration"


class LlavaOnevisionImageProcessor(StandInProcessor):
    # Each image's share of its prompt's outputs depends on the prompt's other images, which the
    # image processor counts from the nesting (batch_num_images).
    processes_images_together = True

    # The processor's own counting: its methods read only the attributes set in __init__.
    replace_image_token = LlavaOnevisionProcessor.replace_image_token
    _get_number_of_features = LlavaOnevisionProcessor._get_number_of_features
    _get_unpadded_features = LlavaOnevisionProcessor._get_unpadded_features

    def __init__(self, model_path: str | Path) -> None:
        super().__init__(model_path)
        settings_file = Path(model_path) / "processor_config.json"
        settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
        settings = {**_DEFAULTS, **settings}
        self.image_token = getattr(self.tokenizer, "image_token", None) or settings["image_token"]
        self.vision_aspect_ratio = settings["vision_aspect_ratio"]
        self.vision_feature_select_strategy = settings.get("vision_feature_select_strategy")
        num_image_tokens = settings.get("num_image_tokens")
        if not isinstance(num_image_tokens, int):
            raise ValueError(f"{settings_file} names no num_image_tokens")
        self.num_image_tokens = num_image_tokens

    def image_texts(self, processed: dict[str, Any]) -> list[str]:
        return [
            self.replace_image_token(processed, i) for i in range(len(processed["image_sizes"]))
        ]

    @staticmethod
    def image_share(processed: dict[str, Any], index: int) -> dict[str, Any]:
        """Image `index`'s part of one prompt's outputs: its views and size, and how many images
        the prompt holds (the encoder takes only the base view of each of several)."""
        return {
            "pixel_values": processed["pixel_values"][index : index + 1],
            "image_sizes": processed["image_sizes"][index : index + 1],
            "batch_num_images": processed["batch_num_images"],
        }

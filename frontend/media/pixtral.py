"""Mistral 3's processor (transformers' PixtralProcessor) for servers without torchvision, which
it requires though its image processor has a PIL backend: same contract as the processor's image
path. Each image is resized to its own aspect ratio (patch_size * spatial_merge_size px a merged
token, at most the image processor's longest edge); each `[IMG]` of the text, in order, becomes
its rows of merged tokens, each row `[IMG]` * width then `[IMG_BREAK]`, the last break
`[IMG_END]`; the image processor's tensors (pixel_values, image_sizes) come back beside the ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from frontend.media.stand_in import StandInProcessor, first_architecture


def is_mistral3(model_path: str | Path) -> bool:
    return first_architecture(model_path) == "Mistral3ForConditionalGeneration"


class PixtralImageProcessor(StandInProcessor):
    def __init__(self, model_path: str | Path) -> None:
        super().__init__(model_path)
        settings_file = Path(model_path) / "processor_config.json"
        settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
        # PixtralProcessor's defaults; Mistral 3's released processor_config.json sets both.
        patch_size = int(settings.get("patch_size", 16))
        self.merged_patch = patch_size * int(settings.get("spatial_merge_size", 1))
        self.image_token = settings.get("image_token", "[IMG]")
        self.image_break_token = settings.get("image_break_token", "[IMG_BREAK]")
        self.image_end_token = settings.get("image_end_token", "[IMG_END]")

    def image_options(self, options: dict[str, Any]) -> dict[str, Any]:
        # As PixtralProcessor._process_images: the image processor's patch is a merged token.
        return {**options, "patch_size": self.merged_patch}

    def image_texts(self, processed: dict[str, Any]) -> list[str]:
        """Each image's rows (PixtralProcessor.replace_image_token)."""
        texts = []
        for height, width in processed["image_sizes"]:
            row = self.image_token * (int(width) // self.merged_patch) + self.image_break_token
            text = row * (int(height) // self.merged_patch)
            texts.append(text[: -len(self.image_break_token)] + self.image_end_token)
        return texts

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

from PIL import Image

from frontend.media.markers import expand_markers

MISTRAL3_ARCHITECTURES = ("Mistral3ForConditionalGeneration",)


def is_mistral3(model_path: str | Path) -> bool:
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return False
    archs = json.loads(config.read_text()).get("architectures") or []
    return bool(archs) and archs[0] in MISTRAL3_ARCHITECTURES


class PixtralImageProcessor:
    def __init__(self, model_path: str | Path) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer

        path = Path(model_path)
        self.image_processor = AutoImageProcessor.from_pretrained(str(path))
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        settings_file = path / "processor_config.json"
        settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
        # PixtralProcessor's defaults; Mistral 3's released processor_config.json sets both.
        self.patch_size = int(settings.get("patch_size", 16))
        self.spatial_merge_size = int(settings.get("spatial_merge_size", 1))
        self.image_token = settings.get("image_token", "[IMG]")
        self.image_break_token = settings.get("image_break_token", "[IMG_BREAK]")
        self.image_end_token = settings.get("image_end_token", "[IMG_END]")

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
            # As PixtralProcessor._process_images: a merged token's side in pixels.
            options = {**options, "patch_size": self.patch_size * self.spatial_merge_size}
            out.update(self.image_processor(flat, return_tensors=return_tensors, **options))
            runs = [self._run(int(h), int(w)) for h, w in out["image_sizes"]]
            text = expand_markers(text, self.image_token, runs)
        ids = self.tokenizer(
            text, add_special_tokens=add_special_tokens, return_tensors=return_tensors
        )
        return {**ids, **out}

    def _run(self, height: int, width: int) -> str:
        """An image's text (PixtralProcessor.replace_image_token)."""
        side = self.patch_size * self.spatial_merge_size
        row = self.image_token * (width // side) + self.image_break_token
        text = row * (height // side)
        return text[: -len(self.image_break_token)] + self.image_end_token

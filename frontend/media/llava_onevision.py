"""LLaVA-OneVision's processor (transformers' LlavaOnevisionProcessor) for servers without
torchvision, which its video processor needs: the image path's contract. The checkpoint's image
processor (its PIL backend) takes a prompt's images together, because what it makes of each depends
on the others: one image alone is "anyres" (its base view and the grid's views), each of several is
its base view only, padded to a square. Each `<image>` of the text, in order, becomes as many copies
as its image has features, counted by the processor's own methods (borrowed below, not rewritten):
the base view, the unpadded grid shrunk to the `anyres_max_N` budget, and a newline a row.

Videos (LlavaOnevisionVideoProcessor's arithmetic): every frame resized to the processor's size
(384 x 384 as released), bicubic with antialiasing on the uint8 frames, rescaled and normalised:
`pixel_values_videos` (1, F, 3, S, S). Its `<video>` becomes F * ceil(side / 2)^2 + 1 copies (each
frame's patches pooled 2x2, then one newline). The processor samples no frames itself
(`do_sample_frames` is off as released): the frames are chosen as vLLM's video loader chooses
them, 32 spread evenly over the video (np.linspace, truncated), or a request's `num_frames`, or
`fps` frames a second.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import LlavaOnevisionProcessor

from frontend.media.stand_in import StandInProcessor, first_architecture
from frontend.media.video import FrameSampler, Video, resized_pixels

# LlavaOnevisionProcessor.__init__'s defaults, for what processor_config.json leaves out.
_DEFAULTS = {"image_token": "<image>", "video_token": "<video>",
             "vision_aspect_ratio": "anyres_max_9"}  # fmt: skip
# LlavaOnevisionVideoProcessor's class attributes.
_VIDEO_DEFAULTS = {"size": {"height": 384, "width": 384}, "rescale_factor": 1 / 255,
                   "image_mean": [0.48145466, 0.4578275, 0.40821073],
                   "image_std": [0.26862954, 0.26130258, 0.27577711]}  # fmt: skip
# vLLM's video loader's frame count (VideoMediaIO's num_frames).
DEFAULT_NUM_FRAMES = 32


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
        self.video_token = getattr(self.tokenizer, "video_token", None) or settings["video_token"]
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


class LlavaOnevisionVideoProcessor:
    """The video half (module docstring): which frames, their tensors, the text of `<video>`."""

    def __init__(self, model_path: str | Path, patches_per_side: int) -> None:
        settings = dict(_VIDEO_DEFAULTS)
        for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
            path = Path(model_path) / name
            if path.is_file():  # transformers' fallback: the image processor's settings
                settings.update(json.loads(path.read_text()))
                break
        size = settings["size"]
        if "height" not in size or "width" not in size:
            raise ValueError(f"a video size of height and width expected, not {size}")
        self.size = (int(size["height"]), int(size["width"]))
        scale = 1.0 / float(settings["rescale_factor"])
        self.mean = torch.tensor(settings["image_mean"], dtype=torch.float32) * scale
        self.std = torch.tensor(settings["image_std"], dtype=torch.float32) * scale
        self.tokens_per_frame = math.ceil(patches_per_side / 2) ** 2

    def sampler(self, options: dict[str, Any]) -> FrameSampler:
        """The frame indices to keep (options: a request's `fps` or `num_frames`, checked by
        the caller)."""
        fps, wanted = options.get("fps"), options.get("num_frames", DEFAULT_NUM_FRAMES)

        def sample(total: int, video_fps: float) -> np.ndarray:
            count = max(1, int(total / video_fps * fps)) if fps is not None else wanted
            if total <= count:
                return np.arange(total)
            return np.linspace(0, total - 1, count, dtype=int)

        return sample

    def process(
        self, video: Video, video_token: str, vision_start: str, vision_end: str
    ) -> tuple[dict[str, np.ndarray], str]:
        """One video's tensors and the text its `<video>` becomes (LLaVA-OneVision writes no
        start or end tokens around it: `vision_start` and `vision_end` are not used)."""
        pixels = resized_pixels(video.frames, self.size, self.mean, self.std)
        text = video_token * (len(pixels) * self.tokens_per_frame + 1)
        return {"pixel_values_videos": pixels[None].numpy()}, text

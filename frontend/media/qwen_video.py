"""The video half of the Qwen VL processors (transformers' Qwen2VLVideoProcessor for Qwen2-VL and
Qwen2.5-VL, Qwen3VLVideoProcessor for Qwen3-VL and Qwen3.5), for servers without torchvision,
which both need: the frames to sample, their resizing, normalisation and patches, and the text
each `<|video_pad|>` of a prompt becomes. Same arithmetic as transformers 5's classes, step by step:

- frames: Qwen3's sample `fps` frames a second (np.linspace over the video, at least min_frames);
  Qwen2's processor takes every frame unless told to sample (do_sample_frames), which a server
  cannot afford on a 30 fps video: tern samples them at 2 frames a second, qwen-vl-utils' rate
  (the reference these models were trained with), by Qwen2VLVideoProcessor.sample_frames.
- size: every frame resized to one (h, w), multiples of patch_size * merge_size, by the family's
  smart_resize (Qwen3's bounds the pixels of all frames together); bicubic with antialiasing on
  the uint8 frames, which is what torchvision's resize runs on a CPU; then (x - 255 mean) /
  (255 std) in float32, the processors' fused rescale and normalise.
- patches: the frames padded to a multiple of temporal_patch_size with the last one, cut into
  (t, h, w) patches in merge-block order: `pixel_values_videos` (t h w, C T P P), `video_grid_thw`.
- text: Qwen2's is one run of t h w / merge^2 `<|video_pad|>`; Qwen3's, for each temporal patch,
  its timestamp ("<1.3 seconds>": the mean time of its frames) and its own
  `<|vision_start|>` run `<|vision_end|>`. Qwen2.5-VL also takes `second_per_grid_ts`
  (temporal_patch_size / the sampled frame rate), which spaces its rotary time positions.

The settings come from the checkpoint's video_preprocessor_config.json, else its
preprocessor_config.json (as transformers falls back), over each class's defaults.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from frontend.media.video import Video, resized_pixels

_OPENAI_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_OPENAI_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
# Qwen2VLVideoProcessor's and Qwen3VLVideoProcessor's class attributes.
_DEFAULTS = {
    "qwen2": {"size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768},
              "image_mean": _OPENAI_CLIP_MEAN, "image_std": _OPENAI_CLIP_STD, "patch_size": 14,
              "temporal_patch_size": 2, "merge_size": 2, "min_frames": 4, "max_frames": 768,
              "fps": 2.0, "rescale_factor": 1 / 255},
    "qwen3": {"size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768},
              "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "patch_size": 16,
              "temporal_patch_size": 2, "merge_size": 2, "min_frames": 4, "max_frames": 768,
              "fps": 2.0, "rescale_factor": 1 / 255},
}  # fmt: skip
_QWEN3_ARCHITECTURES = (
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
)
# What a request's mm_processor_kwargs may set about its videos (transformers' VideosKwargs).
VIDEO_OPTIONS = ("fps", "num_frames")


class QwenVideoProcessor:
    def __init__(self, model_path: str | Path, architecture: str) -> None:
        self.family = "qwen3" if architecture in _QWEN3_ARCHITECTURES else "qwen2"
        self.second_per_grid_ts = architecture == "Qwen2_5_VLForConditionalGeneration"
        settings = dict(_DEFAULTS[self.family])
        for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
            path = Path(model_path) / name
            if path.is_file():
                settings.update(json.loads(path.read_text()))
                break
        size = dict(settings["size"])
        if settings.get("min_pixels") is not None:  # the older names of the two bounds
            size["shortest_edge"] = settings["min_pixels"]
        if settings.get("max_pixels") is not None:
            size["longest_edge"] = settings["max_pixels"]
        self.min_pixels, self.max_pixels = int(size["shortest_edge"]), int(size["longest_edge"])
        self.patch_size = int(settings["patch_size"])
        self.temporal_patch_size = int(settings["temporal_patch_size"])
        self.merge_size = int(settings["merge_size"])
        self.min_frames, self.max_frames = int(settings["min_frames"]), int(settings["max_frames"])
        self.fps = float(settings.get("fps") or 2.0)
        scale = 1.0 / float(settings["rescale_factor"])
        self.mean = torch.tensor(settings["image_mean"], dtype=torch.float32) * scale
        self.std = torch.tensor(settings["image_std"], dtype=torch.float32) * scale

    def sampler(self, options: dict[str, Any]):
        """The frame indices to keep of a video of `num_frames` at `video_fps` (options: a
        request's `fps` or `num_frames`, checked by the caller)."""
        fps = options.get("fps")
        num_frames = options.get("num_frames")
        if fps is None and num_frames is None:
            fps = self.fps

        def sample(total: int, video_fps: float) -> np.ndarray:
            if self.family == "qwen3":
                return self._sample_qwen3(total, video_fps, fps, num_frames)
            return self._sample_qwen2(total, video_fps, fps, num_frames)

        return sample

    def _sample_qwen3(
        self, total: int, video_fps: float, fps: float | None, num_frames: int | None
    ) -> np.ndarray:
        """Qwen3VLVideoProcessor.sample_frames."""
        if num_frames is None:
            num_frames = int(total / video_fps * fps)
            num_frames = min(max(num_frames, self.min_frames), self.max_frames, total)
        num_frames = min(num_frames, total)
        return np.linspace(0, total - 1, num_frames).round().astype(int)

    def _sample_qwen2(
        self, total: int, video_fps: float, fps: float | None, num_frames: int | None
    ) -> np.ndarray:
        """Qwen2VLVideoProcessor.sample_frames; a video shorter than one temporal patch keeps
        its frames (the last is repeated to fill the patch)."""
        step = self.temporal_patch_size
        if num_frames is not None:
            num_frames = round(num_frames / step) * step
        else:
            most = math.floor(min(self.max_frames, total) / step) * step
            num_frames = min(max(total / video_fps * fps, self.min_frames), most, total)
            num_frames = math.floor(num_frames / step) * step
        if num_frames < 1:
            return np.arange(total)
        num_frames = min(num_frames, total)
        return torch.arange(0, total, total / num_frames).int().numpy()

    def process(
        self, video: Video, video_token: str, vision_start: str, vision_end: str
    ) -> tuple[dict[str, np.ndarray], str]:
        """One video's tensors and the text its `<|video_pad|>` becomes."""
        num_frames, height, width, _ = video.frames.shape
        size = self._resize_to(num_frames, height, width)
        pixels = resized_pixels(video.frames, size, self.mean, self.std)
        patches, grid = self._patchify(pixels)
        tensors: dict[str, np.ndarray] = {
            "pixel_values_videos": patches.numpy(),
            "video_grid_thw": np.asarray([grid], dtype=np.int64),
        }
        t, h, w = grid
        frame_tokens = h * w // self.merge_size**2
        if self.second_per_grid_ts:
            sampled_fps = video.sampled_fps
            seconds = self.temporal_patch_size / sampled_fps
            tensors["second_per_grid_ts"] = np.asarray([seconds], dtype=np.float32)
        if self.family == "qwen2":
            return tensors, video_token * (t * frame_tokens)
        text = "".join(
            f"<{stamp:.1f} seconds>{vision_start}{video_token * frame_tokens}{vision_end}"
            for stamp in self._timestamps(video)[:t]
        )
        return tensors, text

    def _resize_to(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        factor = self.patch_size * self.merge_size
        if self.family == "qwen3":
            return qwen3_smart_resize(
                num_frames, height, width, self.temporal_patch_size, factor,
                self.min_pixels, self.max_pixels,
            )  # fmt: skip
        return qwen2_smart_resize(height, width, factor, self.min_pixels, self.max_pixels)

    def _patchify(self, videos: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """(T, C, H, W) -> (t h w, C T P P) patches in merge-block order, and (t, h, w)."""
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        if pad := -videos.shape[0] % tp:
            videos = torch.cat((videos, videos[-1:].expand(pad, -1, -1, -1)))
        num_frames, channels, height, width = videos.shape
        t, h, w = num_frames // tp, height // p, width // p
        patches = videos.view(t, tp, channels, h // m, m, p, w // m, m, p)
        patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return patches.reshape(t * h * w, channels * tp * p * p).contiguous(), (t, h, w)

    def _timestamps(self, video: Video) -> list[float]:
        """Each temporal patch's time: the mean of its first and last frames' (Qwen3VLProcessor's
        _calculate_timestamps)."""
        indices = [int(i) for i in video.indices]
        step = self.temporal_patch_size
        indices += [indices[-1]] * (-len(indices) % step)
        stamps = [i / video.fps for i in indices]
        return [(stamps[i] + stamps[i + step - 1]) / 2 for i in range(0, len(stamps), step)]


def qwen2_smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """transformers' qwen2_vl smart_resize: (h, w) multiples of `factor`, h w in [min, max]."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"the aspect ratio {max(height, width) / min(height, width):.0f} is above 200"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def qwen3_smart_resize(
    num_frames: int,
    height: int,
    width: int,
    temporal_factor: int,
    factor: int,
    min_pixels: int,
    max_pixels: int,
) -> tuple[int, int]:
    """transformers' qwen3_vl video smart_resize: the bounds are on all frames' pixels."""
    if num_frames < temporal_factor:
        raise ValueError(f"a video needs at least {temporal_factor} frames, not {num_frames}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"the aspect ratio {max(height, width) / min(height, width):.0f} is above 200"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar

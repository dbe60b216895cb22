"""Prompts with images, made as the checkpoint's own Hugging Face processor makes them: the chat
template's text with one image marker per image goes through `AutoProcessor` (or tern's stand-in
where the processor requires torchvision: frontend/media/stand_in.py), which expands each marker
into the model's placeholder tokens; each image's tensors (pixel_values, ...) become a
MultiModalItem with the runs of placeholders its encoder output fills and a hash of its tensors.
The Qwen VL checkpoints and LLaVA-OneVision take videos too (frontend/media/qwen_video.py,
llava_onevision.py): each video marker becomes its video's text first, and each video is an item
of its own.

The tensors travel to the workers as raw bytes in msgspec messages (enginecore/messages.py
TensorData), never pickled.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from enginecore.messages import MultiModalItem, TensorData
from frontend.common.errors import bad_request
from frontend.media.llava_onevision import (
    LlavaOnevisionImageProcessor,
    LlavaOnevisionVideoProcessor,
    is_llava_onevision,
)
from frontend.media.pixtral import PixtralImageProcessor, is_mistral3
from frontend.media.qwen_video import VIDEO_OPTIONS, QwenVideoProcessor
from frontend.media.qwen_vl import QwenVLImageProcessor, is_qwen_vl
from frontend.media.stand_in import expand_markers
from frontend.media.video import Video

# Image-processor settings a request may not set: where the outputs go and in what form.
_RESERVED_OPTIONS = ("return_tensors", "device", "data_format", "input_data_format")
# The largest number a request's mm_processor_kwargs may hold (sizes in pixels, crop counts).
MAX_OPTION_SIZE = 4096


class ImageProcessor:
    """The checkpoint's processor (its preprocessor_config.json and processor_config.json)."""

    def __init__(self, model_path: str | Path) -> None:
        from transformers import AutoProcessor  # only servers of image models pay for its import

        try:
            # Processors that need torchvision (none has a build for this torch) are tern's own.
            if is_qwen_vl(model_path):
                self.hf = QwenVLImageProcessor(model_path)
            elif is_mistral3(model_path):
                self.hf = PixtralImageProcessor(model_path)
            elif is_llava_onevision(model_path):
                self.hf = LlavaOnevisionImageProcessor(model_path)
            else:
                self.hf = AutoProcessor.from_pretrained(str(model_path))
        except Exception as e:
            raise ValueError(f"cannot load the image processor of {model_path}: {e}") from e
        # The token the model's encoder rows replace: config.json's, as the model reads it (a
        # processor's image_token_id may name the begin-of-image marker instead).
        config = json.loads((Path(model_path) / "config.json").read_text())
        placeholder = config.get("image_token_id", config.get("image_token_index"))
        if not isinstance(placeholder, int):
            raise ValueError(f"{model_path}/config.json names no image_token_id")
        self.placeholder_id = placeholder
        # The text that stands for one image in a prompt (Gemma 3's processor expands its
        # begin-of-image token; LLaVA's and Qwen's their image token, which Qwen's chat template
        # writes between <|vision_start|> and <|vision_end|>).
        self.marker = getattr(self.hf, "boi_token", None) or self.hf.image_token
        # Videos: the Qwen VL checkpoints' and LLaVA-OneVision's (their config.json names the
        # video placeholder).
        self.video: QwenVideoProcessor | LlavaOnevisionVideoProcessor | None = None
        if isinstance(self.hf, QwenVLImageProcessor) and "video_token_id" in config:
            self.video = QwenVideoProcessor(model_path, config["architectures"][0])
            self.video_placeholder_id = int(config["video_token_id"])
        elif isinstance(self.hf, LlavaOnevisionImageProcessor) and "video_token_index" in config:
            vision = config.get("vision_config") or {}  # LlavaOnevisionConfig's SigLIP defaults
            side = int(vision.get("image_size", 384)) // int(vision.get("patch_size", 14))
            self.video = LlavaOnevisionVideoProcessor(model_path, side)
            self.video_placeholder_id = int(config["video_token_index"])

    def video_options(self, options: dict[str, Any] | None, param: str) -> dict[str, Any]:
        """The part of a request's mm_processor_kwargs that says how to sample its videos."""
        chosen = {k: v for k, v in (options or {}).items() if k in VIDEO_OPTIONS}
        if "fps" in chosen and "num_frames" in chosen:
            raise bad_request("mm_processor_kwargs: fps and num_frames exclude each other", param)
        fps, num_frames = chosen.get("fps"), chosen.get("num_frames")
        if fps is not None and (not isinstance(fps, (int, float)) or not 0 < fps <= 60):
            raise bad_request("mm_processor_kwargs: fps must be a number in (0, 60]", param)
        if num_frames is not None and (
            not isinstance(num_frames, int) or not 1 <= num_frames <= 768
        ):
            raise bad_request(
                "mm_processor_kwargs: num_frames must be an integer in [1, 768]", param
            )
        return chosen

    def process(
        self,
        prompt: str,
        images: list[Image.Image],
        options: dict[str, Any],
        param: str,
        add_special_tokens: bool = False,
        videos: Sequence[Video] = (),
    ) -> tuple[list[int], list[MultiModalItem]]:
        """The prompt's token ids, placeholders expanded, and its images' and videos' items.
        `options`: mm_processor_kwargs, passed to the processor as vLLM does (only the image
        processor's own settings and the videos' sampling: anything else is a 400)."""
        if self.video is not None:  # its videos' sampling is no image processor setting
            options = {k: v for k, v in options.items() if k not in VIDEO_OPTIONS}
        self._check_options(options)
        per_video: list[tuple[dict[str, TensorData], int]] = []
        if videos:
            prompt, per_video = self._expand_videos(prompt, videos, param)
        # NOTE: SGLang refuses more markers than images but drops images beyond the markers
        # with a warning (base_processor.py submit_data_loading_tasks); both are refused here:
        # a dropped image would give an answer about a picture the model never saw.
        check_markers(prompt, self.marker, len(images), "image", param)
        try:
            whole = self.hf(
                text=[prompt], images=[images] if images else None,
                add_special_tokens=add_special_tokens, return_tensors="np", **options,
            )  # fmt: skip
            per_image = self._per_image(images, options, whole)
        except (ValueError, TypeError, KeyError) as e:
            raise bad_request(f"the image processor failed: {e}", param) from e
        prompt_ids = [int(t) for t in whole["input_ids"][0]]
        items = self._match_runs(prompt_ids, per_image)
        video_items = (
            self._match_runs(prompt_ids, per_video, self.video_placeholder_id, "video")
            if per_video
            else []
        )
        if items is None or video_items is None:
            raise bad_request(
                "the prompt's image placeholders do not match its images (does the text itself "
                f"hold {self.marker!r}?)",
                param,
            )
        return prompt_ids, _in_prompt_order(items, video_items)

    def items_for_ids(
        self,
        ids: list[int],
        images: list[Image.Image],
        options: dict[str, Any],
        param: str,
        videos: Sequence[Video] = (),
    ) -> list[MultiModalItem]:
        """The items of `images` (and `videos`) in token ids some other processor already
        expanded (an RL trainer's own HF processor): the ids are kept as they are, each image
        (video) takes the next placeholder runs its tensors fill, in order. Any mismatch between
        the placeholders and the items is a 400 naming `param`."""
        self._check_options(options)
        try:
            per_image = self._per_image(images, options)
        except (ValueError, TypeError, KeyError) as e:
            raise bad_request(f"the image processor failed: {e}", param) from e
        items = self._match_runs(ids, per_image)
        if items is None:
            raise self._mismatch(ids, per_image, self.placeholder_id, "image", param)
        if not videos:
            return items
        per_video = [(tensors, n) for tensors, n, _ in self._processed_videos(videos, param)]
        video_items = self._match_runs(ids, per_video, self.video_placeholder_id, "video")
        if video_items is None:
            raise self._mismatch(ids, per_video, self.video_placeholder_id, "video", param)
        return _in_prompt_order(items, video_items)

    @staticmethod
    def _mismatch(
        ids: list[int],
        per_item: list[tuple[dict[str, TensorData], int]],
        placeholder: int,
        kind: str,
        param: str,
    ) -> Exception:
        found = sum(length for _, length in placeholder_runs(ids, placeholder))
        needed = sum(num_rows for _, num_rows in per_item)
        return bad_request(
            f"the token ids hold {found} {kind} placeholders (token {placeholder}) but the "
            f"{len(per_item)} {kind}(s) need {needed}: the ids must be expanded by this model's "
            f"processor, the placeholder runs of each {kind} in order",
            param,
        )

    def _expand_videos(
        self, prompt: str, videos: Sequence[Video], param: str
    ) -> tuple[str, list[tuple[dict[str, TensorData], int]]]:
        """The prompt with each video marker replaced by its video's text, and each video's
        tensors and placeholder count."""
        check_markers(prompt, self._video_marker(), len(videos), "video", param)
        processed = self._processed_videos(videos, param)
        texts = [text for _, _, text in processed]
        prompt = expand_markers([prompt], self._video_marker(), texts)[0]
        return prompt, [(tensors, n) for tensors, n, _ in processed]

    def _processed_videos(
        self, videos: Sequence[Video], param: str
    ) -> list[tuple[dict[str, TensorData], int, str]]:
        """Each video's tensors, placeholder count and text."""
        assert self.video is not None, "videos are only loaded where the model takes them"
        tokenizer, marker = self.hf.tokenizer, self._video_marker()
        start = getattr(tokenizer, "vision_start_token", None) or "<|vision_start|>"
        end = getattr(tokenizer, "vision_end_token", None) or "<|vision_end|>"
        out = []
        for video in videos:
            try:
                arrays, text = self.video.process(video, marker, start, end)
            except ValueError as e:
                raise bad_request(f"the video processor failed: {e}", param) from e
            tensors = {name: tensor_data(a) for name, a in arrays.items()}
            out.append((tensors, text.count(marker), text))
        return out

    def _video_marker(self) -> str:
        return (
            getattr(self.hf, "video_token", None)
            or getattr(self.hf.tokenizer, "video_token", None)
            or "<|video_pad|>"
        )

    def _match_runs(
        self,
        ids: list[int],
        per_image: list[tuple[dict[str, TensorData], int]],
        placeholder_id: int | None = None,
        modality: str = "image",
    ) -> list[MultiModalItem] | None:
        """One item per image (video), each over its number of the next placeholders (a run may
        hold several images': LLaVA-OneVision's template writes a turn's images side by side);
        None when the placeholders and the items' counts differ."""
        placeholder = self.placeholder_id if placeholder_id is None else placeholder_id
        runs = placeholder_runs(ids, placeholder)
        items = []
        for tensors, num_rows in per_image:
            spans, taken = [], 0
            while taken < num_rows and runs:
                start, length = runs[0]
                take = min(length, num_rows - taken)
                spans.append((start, take))
                taken += take
                if take < length:
                    runs[0] = (start + take, length - take)
                else:
                    runs.pop(0)
            if taken != num_rows:
                return None
            items.append(MultiModalItem(modality, content_hash(tensors), spans, tensors))
        return None if runs else items

    def _check_options(self, options: dict[str, Any]) -> None:
        """mm_processor_kwargs may set what the image processor takes per call, but not where
        its outputs go, nor sizes that would make one request's tensors huge."""
        image_processor = self.hf.image_processor
        valid = getattr(getattr(image_processor, "valid_kwargs", None), "__annotations__", {})
        unknown = sorted(k for k in options if k not in valid or k in _RESERVED_OPTIONS)
        if unknown:
            raise bad_request(
                f"mm_processor_kwargs: {', '.join(unknown)} is not a setting of this model's "
                f"image processor ({type(image_processor).__name__})",
                "mm_processor_kwargs",
            )
        if _largest_int(options) > MAX_OPTION_SIZE:
            raise bad_request(
                f"mm_processor_kwargs: sizes above {MAX_OPTION_SIZE} are not served",
                "mm_processor_kwargs",
            )

    def _per_image(
        self,
        images: list[Image.Image],
        options: dict[str, Any],
        processed: dict[str, Any] | None = None,
    ) -> list[tuple[dict[str, TensorData], int]]:
        """Each image's tensors and placeholder count: what the processor makes of it alone, or,
        where that depends on the prompt's other images (LLaVA-OneVision), its share of what the
        processor made of them all (`processed`: the prompt's own call, else one made here)."""
        if not getattr(self.hf, "processes_images_together", False):
            return [self._image_tensors(image, options) for image in images]
        if not images:
            return []
        if processed is None:
            processed = self.hf(
                text=[self.marker * len(images)], images=[images], add_special_tokens=False,
                return_tensors="np", **options,
            )  # fmt: skip
        counts = [text.count(self.hf.image_token) for text in self.hf.image_texts(processed)]
        return [
            ({name: tensor_data(np.asarray(v))
              for name, v in self.hf.image_share(processed, i).items()}, count)
            for i, count in enumerate(counts)
        ]  # fmt: skip

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
            name: tensor_data(np.asarray(value))
            for name, value in out.items()
            if name not in ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")
        }
        return tensors, num_rows


def _in_prompt_order(*kinds: list[MultiModalItem]) -> list[MultiModalItem]:
    """Images' and videos' items as their placeholders come in the prompt."""
    return sorted((item for items in kinds for item in items), key=lambda item: item.spans[0][0])


def _largest_int(value: Any) -> int:
    if isinstance(value, dict):
        return max(map(_largest_int, value.values()), default=0)
    if isinstance(value, (list, tuple)):
        return max(map(_largest_int, value), default=0)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def check_markers(prompt: str, marker: str, num_items: int, kind: str, param: str) -> None:
    """A 400 unless the prompt holds the item marker once per item (image or audio)."""
    num_markers = prompt.count(marker)
    if num_markers != num_items:
        raise bad_request(
            f"the prompt holds {num_markers} {kind} marker(s) {marker!r} for {num_items} "
            f"{kind}(s): put one marker where each {kind} goes",
            param,
        )


def placeholder_runs(ids: list[int], placeholder: int) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for pos, token in enumerate(ids):
        if token != placeholder:
            continue
        if runs and runs[-1][0] + runs[-1][1] == pos:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((pos, 1))
    return runs


def tensor_data(array: np.ndarray) -> TensorData:
    array = np.ascontiguousarray(array)
    return TensorData(str(array.dtype), list(array.shape), array.tobytes())


def content_hash(tensors: dict[str, TensorData]) -> str:
    """Names the processed image: the same pixels under the same processing, the same hash."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}:{t.dtype}:{t.shape};".encode())
        h.update(t.data)
    return h.hexdigest()

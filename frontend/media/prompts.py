"""A chat prompt's images and videos from request to engine: the media parts' URLs (collected in
order by frontend/common/decoding.py), checked against --limit-mm-per-prompt, fetched or decoded
under the server's media policy (a video's frames sampled as the model's processor samples them),
and processed with the prompt's text (processing.py)."""

from __future__ import annotations

import asyncio
from typing import Any

from PIL import Image

from enginecore.messages import MultiModalItem
from frontend.common.decoding import MediaRef
from frontend.media.images import decode_image
from frontend.media.limits import check_limits
from frontend.media.policy import MediaPolicy
from frontend.media.processing import ImageProcessor
from frontend.media.sources import load_media_bytes
from frontend.media.video import Video, decode_video


class ImagePrompts:
    """The server's image path: its media policy and the model's processor."""

    def __init__(self, processor: ImageProcessor, policy: MediaPolicy) -> None:
        self.processor = processor
        self.policy = policy

    async def make(
        self,
        text: str,
        refs: list[MediaRef],
        options: dict[str, Any] | None,
        param: str,
        add_special_tokens: bool = False,
    ) -> tuple[list[int], list[MultiModalItem]]:
        """The prompt's token ids (placeholders expanded) and its images' and videos' items.
        `text` is the chat template's output, with one marker per ref; `options`:
        mm_processor_kwargs."""
        images, videos = await self.load(refs, options, param)
        # NOTE: off the event loop: preprocessing an image takes milliseconds of CPU.
        return await asyncio.to_thread(
            self.processor.process, text, images, options or {}, param, add_special_tokens,
            videos,
        )  # fmt: skip

    @property
    def takes_video(self) -> bool:
        return self.processor.video is not None

    async def make_for_generate(
        self, prompt: str | list[int], refs: list[MediaRef], param: str
    ) -> tuple[list[int], list[MultiModalItem]]:
        """A /generate prompt (SGLang's, LMDeploy's) with images (and SGLang's with videos): text
        holds one marker per image (video) and is processed as a chat prompt is, special tokens
        added as both servers tokenize their text; token ids were expanded by another HF
        processor (an RL trainer's) and are kept as they are, the items filling their
        placeholder runs (ImageProcessor.items_for_ids)."""
        if isinstance(prompt, str):
            return await self.make(prompt, refs, None, param, add_special_tokens=True)
        images, videos = await self.load(refs, None, param)
        items = await asyncio.to_thread(
            self.processor.items_for_ids, prompt, images, {}, param, videos
        )
        return prompt, items

    async def load(
        self, refs: list[MediaRef], options: dict[str, Any] | None, param: str
    ) -> tuple[list[Image.Image], list[Video]]:
        """One prompt's images and videos, counted against --limit-mm-per-prompt, fetched or
        decoded (a video's frames sampled as the model's processor samples them, or as
        `options` ask)."""
        image_refs = [ref for ref in refs if ref.modality != "video"]
        video_refs = [ref for ref in refs if ref.modality == "video"]
        check_limits({"image": len(image_refs), "video": len(video_refs)}, self.policy, param)
        images = []
        for ref in image_refs:
            data = await load_media_bytes(ref.url, self.policy, ref.param)
            images.append(await asyncio.to_thread(decode_image, data, self.policy, ref.param))
        videos = []
        if video_refs:
            video = self.processor.video
            assert video is not None, "video parts are only collected where the model takes them"
            sample = video.sampler(self.processor.video_options(options, "mm_processor_kwargs"))
            for ref in video_refs:
                data = await load_media_bytes(ref.url, self.policy, ref.param)
                videos.append(
                    await asyncio.to_thread(decode_video, data, sample, self.policy, ref.param)
                )
        return images, videos

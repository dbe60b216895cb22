"""A chat prompt's audio from request to engine, for an audio-language model (Qwen2-Audio): the
audio parts (input_audio's base64 bytes, audio_url's data:, file: and http(s) URLs under the same
allow-lists as images) counted against --limit-mm-per-prompt, loaded, decoded to 16 kHz mono
(decoding.py) and processed with the prompt's text as the checkpoint's own Hugging Face processor
does: each `<|AUDIO|>` marker the chat template wrote expands into the audio's run of
placeholders, and each audio becomes a MultiModalItem (its log-mel features and their mask, the
run it fills, a hash of its tensors: the prefix cache and the workers' encoder cache key it)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import numpy as np

from enginecore.messages import MultiModalItem
from frontend.audio.decoding import AudioError, decode_audio
from frontend.audio.speech import SAMPLE_RATE, WINDOW_SECONDS
from frontend.common.decoding import MediaRef
from frontend.common.errors import APIError, bad_request
from frontend.media.limits import check_limits
from frontend.media.policy import MediaPolicy
from frontend.media.processing import (
    check_markers,
    content_hash,
    placeholder_runs,
    tensor_data,
)
from frontend.media.sources import load_media_bytes


class AudioProcessor:
    """The checkpoint's processor (Qwen2AudioProcessor: a Whisper feature extractor and the
    tokenizer) and the placeholder its audio tower's rows replace (config.json's)."""

    def __init__(self, model_path: str | Path) -> None:
        from transformers import AutoProcessor

        try:
            self.hf = AutoProcessor.from_pretrained(str(model_path))
        except Exception as e:
            raise ValueError(f"cannot load the audio processor of {model_path}: {e}") from e
        config = json.loads((Path(model_path) / "config.json").read_text())
        self.placeholder_id = int(config.get("audio_token_index", config.get("audio_token_id")))
        self.marker = self.hf.audio_token

    def process(
        self, prompt: str, audios: list[np.ndarray], param: str
    ) -> tuple[list[int], list[MultiModalItem]]:
        check_markers(prompt, self.marker, len(audios), "audio", param)
        try:
            whole = self.hf(
                text=[prompt], audio=audios or None, sampling_rate=SAMPLE_RATE,
                return_tensors="np",
            )  # fmt: skip
        except (ValueError, TypeError, KeyError) as e:
            raise bad_request(f"the audio processor failed: {e}", param) from e
        ids = [int(t) for t in whole["input_ids"][0]]
        runs = placeholder_runs(ids, self.placeholder_id)
        if len(runs) != len(audios):
            raise bad_request("the prompt's audio placeholders do not match its audios", param)
        items = []
        for i, (start, length) in enumerate(runs):
            tensors = {
                "input_features": tensor_data(whole["input_features"][i : i + 1]),
                "feature_attention_mask": tensor_data(whole["feature_attention_mask"][i : i + 1]),
            }
            items.append(MultiModalItem("audio", content_hash(tensors), [(start, length)], tensors))
        return ids, items


class AudioPrompts:
    """The server's audio-in-chat path: its media policy and the model's processor."""

    def __init__(self, processor: AudioProcessor, policy: MediaPolicy) -> None:
        self.processor = processor
        # An audio's bytes are capped as an audio file is (--max-audio-filesize-mb).
        self.policy = dataclasses.replace(policy, max_image_bytes=policy.max_audio_bytes)

    async def make(
        self, text: str, refs: list[MediaRef], param: str
    ) -> tuple[list[int], list[MultiModalItem]]:
        """The prompt's token ids (placeholders expanded) and its audios' items. `text` is the
        chat template's output, with one audio marker per ref."""
        check_limits({"audio": len(refs)}, self.policy, param)
        audios = []
        for ref in refs:
            data = await load_media_bytes(ref.url, self.policy, ref.param)
            try:
                samples = await asyncio.to_thread(
                    decode_audio, data, SAMPLE_RATE, self.policy.max_audio_seconds
                )
            except AudioError as e:
                raise APIError(str(e), e.status, ref.param) from None
            if len(samples) > WINDOW_SECONDS * SAMPLE_RATE:
                raise bad_request(
                    f"an audio lasts {len(samples) / SAMPLE_RATE:.1f} s; this model hears at "
                    f"most {WINDOW_SECONDS:.0f} s per audio",
                    ref.param,
                )
            audios.append(samples)
        # NOTE: off the event loop: log-mel features take milliseconds of CPU.
        return await asyncio.to_thread(self.processor.process, text, audios, param)

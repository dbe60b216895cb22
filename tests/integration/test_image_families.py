"""Image families beyond LLaVA, through a real server, against Hugging Face: each tiny random
checkpoint (its processor saved beside it) answers chat requests with one and with two images,
each greedy answer token for token the one its `*ForConditionalGeneration.generate` gives in
float32, from the same prompt (as many prompt tokens: the placeholders laid out alike).

- idefics3 (SmolVLM's layout): an image is its tiles (`<fake_token_around_image><row_r_col_c>`
  then 4 `<image>`s each) and then the whole image (`<global-img>` then 4 more); the images below
  are 1 x 2 and 2 x 2 tiles.
- mistral3_vl (Mistral 3 / Ministral 3's layout): an image at its own aspect ratio, its rows of
  `[IMG]` each ended by `[IMG_BREAK]`, the last by `[IMG_END]` (up to 4 x 4 merged tokens here),
  through the Pixtral tower and the 2x2 patch merger.
- llava_onevision: one image alone is "anyres" (its base view, then a grid of up to 2 x 2 views
  unpadded and shrunk, a newline a row: 44 features for a 40 x 56 image); each of two is its base
  view padded to a square and a newline (17). The chat template writes a turn's images side by
  side, so two images are one run of placeholders that the processor's counts divide.

The server computes prompts in chunks of 32 tokens, so chunks split images; both are served at
`--tp 2 --pp 2` too. Two different images
give different answers, so no test passes with the image ignored."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from PIL import Image

from tests.conftest import make_tiny_model
from tests.integration.conftest import FLOAT32, data_url, random_image, random_video
from tests.integration.hf_vision import HFVision

MAX_TOKENS = 8
FAMILIES = {
    "idefics3": "Idefics3ForConditionalGeneration",
    "mistral3_vl": "Mistral3ForConditionalGeneration",
    "llava_onevision": "LlavaOnevisionForConditionalGeneration",
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(
    request: pytest.FixtureRequest,
    shared_server: Any,
    tmp_path_factory: pytest.TempPathFactory,
    tokenizer_dir: Path | None,
) -> tuple[openai.OpenAI, HFVision]:
    """(a client of the family's server, its HF oracle)."""
    if tokenizer_dir is None:
        pytest.skip("needs the default model's tokenizer")
    arch = request.param
    model_dir = make_tiny_model(arch, tmp_path_factory.mktemp(arch), tokenizer_dir)
    server = shared_server(
        "--model", str(model_dir), "--served-model-name", "vl",
        "--max-num-batched-tokens", "32", "--limit-mm-per-prompt", json.dumps({"image": 2}),
        *FLOAT32,
    )  # fmt: skip
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    return client, HFVision(model_dir, FAMILIES[arch], MAX_TOKENS)


def _ask(client: openai.OpenAI, text: str, images: list[Image.Image]) -> tuple[int, list[int]]:
    content: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": data_url(image)}} for image in images
    ]
    content.append({"type": "text", "text": text})
    r = client.chat.completions.create(
        model="vl", messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS,
        temperature=0, extra_body={"return_token_ids": True},
    )  # fmt: skip
    return r.usage.prompt_tokens, r.choices[0].token_ids


def _hf(hf: HFVision, text: str, images: list[Image.Image]) -> tuple[int, list[int]]:
    """Hugging Face's (prompt tokens, greedy answer) for the same turn."""
    inputs = hf.inputs(hf.prompt(text, len(images)), images)
    return inputs["input_ids"].shape[1], hf.generate(**inputs)[0]


def test_one_image_is_hf_exact_and_the_image_matters(
    family: tuple[openai.OpenAI, HFVision],
) -> None:
    client, hf = family
    text = "What is in this picture? Describe it in a few words."
    first, other = random_image(1, (40, 56)), random_image(2, (40, 56))
    answer = _ask(client, text, [first])
    assert answer == _hf(hf, text, [first])
    assert _ask(client, text, [other]) == _hf(hf, text, [other])
    assert answer[1] != _hf(hf, text, [other])[1]


def test_two_images_are_hf_exact(family: tuple[openai.OpenAI, HFVision]) -> None:
    client, hf = family
    text = "Compare the two pictures."
    images = [random_image(3, (24, 64)), random_image(4, (64, 48))]
    assert _ask(client, text, images) == _hf(hf, text, images)
    swapped = images[::-1]
    assert _ask(client, text, swapped) == _hf(hf, text, swapped)


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_tp2_pp2_is_hf_exact(
    module_server: Any,
    tmp_path_factory: pytest.TempPathFactory,
    tokenizer_dir: Path | None,
    arch: str,
) -> None:
    """At `--tp 2 --pp 2`: the tower runs on the first stage's ranks, whose rows fill the
    images' placeholders there; the second stage gets the hidden states. Two images (Idefics3's
    of 2 and 4 tiles and each whole image; Mistral 3's of 2 x 4 and 4 x 3 merged tokens),
    answers and prompt lengths as Hugging Face's."""
    if tokenizer_dir is None:
        pytest.skip("needs the default model's tokenizer")
    model_dir = make_tiny_model(arch, tmp_path_factory.mktemp(f"{arch}-tp2-pp2"), tokenizer_dir)
    server = module_server(
        "--model", str(model_dir), "--served-model-name", "vl", "--max-num-batched-tokens", "32",
        "--limit-mm-per-prompt", json.dumps({"image": 2}), "--tp", "2", "--pp", "2",
        "--kv-cache-memory", "0.05", *FLOAT32,
    )  # fmt: skip
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    hf = HFVision(model_dir, FAMILIES[arch], MAX_TOKENS)
    text = "Compare the two pictures."
    images = [random_image(3, (24, 64)), random_image(4, (64, 48))]
    assert _ask(client, text, images) == _hf(hf, text, images)


def test_a_llava_onevision_video_is_hf_exact(family: tuple[openai.OpenAI, HFVision]) -> None:
    """A video part: 32 of a 40-frame clip's frames spread evenly (vLLM's loader's choice), each
    resized to 32 px and pooled to 2 x 2 features, then one newline: 129 placeholders; with
    `num_frames` 8 in mm_processor_kwargs, 33. Answers and prompt lengths as Hugging Face's from
    the same frames' tensors; another video, another answer."""
    client, hf = family
    if hf.model.config.architectures[0] != FAMILIES["llava_onevision"]:
        pytest.skip("videos are LLaVA-OneVision's here (the Qwen VL families: test_qwen_images)")
    text = "What happens in this video?"
    first = _ask_video(client, text, random_video(1, num_frames=40))
    assert first == _hf_video(hf, text, random_video(1, num_frames=40), {})
    assert first[0] - len(_hf_text_ids(hf, text)) == 129 - 1  # the marker became 129 tokens
    other = _ask_video(client, text, random_video(2, num_frames=40))
    assert other == _hf_video(hf, text, random_video(2, num_frames=40), {})
    assert other[1] != first[1]
    fewer = _ask_video(client, text, random_video(1, num_frames=40), {"num_frames": 8})
    assert fewer == _hf_video(hf, text, random_video(1, num_frames=40), {"num_frames": 8})
    assert fewer[0] == first[0] - 96


def _ask_video(
    client: openai.OpenAI, text: str, video: bytes, options: dict[str, Any] | None = None
) -> tuple[int, list[int]]:
    url = "data:video/mp4;base64," + base64.b64encode(video).decode()
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": text}]
    extra: dict[str, Any] = {"return_token_ids": True}
    if options:
        extra["mm_processor_kwargs"] = options
    r = client.chat.completions.create(
        model="vl", messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS,
        temperature=0, extra_body=extra,
    )  # fmt: skip
    return r.usage.prompt_tokens, r.choices[0].token_ids


def _video_prompt(hf: HFVision, text: str) -> str:
    turn = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": text}]}]
    return hf.processor.tokenizer.apply_chat_template(
        turn, add_generation_prompt=True, tokenize=False
    )


def _hf_text_ids(hf: HFVision, text: str) -> list[int]:
    return hf.processor.tokenizer(_video_prompt(hf, text), add_special_tokens=False).input_ids


def _hf_video(
    hf: HFVision, text: str, video: bytes, options: dict[str, Any]
) -> tuple[int, list[int]]:
    """Hugging Face's (prompt tokens, greedy answer) from tern's frames and tensors of the video
    (frontend/media/llava_onevision.py: the processor's own video half needs torchvision)."""
    from frontend.media.llava_onevision import LlavaOnevisionVideoProcessor
    from frontend.media.policy import MediaPolicy
    from frontend.media.video import decode_video

    vision = hf.model.config.vision_config
    processor = LlavaOnevisionVideoProcessor(hf.model_dir, vision.image_size // vision.patch_size)
    decoded = decode_video(video, processor.sampler(options), MediaPolicy(), "video")
    tensors, video_text = processor.process(decoded, "<video>", "", "")
    prompt = _video_prompt(hf, text).replace("<video>", video_text)
    ids = hf.processor.tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
              "pixel_values_videos": torch.from_numpy(tensors["pixel_values_videos"])}  # fmt: skip
    return ids.shape[1], hf.generate(**inputs)[0]

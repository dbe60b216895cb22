"""Gemma 3's images through a real server, against Hugging Face: a tiny random
Gemma3ForConditionalGeneration (a SigLIP tower, the average-pooling projector, the Gemma 3 language
model with sliding layers; its processor saved beside it) answers chat requests with images, each
greedy answer token for token the one `Gemma3ForConditionalGeneration.generate` gives in float32.

Gemma 3 attends in both directions inside each image's placeholders: prompts are computed in chunks
of 8 tokens, so an image (4 placeholders) must never be split, and a prefix-cache hit must never
end inside one; pan & scan (mm_processor_kwargs) adds one placeholder run per crop."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
from PIL import Image

from tests.conftest import make_tiny_model
from tests.integration.conftest import FLOAT32, data_url, random_image
from tests.integration.hf_vision import HFVision

MAX_TOKENS = 8
PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 8,
                "pan_and_scan_max_num_crops": 4, "pan_and_scan_min_ratio_to_activate": 1.2}  # fmt: skip


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path | None) -> Path:
    if tokenizer_dir is None:
        pytest.skip("needs the default model's tokenizer")
    return make_tiny_model("gemma3_vl", tmp_path_factory.mktemp("gemma3_vl"), tokenizer_dir)


@pytest.fixture(scope="module")
def client(shared_server: Any, gemma_dir: Path) -> openai.OpenAI:
    server = shared_server(
        "--model", str(gemma_dir), "--served-model-name", "vl", "--max-num-batched-tokens", "8",
        "--max-num-seqs", "4", *FLOAT32,
    )  # fmt: skip
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def hf(gemma_dir: Path) -> HFVision:
    return HFVision(gemma_dir, "Gemma3ForConditionalGeneration", MAX_TOKENS)


def _ask(client: openai.OpenAI, text: str, images: list[Image.Image], **extra: Any) -> Any:
    content: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": data_url(image)}} for image in images
    ]
    content.append({"type": "text", "text": text})
    return client.chat.completions.create(
        model="vl", messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS,
        temperature=0, logprobs=True, extra_body={"return_token_ids": True, **extra},
    )  # fmt: skip


def test_images_are_hf_exact_and_matter(client: openai.OpenAI, hf: HFVision) -> None:
    text = "Describe what the picture shows, in a sentence or two."
    one, other = _ask(client, text, [random_image(1)]), _ask(client, text, [random_image(2)])
    for response, seed in ((one, 1), (other, 2)):
        tokens, logprobs = hf.answer(text, [random_image(seed)])
        assert response.choices[0].token_ids == tokens
        # Within 1e-3 of Hugging Face's, whose prefill attends both ways inside an image.
        assert _logprobs(response) == pytest.approx(logprobs, abs=1e-3)
    # The tiny random model answers newlines whatever it sees: the image shows in the logprobs.
    assert _logprobs(one) != pytest.approx(_logprobs(other), abs=1e-4)
    two = _ask(client, text, [random_image(1), random_image(3)])
    assert two.choices[0].token_ids == hf.greedy(text, [random_image(1), random_image(3)])


def _logprobs(response: Any) -> list[float]:
    return [item.logprob for item in response.choices[0].logprobs.content]


def test_pan_and_scan_crops(client: openai.OpenAI, hf: HFVision) -> None:
    wide = random_image(4, (32, 96))
    text = "A wide picture."
    r = _ask(client, text, [wide], mm_processor_kwargs=PAN_AND_SCAN)
    tokens, logprobs = hf.answer(text, [wide], **PAN_AND_SCAN)
    assert r.choices[0].token_ids == tokens
    assert _logprobs(r) == pytest.approx(logprobs, abs=1e-3)
    assert r.usage.prompt_tokens > 3 * 4  # the whole image and its crops, 4 placeholders each


def test_a_repeated_image_hits_the_prefix_cache_and_stays_exact(
    client: openai.OpenAI, hf: HFVision
) -> None:
    text = "The same picture twice, with a question long enough to fill a few blocks of tokens."
    first = _ask(client, text, [random_image(5)])
    again = _ask(client, text, [random_image(5)])
    assert (
        again.choices[0].token_ids
        == first.choices[0].token_ids
        == hf.greedy(text, [random_image(5)])
    )
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_unknown_processor_kwargs_are_400(client: openai.OpenAI) -> None:
    """Unknown keys, and a video's sampling on a model without videos: never ignored."""
    for kwargs in ({"rm_rf": True}, {"fps": 1}):
        with pytest.raises(openai.BadRequestError) as info:
            _ask(client, "Hi", [random_image(6)], mm_processor_kwargs=kwargs)
        assert info.value.body["param"] == "mm_processor_kwargs"


def test_tp2_pp2_attends_both_ways_inside_images_on_every_stage(
    module_server: Any, gemma_dir: Path, hf: HFVision
) -> None:
    """At `--tp 2 --pp 2` each stage's layers attend in both directions inside the image's
    placeholders (the second stage gets the spans, not the pixels), its sliding layers keep their
    windows, and the answers and logprobs stay HF's."""
    server = module_server(
        "--model", str(gemma_dir), "--served-model-name", "vl", "--max-num-batched-tokens", "8",
        "--tp", "2", "--pp", "2", "--kv-cache-memory", "0.05", *FLOAT32,
    )  # fmt: skip
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    text = "Describe what the picture shows, in a sentence or two."
    response = _ask(client, text, [random_image(5), random_image(6)])
    tokens, logprobs = hf.answer(text, [random_image(5), random_image(6)])
    assert response.choices[0].token_ids == tokens
    assert _logprobs(response) == pytest.approx(logprobs, abs=1e-3)

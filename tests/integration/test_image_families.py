"""Image families beyond LLaVA, through a real server, against Hugging Face: each tiny random
checkpoint (its processor saved beside it) answers chat requests with one and with two images,
each greedy answer token for token the one its `*ForConditionalGeneration.generate` gives in
float32, from the same prompt (as many prompt tokens: the placeholders laid out alike).

- idefics3 (SmolVLM's layout): an image is its tiles (`<fake_token_around_image><row_r_col_c>`
  then 4 `<image>`s each) and then the whole image (`<global-img>` then 4 more); the images below
  are 1 x 2 and 2 x 2 tiles.

The server computes prompts in chunks of 32 tokens, so chunks split images. Two different images
give different answers, so no test passes with the image ignored."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import torch
from PIL import Image

from tests.conftest import make_tiny_model

MAX_TOKENS = 8
FAMILIES = {"idefics3": "Idefics3ForConditionalGeneration"}


def _image(seed: int, size: tuple[int, int]) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class _HF:
    """Hugging Face's prompt and greedy answer for the same message and images."""

    def __init__(self, model_dir: Path, class_name: str) -> None:
        import transformers

        self.processor = transformers.AutoProcessor.from_pretrained(model_dir)
        self.model = (
            getattr(transformers, class_name).from_pretrained(model_dir, dtype=torch.float32).eval()
        )

    def greedy(self, text: str, images: list[Image.Image]) -> tuple[int, list[int]]:
        """-> (prompt tokens, answer tokens)."""
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        prompt = self.processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        inputs = self.processor(
            text=[prompt], images=[images], add_special_tokens=False, return_tensors="pt"
        )
        with torch.inference_mode():
            out = self.model.generate(
                **inputs, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0
            )
        n = inputs["input_ids"].shape[1]
        return n, out[0, n:].tolist()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(
    request: pytest.FixtureRequest,
    shared_server: Any,
    tmp_path_factory: pytest.TempPathFactory,
    tokenizer_dir: Path | None,
) -> tuple[openai.OpenAI, _HF]:
    """(a client of the family's server, its HF oracle)."""
    if tokenizer_dir is None:
        pytest.skip("needs the default model's tokenizer")
    arch = request.param
    model_dir = make_tiny_model(arch, tmp_path_factory.mktemp(arch), tokenizer_dir)
    server = shared_server(
        "--model", str(model_dir), "--served-model-name", "vl",
        "--max-num-batched-tokens", "32", "--limit-mm-per-prompt", json.dumps({"image": 2}),
    )  # fmt: skip
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    return client, _HF(model_dir, FAMILIES[arch])


def _ask(client: openai.OpenAI, text: str, images: list[Image.Image]) -> tuple[int, list[int]]:
    content: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": _data_url(image)}} for image in images
    ]
    content.append({"type": "text", "text": text})
    r = client.chat.completions.create(
        model="vl", messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS,
        temperature=0, extra_body={"return_token_ids": True},
    )  # fmt: skip
    return r.usage.prompt_tokens, r.choices[0].token_ids


def test_one_image_is_hf_exact_and_the_image_matters(family: tuple[openai.OpenAI, _HF]) -> None:
    client, hf = family
    text = "What is in this picture? Describe it in a few words."
    first, other = _image(1, (40, 56)), _image(2, (40, 56))
    answer = _ask(client, text, [first])
    assert answer == hf.greedy(text, [first])
    assert _ask(client, text, [other]) == hf.greedy(text, [other])
    assert answer[1] != hf.greedy(text, [other])[1]


def test_two_images_are_hf_exact(family: tuple[openai.OpenAI, _HF]) -> None:
    client, hf = family
    text = "Compare the two pictures."
    images = [_image(3, (24, 64)), _image(4, (64, 48))]
    assert _ask(client, text, images) == hf.greedy(text, images)
    swapped = images[::-1]
    assert _ask(client, text, swapped) == hf.greedy(text, swapped)

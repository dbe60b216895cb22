"""Images in, through a real server, against Hugging Face: a tiny random LLaVA (a CLIP tower and a
projector before a Llama; its processor saved beside it) answers chat requests with images, each
greedy answer token for token the one `LlavaForConditionalGeneration.generate` gives in float32.

The server computes prompts in chunks of 32 tokens (an image is 16 placeholders: chunks split
images), keeps 10 KV blocks of 16 (concurrent requests preempt each other), and allows two images
per prompt and local files under one folder. Two different images give different answers, so no
test passes with the image ignored."""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from PIL import Image

from tests.integration.conftest import data_url as _data_url
from tests.integration.conftest import random_image as _image
from tests.integration.hf_vision import HFVision

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def server(shared_server: Any, llava_server_args: tuple[str, ...]) -> Any:
    return shared_server(*llava_server_args)


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def hf(llava_dir: Path) -> HFVision:
    return HFVision(llava_dir, "LlavaForConditionalGeneration", MAX_TOKENS)


def _ask(client: openai.OpenAI, text: str, urls: list[str], **kwargs: Any) -> Any:
    content = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    content.append({"type": "text", "text": text})
    return client.chat.completions.create(
        model="vl", messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS,
        temperature=0, logprobs=True, extra_body={"return_token_ids": True}, **kwargs,
    )  # fmt: skip


def _tokens(response: Any) -> list[int]:
    return response.choices[0].token_ids


def test_one_image_is_hf_exact_and_the_image_matters(client: openai.OpenAI, hf: HFVision) -> None:
    text = "What is in this picture? Describe it in a few words."
    first = _ask(client, text, [_data_url(_image(1))])
    other = _ask(client, text, [_data_url(_image(2))])
    assert _tokens(first) == hf.greedy(text, [_image(1)])
    assert _tokens(other) == hf.greedy(text, [_image(2)])
    assert _tokens(first) != _tokens(other)
    assert first.usage.prompt_tokens > 16  # the image's placeholders are prompt tokens


def test_two_images_jpeg_and_a_local_file(
    client: openai.OpenAI, hf: HFVision, media_dir: Path
) -> None:
    text = "Compare the two pictures."
    jpeg = _image(3)
    buf = io.BytesIO()
    jpeg.save(buf, format="JPEG")
    decoded = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")  # what the server sees
    urls = [_data_url(jpeg, "JPEG"), (media_dir / "seven.png").as_uri()]
    r = _ask(client, text, urls)
    assert _tokens(r) == hf.greedy(text, [decoded, _image(7)])


def test_prefix_hit_with_the_same_image_and_none_with_another(
    client: openai.OpenAI, hf: HFVision
) -> None:
    text = "A long question about this picture, asked twice with the same words and image."
    url = _data_url(_image(4))
    first = _ask(client, text, [url])
    again = _ask(client, text, [url])
    assert _tokens(again) == _tokens(first) == hf.greedy(text, [_image(4)])
    assert again.usage.prompt_tokens_details.cached_tokens >= 16
    # The same placeholder ids standing for another image: no block holding them may hit.
    other = _ask(client, text, [_data_url(_image(5))])
    assert _tokens(other) == hf.greedy(text, [_image(5)])
    cached = other.usage.prompt_tokens_details.cached_tokens or 0
    assert cached <= _first_placeholder(first)


def _first_placeholder(response: Any) -> int:
    """Where the image's placeholders start in the prompt (the tokens before can be shared)."""
    ids = response.prompt_token_ids
    image_token = max(set(ids), key=ids.count)  # 16 placeholders: the most frequent id
    return ids.index(image_token)


def test_a_batch_mixing_text_and_images_with_preemption(
    client: openai.OpenAI, hf: HFVision
) -> None:
    """Eight requests at once in 10 blocks: they preempt each other and all finish HF-exact."""
    jobs = [(f"Picture number {i}, what do you see?", [i + 10] if i % 2 else []) for i in range(8)]

    def run(job: tuple[str, list[int]]) -> list[int]:
        text, seeds = job
        return _tokens(_ask(client, text, [_data_url(_image(s)) for s in seeds]))

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(run, jobs))
    for (text, seeds), answer in zip(jobs, answers):
        assert answer == hf.greedy(text, [_image(s) for s in seeds])


def test_logprobs_match_hf(client: openai.OpenAI, hf: HFVision) -> None:
    text = "Logprobs of an answer about a picture."
    r = _ask(client, text, [_data_url(_image(6))])
    tokens, logprobs = hf.answer(text, [_image(6)])
    assert _tokens(r) == tokens
    assert [item.logprob for item in r.choices[0].logprobs.content] == pytest.approx(
        logprobs, abs=1e-3
    )


def test_responses_and_messages_take_images(
    server: Any, client: openai.OpenAI, hf: HFVision
) -> None:
    """OpenAI Responses' input_image and Anthropic Messages' base64 image block, through their own
    SDKs: the answer is Hugging Face's greedy one, decoded."""
    text = "What does this picture show?"
    expected = hf.processor.tokenizer.decode(hf.greedy(text, [_image(8)]), skip_special_tokens=True)
    url = _data_url(_image(8))
    r = client.responses.create(
        model="vl", max_output_tokens=MAX_TOKENS, temperature=0,
        input=[{"role": "user", "content": [{"type": "input_image", "image_url": url},
                                             {"type": "input_text", "text": text}]}],
    )  # fmt: skip
    assert r.output_text == expected
    messages = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)
    source = {"type": "base64", "media_type": "image/png", "data": url.split(",", 1)[1]}
    m = messages.messages.create(
        model="vl", max_tokens=MAX_TOKENS, extra_body={"temperature": 0},  # as the SDK sends it
        messages=[{"role": "user", "content": [{"type": "image", "source": source},
                                               {"type": "text", "text": text}]}],
    )  # fmt: skip
    assert m.content[0].text == expected


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("data:image/png;base64,@@not base64@@", "base64"),
        ("data:image/png;base64," + base64.b64encode(b"plain text, not pixels").decode(), "image"),
        ("file:///etc/hostname", "allowed"),
        ("http://127.0.0.1:1/cat.png", "allowed"),
        ("ftp://example.com/cat.png", "ftp"),
    ],
)
def test_bad_images_are_400_naming_the_part(
    client: openai.OpenAI, server: Any, url: str, message: str
) -> None:
    parts = [{"type": "text", "text": "What is this?"},
             {"type": "image_url", "image_url": {"url": url}}]  # fmt: skip
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="vl", messages=[{"role": "user", "content": parts}], max_tokens=4
        )
    assert info.value.body["param"] == "messages[0].content[1]"
    assert message in info.value.body["message"]
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200


def test_too_many_images_is_400(client: openai.OpenAI) -> None:
    urls = [_data_url(_image(i)) for i in range(3)]
    with pytest.raises(openai.BadRequestError) as info:
        _ask(client, "Three pictures.", urls)
    assert "2" in info.value.body["message"]


def test_server_info_says_it_takes_images(server: Any) -> None:
    info = server.server_info()
    assert info["engine"]["input_modalities"] == ["text", "image"]

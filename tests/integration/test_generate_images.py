"""Images on POST /generate, through the tiny LLaVA server test_images.py also asks for (the same
arguments: one shared server), against Hugging Face's `LlavaForConditionalGeneration.generate`.

The forms are the ones RL frameworks send (verl and slime post JSON to SGLang's /generate while
training vision-language models): token ids their own HF processor already expanded, with
`image_data`; and SGLang's text with the image marker in it. Greedy outputs equal HF's token for
token, and two different images give different outputs, so no test passes with the image ignored.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from PIL import Image

from tests.integration.conftest import data_url, image_bytes, random_image
from tests.integration.hf_vision import HFVision

MAX_TOKENS = 8
GREEDY = {"temperature": 0, "max_new_tokens": MAX_TOKENS}


@pytest.fixture(scope="module")
def server(shared_server: Any, llava_server_args: tuple[str, ...]) -> Any:
    return shared_server(*llava_server_args)


class _Trainer(HFVision):
    """Hugging Face as an RL trainer uses it: its own prompt text and expanded ids."""

    def text(self, question: str) -> str:
        """A chat prompt with one image marker, as a trainer renders it."""
        return self.prompt(question, 1)

    def expanded_ids(self, text: str, image: Image.Image, add_special_tokens: bool) -> list[int]:
        """The trainer's own processor's ids: the marker expanded to the image's placeholders."""
        return self.inputs(text, [image], add_special_tokens)["input_ids"][0].tolist()

    def greedy_ids(self, ids: list[int], image: Image.Image) -> list[int]:
        pixels = self.processor.image_processor(images=[image], return_tensors="pt")
        input_ids = torch.tensor([ids])
        return self.generate(
            input_ids=input_ids, pixel_values=pixels["pixel_values"],
            attention_mask=torch.ones_like(input_ids),
        )[0]  # fmt: skip


@pytest.fixture(scope="module")
def hf(llava_dir: Path) -> _Trainer:
    return _Trainer(llava_dir, "LlavaForConditionalGeneration", MAX_TOKENS)


def _post(server: Any, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}/generate", json=body, timeout=120)


def _ok(server: Any, body: dict[str, Any]) -> Any:
    r = _post(server, body)
    assert r.status_code == 200, r.text
    return r.json()


def _raw_base64(image: Image.Image) -> str:
    return base64.b64encode(image_bytes(image)).decode()


def test_sglang_text_with_image_data(server: Any, hf: _Trainer) -> None:
    """SGLang's text form: the text holds the marker, the server's processor expands it (with
    the special tokens SGLang's tokenization adds)."""
    text = hf.text("What is in this picture?")
    bodies = [{"text": text, "image_data": data_url(random_image(s))} for s in (1, 2)]
    outs = [_ok(server, {**body, "sampling_params": GREEDY}) for body in bodies]
    for seed, out in zip((1, 2), outs):
        ids = hf.expanded_ids(text, random_image(seed), add_special_tokens=True)
        assert out["output_ids"] == hf.greedy_ids(ids, random_image(seed))
        assert out["meta_info"]["prompt_tokens"] == len(ids)
    assert outs[0]["output_ids"] != outs[1]["output_ids"]


def test_sglang_expanded_input_ids_with_raw_base64(server: Any, hf: _Trainer) -> None:
    """What verl and slime send: ids their HF processor expanded, and the image as base64."""
    ids = hf.expanded_ids(hf.text("Describe the picture."), random_image(3), False)
    out = _ok(
        server,
        {"input_ids": ids, "image_data": [_raw_base64(random_image(3))], "sampling_params": GREEDY},
    )
    assert out["output_ids"] == hf.greedy_ids(ids, random_image(3))
    assert out["meta_info"]["prompt_tokens"] == len(ids)


def test_sglang_batch_of_two_prompts_each_with_its_image(server: Any, hf: _Trainer) -> None:
    text = hf.text("Two prompts, two pictures.")
    ids = [hf.expanded_ids(text, random_image(s), False) for s in (4, 5)]
    body = {
        "input_ids": ids,
        "image_data": [[data_url(random_image(4))], data_url(random_image(5))],
        "sampling_params": GREEDY,
    }
    outs = _ok(server, body)
    assert [o["output_ids"] for o in outs] == [hf.greedy_ids(ids[0], random_image(4)),
                                               hf.greedy_ids(ids[1], random_image(5))]  # fmt: skip
    assert outs[0]["output_ids"] != outs[1]["output_ids"]


def test_lmdeploy_input_ids_with_a_local_file(server: Any, hf: _Trainer, media_dir: Path) -> None:
    """LMDeploy's body (no SGLang-only keys): the image a path under the allowed folder."""
    ids = hf.expanded_ids(hf.text("What does the file show?"), random_image(7), False)
    body = {"input_ids": ids, "image_data": str(media_dir / "seven.png"), "max_tokens": MAX_TOKENS,
            "temperature": 0}  # fmt: skip
    out = _ok(server, body)
    assert set(out) == {"text", "output_ids", "meta_info"}
    assert out["output_ids"] == hf.greedy_ids(ids, random_image(7))


@pytest.mark.parametrize(
    ("image_data", "message"),
    [
        ("@@not base64@@", "base64"),
        (base64.b64encode(b"plain text, not pixels").decode(), "image"),
        ("/etc/passwd.png", "outside"),
        ("http://127.0.0.1:1/cat.png", "allowed"),
        ([data_url(random_image(i)) for i in range(3)], "At most 2"),
        ([{"url": "x"}], "strings"),
    ],
)
def test_bad_image_data_is_400_naming_it(
    server: Any, hf: _Trainer, image_data: Any, message: str
) -> None:
    ids = hf.expanded_ids(hf.text("Bad."), random_image(9), False)
    for body in (
        {"input_ids": ids, "image_data": image_data, "sampling_params": GREEDY},  # SGLang's
        {"input_ids": ids, "image_data": image_data, "max_tokens": 4},  # LMDeploy's
    ):
        r = _post(server, body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"].startswith("image_data") and message in error["message"], error


def test_placeholders_that_do_not_match_the_images_are_400(server: Any, hf: _Trainer) -> None:
    text = hf.text("Mismatch.")
    one_image = hf.expanded_ids(text, random_image(1), False)
    unexpanded = hf.processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    bodies = [
        # Ids expanded for one image, sent with two.
        {"input_ids": one_image, "image_data": [data_url(random_image(1))] * 2},
        # Ids with one placeholder, never expanded.
        {"input_ids": unexpanded, "image_data": data_url(random_image(1))},
        # Text without the marker (SGLang would drop the image with a warning).
        {"text": "No marker here.", "image_data": data_url(random_image(1))},
        # A batch with more image entries than prompts.
        {"input_ids": [one_image], "image_data": [data_url(random_image(1))] * 2},
    ]
    for body in bodies:
        r = _post(server, {**body, "sampling_params": GREEDY})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"].startswith("image_data"), r.text
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200

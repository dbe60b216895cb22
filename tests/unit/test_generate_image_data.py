"""/generate's `image_data` (SGLang's and LMDeploy's): the shapes each prompt's images are read
from, SGLang's rules for one item (URL, file path, raw base64) under the media policy, and the
items of images in token ids another HF processor already expanded."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from frontend.common.decoding import decode_request
from frontend.common.errors import APIError
from frontend.lmdeploy.protocol import GenerateRequest
from frontend.media.policy import MediaPolicy
from frontend.media.processing import ImageProcessor
from frontend.media.sources import image_data_url, load_media_bytes
from frontend.sglang.protocol import SGLangGenerateRequest
from tests.conftest import make_tiny_model


def _png(seed: int, size: tuple[int, int] = (40, 48)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _sglang(**fields: object) -> list[list[tuple[str, str]]]:
    req = decode_request(json.dumps(fields).encode(), SGLangGenerateRequest)
    return [[(ref.url, ref.param) for ref in refs] for refs in req.image_refs()]


def test_image_data_items_follow_sglang_load_image() -> None:
    for url in ("http://h/cat.png", "https://h/x", "data:image/png;base64,AAAA", "file:///m/a"):
        assert image_data_url(url, "image_data") == url
    assert image_data_url("/media/cat.JPG", "image_data") == "file:///media/cat.JPG"
    # A JPEG's base64 starts with "/9j/": no image extension at its end, so it is base64.
    assert image_data_url("/9j/4AAQSkZJRg", "image_data") == "data:image;base64,/9j/4AAQSkZJRg"
    for bad in ("cat.png", "", 5, {"url": "x"}, None):
        with pytest.raises(APIError) as info:
            image_data_url(bad, "image_data[1]")
        assert info.value.status == 400 and info.value.param == "image_data[1]"


def test_raw_base64_meets_the_byte_cap(tmp_path: Path) -> None:
    png = _png(1)
    url = image_data_url(base64.b64encode(png).decode(), "image_data")
    assert asyncio.run(load_media_bytes(url, MediaPolicy(), "image_data")) == png
    with pytest.raises(APIError) as info:
        asyncio.run(load_media_bytes(url, MediaPolicy(max_image_bytes=100), "image_data"))
    assert "larger than 100 bytes" in info.value.message
    # A path is a file: URL: only under the allowed folder.
    (tmp_path / "a.png").write_bytes(png)
    policy = MediaPolicy(allowed_local_media_path=tmp_path)
    url = image_data_url(str(tmp_path / "a.png"), "image_data")
    assert asyncio.run(load_media_bytes(url, policy, "image_data")) == png
    with pytest.raises(APIError):
        asyncio.run(load_media_bytes(url, MediaPolicy(), "image_data"))


def test_sglang_image_data_shapes() -> None:
    a, b = "data:image/png;base64,AA==", "data:image/png;base64,BB=="
    assert _sglang(text="x") == [[]]
    assert _sglang(text="x", image_data=[]) == [[]]
    assert _sglang(text="x", image_data=a) == [[(a, "image_data")]]
    assert _sglang(text="x", image_data=[a, b]) == [[(a, "image_data[0]"), (b, "image_data[1]")]]
    assert _sglang(text="x", image_data=[[a]]) == [[(a, "image_data[0][0]")]]
    # A batch: one string is every prompt's image; a list has an entry per prompt.
    assert _sglang(text=["x", "y"], image_data=a) == [[(a, "image_data")]] * 2
    assert _sglang(input_ids=[[1], [2]], image_data=[a, None]) == [[(a, "image_data[0]")], []]
    assert _sglang(text=["x", "y"], image_data=[[a, b], [None]]) == [
        [(a, "image_data[0][0]"), (b, "image_data[0][1]")],
        [],
    ]
    with pytest.raises(APIError) as info:
        _sglang(text=["x", "y"], image_data=[a, b, a])
    assert info.value.param == "image_data" and "3 entries for 2 prompts" in info.value.message


def test_lmdeploy_image_data_shapes() -> None:
    a = "data:image/png;base64,AA=="

    def refs(**fields: object) -> list[tuple[str, str]]:
        req = decode_request(json.dumps(fields).encode(), GenerateRequest)
        return [(ref.url, ref.param) for ref in req.image_refs()]

    assert refs(input_ids=[1]) == refs(input_ids=[1], image_data=[]) == []
    assert refs(input_ids=[1], image_data=a) == [(a, "image_data")]
    assert refs(input_ids=[1], image_data=[a, a]) == [(a, "image_data[0]"), (a, "image_data[1]")]


@pytest.fixture(scope="module")
def processor(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path | None
) -> ImageProcessor:
    if tokenizer_dir is None:
        pytest.skip("needs the default model's tokenizer")
    return ImageProcessor(make_tiny_model("llava", tmp_path_factory.mktemp("llava"), tokenizer_dir))


def _image(seed: int) -> Image.Image:
    return Image.open(io.BytesIO(_png(seed))).convert("RGB")


def test_items_for_expanded_ids_are_the_ones_process_makes(processor: ImageProcessor) -> None:
    """Ids HF's processor expanded, with their images: the same items as the text form gives."""
    text = f"A {processor.marker} and {processor.marker}."
    images = [_image(1), _image(2)]
    ids, items = processor.process(text, images, {}, "image_data")
    assert processor.items_for_ids(ids, images, {}, "image_data") == items
    assert [item.spans for item in items] == [
        [(ids.index(processor.placeholder_id), 16)],
        [(len(ids) - 1 - ids[::-1].index(processor.placeholder_id) - 15, 16)],
    ]
    assert items[0].content_hash != items[1].content_hash


@pytest.mark.parametrize("case", ["one image too many", "not expanded", "no placeholders"])
def test_items_for_ids_refuses_placeholders_that_do_not_match(
    processor: ImageProcessor, case: str
) -> None:
    text = f"A {processor.marker}."
    ids, _ = processor.process(text, [_image(1)], {}, "image_data")
    images = [_image(1)]
    if case == "one image too many":
        images.append(_image(2))
    elif case == "not expanded":
        ids = processor.hf.tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = [t for t in ids if t != processor.placeholder_id]
    with pytest.raises(APIError) as info:
        processor.items_for_ids(ids, images, {}, "image_data")
    assert info.value.status == 400 and info.value.param == "image_data"
    assert "placeholders" in info.value.message


def test_text_markers_must_match_the_images(processor: ImageProcessor) -> None:
    """SGLang drops images beyond the markers with a warning; tern refuses them."""
    for text, num_images in (("No marker.", 1), (f"{processor.marker}{processor.marker}", 1)):
        images = [_image(i) for i in range(num_images)]
        with pytest.raises(APIError) as info:
            processor.process(text, images, {}, "image_data")
        assert info.value.param == "image_data" and "marker" in info.value.message

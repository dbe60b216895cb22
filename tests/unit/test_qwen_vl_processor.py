"""frontend/media/qwen_vl.py: Qwen3VLProcessor's image path without torchvision. Each
<|image_pad|> of the chat template's text becomes its image's run of placeholders, as many as the
image has merged patches; ImageProcessor turns a marker without its image (or an image without
its marker) into a 400 naming the part."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from frontend.common.errors import APIError
from frontend.media.processing import ImageProcessor
from frontend.media.qwen_vl import QwenVLImageProcessor
from tests.conftest import make_tiny_model


def _image(seed: int, height: int, width: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def qwen_vl(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path | None) -> Path:
    if tokenizer_dir is None:
        pytest.skip("needs the default model's tokenizer")
    return make_tiny_model("qwen3_5_vl", tmp_path_factory.mktemp("qwen3_5_vl"), tokenizer_dir)


def test_each_marker_becomes_its_images_run(qwen_vl: Path) -> None:
    processor = ImageProcessor(qwen_vl)
    assert isinstance(processor.hf, QwenVLImageProcessor)
    assert processor.marker == "<|image_pad|>"
    text = processor.hf.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"},
                                      {"type": "image"}]}],
        add_generation_prompt=True, tokenize=False,
    )  # fmt: skip
    assert text.count("<|vision_start|><|image_pad|><|vision_end|>") == 2
    ids, items = processor.process(text, [_image(1, 32, 32), _image(2, 24, 40)], {}, "p")
    assert [item.spans[0][1] for item in items] == [16, 15]  # 4x4 and 3x5 merged patches
    start = processor.hf.tokenizer.convert_tokens_to_ids("<|vision_start|>")
    for item in items:
        ((first, length),) = item.spans
        assert ids[first - 1] == start
        assert set(ids[first : first + length]) == {processor.placeholder_id}
        assert item.tensors["image_grid_thw"].shape == [1, 3]


def test_markers_and_images_must_match(qwen_vl: Path) -> None:
    processor = ImageProcessor(qwen_vl)
    one = "<|vision_start|><|image_pad|><|vision_end|>"
    for text, images in ((one * 2, [_image(1, 32, 32)]), (one, [_image(1, 32, 32)] * 2)):
        with pytest.raises(APIError) as info:
            processor.process(text, images, {}, "messages[0]")
        assert (info.value.status, info.value.param) == (400, "messages[0]")

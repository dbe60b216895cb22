"""tern's stand-in for Mistral 3's PixtralProcessor (frontend/media/pixtral.py; the processor
requires torchvision): its image processor is transformers' own (PIL backend), and each image's
text is what PixtralProcessor.replace_image_token (from its source, tests/hf_source.py) writes
for the image's size."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
import transformers
from PIL import Image

from frontend.media.pixtral import PixtralImageProcessor
from tests.hf_source import HF_MODELS, hf_functions

_REPLACE = hf_functions(HF_MODELS / "pixtral" / "processing_pixtral.py", ("replace_image_token",))


@pytest.fixture(scope="module")
def processor(tmp_path_factory: pytest.TempPathFactory) -> PixtralImageProcessor:
    folder = tmp_path_factory.mktemp("pixtral")
    transformers.PixtralImageProcessorPil(size={"longest_edge": 64}, patch_size=16).save_pretrained(
        folder
    )
    tokens = {"image_token": "[IMG]", "image_break_token": "[IMG_BREAK]",
              "image_end_token": "[IMG_END]"}  # fmt: skip
    settings = {"patch_size": 8, "spatial_merge_size": 2, **tokens}
    (folder / "processor_config.json").write_text(json.dumps(settings))
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_word_tokenizer(), extra_special_tokens=tokens
    )
    tokenizer.save_pretrained(folder)
    return PixtralImageProcessor(folder)


def _word_tokenizer():  # a tokenizer that knows a few words
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["[UNK]", "look", "at", "and", "[IMG]", "[IMG_BREAK]",
                                         "[IMG_END]"])}  # fmt: skip
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer


@pytest.mark.parametrize("sizes", [[(40, 56)], [(24, 64), (64, 48)], [(17, 9)]])
def test_each_image_text_is_pixtral_processors(
    processor: PixtralImageProcessor, sizes: list[tuple[int, int]]
) -> None:
    images = [
        Image.fromarray(np.random.default_rng(i).integers(0, 256, (*s, 3), dtype=np.uint8))
        for i, s in enumerate(sizes)
    ]
    prompt = "look " + " and ".join("at [IMG]" for _ in images)
    out = processor([prompt], [images], return_tensors="np")
    hf_self = types.SimpleNamespace(
        patch_size=8, spatial_merge_size=2, image_token="[IMG]",
        image_break_token="[IMG_BREAK]", image_end_token="[IMG_END]",
    )  # fmt: skip
    expected = prompt
    for i in range(len(images)):
        run = _REPLACE["replace_image_token"](hf_self, {"image_sizes": out["image_sizes"]}, i)
        expected = expected.replace("[IMG]", run.replace("[IMG]", "\0"), 1)
    expected = expected.replace("\0", "[IMG]")
    ids = processor.tokenizer([expected], add_special_tokens=False, return_tensors="np")
    assert out["input_ids"].tolist() == ids["input_ids"].tolist()
    folder = processor.tokenizer.name_or_path  # the processor's folder
    image_processor = transformers.PixtralImageProcessorPil.from_pretrained(folder)
    direct = image_processor(images, patch_size=16, return_tensors="np")
    assert out["image_sizes"].tolist() == direct["image_sizes"].tolist()
    np.testing.assert_array_equal(out["pixel_values"], direct["pixel_values"])


def test_markers_and_images_must_pair(processor: PixtralImageProcessor) -> None:
    image = Image.new("RGB", (32, 32))
    with pytest.raises(ValueError, match="more image markers"):
        processor(["at [IMG] and [IMG]"], [[image]])
    with pytest.raises(ValueError, match="2 images for 1 image markers"):
        processor(["at [IMG]"], [[image, image]])

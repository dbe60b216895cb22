"""Mistral 3's image encoder (workers/vision/pixtral.py) against Hugging Face's: a tiny random
Mistral3ForConditionalGeneration, images at their own aspect ratio through the Pixtral image
processor (its PIL backend; PixtralProcessor itself needs torchvision, which this venv lacks), each
image's rows equal to what `get_image_features` gives it, row by row as the [IMG] runs between
[IMG_BREAK]s; two images differ; the checkpoint's names load."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from enginecore.messages import EngineCoreRequest, MultiModalItem, SamplingParams
from tests.unit.test_engine_inproc import drain, make_core
from tests.unit.test_llava_onevision_engine import _item
from workers.vision.encoders import build_image_encoder

PATCH, MERGE = 8, 2


@pytest.fixture(scope="module")
def model() -> transformers.Mistral3ForConditionalGeneration:
    torch.manual_seed(0)
    text = transformers.MistralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    vision = transformers.PixtralVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        image_size=64, patch_size=PATCH, hidden_act="silu",
    )  # fmt: skip
    config = transformers.Mistral3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), spatial_merge_size=MERGE,
        image_token_index=10, architectures=["Mistral3ForConditionalGeneration"],
    )  # fmt: skip
    model = transformers.Mistral3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # decisive random weights: norms around 1, the rest at 0.25
        for name, p in model.named_parameters():
            is_norm = "norm" in name and name.endswith(".weight")
            p.normal_(1.0 if is_norm else 0.0, 0.2 if is_norm else 0.25)
    return model


def _pixels(seed: int, size: tuple[int, int]) -> dict[str, torch.Tensor]:
    image = Image.fromarray(
        np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    )
    processor = transformers.PixtralImageProcessorPil(
        size={"longest_edge": 64}, patch_size=PATCH * MERGE
    )
    out = processor(images=[image], return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_sizes": out["image_sizes"]}


def test_rows_equal_hugging_face_per_image(
    model: transformers.Mistral3ForConditionalGeneration,
) -> None:
    encoder = build_image_encoder(model.config.to_dict())
    assert encoder is not None and encoder.image_token_id == 10
    loaded = encoder.load_weights(model.state_dict().items())
    assert loaded == {name for name, _ in encoder.named_parameters()}
    outputs = []
    for seed, size in ((1, (40, 64)), (2, (64, 24))):  # wide and tall: their own aspect ratios
        tensors = _pixels(seed, size)
        with torch.no_grad():
            ours = encoder.encode(tensors)
            (theirs,) = model.model.get_image_features(
                tensors["pixel_values"], tensors["image_sizes"], vision_feature_layer=-1
            ).pooler_output
        height, width = tensors["image_sizes"][0].tolist()
        assert ours.shape[0] == (height // PATCH // MERGE) * (width // PATCH // MERGE)
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)  # rows of size ~10
        outputs.append(ours)
    assert not torch.allclose(outputs[0][:4], outputs[1][:4])


def test_a_padded_batch_picture_is_cropped_to_its_size(
    model: transformers.Mistral3ForConditionalGeneration,
) -> None:
    """In a batch the processor pads pictures to the largest; the encoder reads image_sizes."""
    encoder = build_image_encoder(model.config.to_dict())
    encoder.load_weights(model.state_dict().items())
    tensors = _pixels(3, (32, 48))
    padded = torch.zeros(1, 3, 64, 64)
    padded[..., :32, :48] = tensors["pixel_values"]
    with torch.no_grad():
        alone = encoder.encode(tensors)
        in_batch = encoder.encode({"pixel_values": padded, "image_sizes": tensors["image_sizes"]})
    torch.testing.assert_close(alone, in_batch)


IMG, IMG_BREAK, IMG_END = 10, 11, 12


def _prompt(images: list[dict[str, torch.Tensor]]) -> tuple[list[int], list[MultiModalItem]]:
    """Token ids as PixtralProcessor writes them: per image, each row of merged patches an [IMG]
    run closed by [IMG_BREAK], the last by [IMG_END]; one item per image, a span per row."""
    ids, items = [5, 6, 7], []
    for tensors in images:
        height, width = tensors["image_sizes"][0].tolist()
        rows, cols = height // PATCH // MERGE, width // PATCH // MERGE
        spans = []
        for r in range(rows):
            spans.append((len(ids), cols))
            ids += [IMG] * cols + [IMG_END if r == rows - 1 else IMG_BREAK]
        items.append(_item(tensors, spans[0][0], 1))
        items[-1].spans = spans
        ids += [20]
    return ids + [30, 31], items


def test_through_the_engine_as_hf_generate(
    model: transformers.Mistral3ForConditionalGeneration, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The checkpoint as transformers saves it loads (model.language_model.*, vision tower,
    projector); prompts with one and two images, in chunks of 8 tokens that split the rows,
    answer greedily as generate, and another image gives another answer."""
    model_dir = tmp_path_factory.mktemp("mistral3")
    model.save_pretrained(model_dir)
    cases = [
        [_pixels(1, (40, 64))],
        [_pixels(2, (40, 64))],
        [_pixels(3, (64, 24)), _pixels(4, (32, 32))],
    ]
    core = make_core(model_dir, max_num_batched_tokens=8)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [_prompt(images) for images in cases]
    for i, (ids, items) in enumerate(prompts):
        assert core.add_request(EngineCoreRequest(f"r{i}", ids, params, mm_items=items)) == []
    outs, _ = drain(core)
    answers = [outs[f"r{i}"] for i in range(len(cases))]
    for (ids, _), images, answer in zip(prompts, cases, answers):
        input_ids = torch.tensor([ids])
        width = max(t["pixel_values"].shape[-1] for t in images)
        height = max(t["pixel_values"].shape[-2] for t in images)
        pixels = torch.zeros(len(images), 3, height, width)  # the batch, padded as the processor
        for j, t in enumerate(images):
            pixels[j, :, : t["pixel_values"].shape[-2], : t["pixel_values"].shape[-1]] = t[
                "pixel_values"
            ][0]
        sizes = torch.cat([t["image_sizes"] for t in images])
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids), pixel_values=pixels,
                image_sizes=sizes, max_new_tokens=6, do_sample=False, pad_token_id=0,
            )  # fmt: skip
        assert answer == out[0, len(ids) :].tolist()
    assert answers[0] != answers[1]

"""LLaVA-OneVision through the engine (in process) against Hugging Face: a random tiny checkpoint
(2-layer SigLIP, Qwen2 text model, saved by transformers: `model.language_model.*`,
`model.image_newline`) loads, and prompts with one image (anyres) and with two (each its base view)
answer greedily token for token as `LlavaOnevisionForConditionalGeneration.generate` in float32.

The requests carry what the frontend sends (MultiModalItem: placeholder span, the image's
tensors); the tensors are each image's share of its prompt's image processor output (its full
processor needs torchvision, for videos). Chunks of 16 tokens split the images."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from enginecore.messages import EngineCoreRequest, MultiModalItem, SamplingParams, TensorData
from tests.unit.test_engine_inproc import drain, make_core

IMAGE = 120  # the image placeholder token
MAX_TOKENS = 8
GRIDS = [[32, 32], [32, 64], [64, 32], [64, 64]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    """(directory, HF model, image processor)."""
    config = transformers.LlavaOnevisionConfig(
        text_config=transformers.Qwen2Config(
            hidden_size=64, num_hidden_layers=2, vocab_size=128, intermediate_size=128,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            tie_word_embeddings=False,
        ).to_dict(),
        vision_config=transformers.SiglipVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            image_size=32, patch_size=8, vision_use_head=False,
        ).to_dict(),
        vision_feature_layer=-1, vision_feature_select_strategy="full", image_grid_pinpoints=GRIDS,
        vision_aspect_ratio="anyres_max_2", image_token_index=IMAGE, video_token_index=121,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.LlavaOnevisionForConditionalGeneration(config).eval()
    with torch.no_grad():  # decisive random weights: norms around 1, the rest at 0.25
        for name, p in hf.named_parameters():
            is_norm = "norm" in name and name.endswith(".weight")
            p.normal_(1.0 if is_norm else 0.0, 0.2 if is_norm else 0.25)
    model_dir = tmp_path_factory.mktemp("llava_onevision")
    hf.save_pretrained(model_dir)
    image_processor = transformers.LlavaOnevisionImageProcessorPil(
        size={"height": 32, "width": 32}, image_grid_pinpoints=GRIDS
    )
    return model_dir, hf, image_processor


def _image(seed: int, size: tuple[int, int]) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _item(tensors: dict[str, torch.Tensor], start: int, length: int) -> MultiModalItem:
    data = {
        name: TensorData(str(t.dtype).removeprefix("torch."), list(t.shape), t.numpy().tobytes())
        for name, t in tensors.items()
    }
    digest = hashlib.sha256(b"".join(d.data for d in data.values())).hexdigest()
    return MultiModalItem("image", digest, [(start, length)], data)


def _prompt(
    hf: Any, image_processor: Any, images: list[Image.Image]
) -> tuple[list[int], dict[str, torch.Tensor], list[MultiModalItem]]:
    """Token ids (text, each image's run of placeholders, text), HF's image inputs, the items."""
    sample = dict(image_processor([images], return_tensors="pt"))
    with torch.no_grad():
        rows = [f.shape[0] for f in hf.model.get_image_features(**sample).pooler_output]
    ids, items = [5, 6, 7], []
    for i, n in enumerate(rows):
        share = {"pixel_values": sample["pixel_values"][i : i + 1],
                 "image_sizes": sample["image_sizes"][i : i + 1],
                 "batch_num_images": sample["batch_num_images"]}  # fmt: skip
        items.append(_item(share, len(ids), n))
        ids += [IMAGE] * n + [10 + i]
    return ids + [30, 31, 32], sample, items


def _hf_greedy(hf: Any, ids: list[int], sample: dict[str, torch.Tensor]) -> list[int]:
    input_ids = torch.tensor([ids])
    with torch.inference_mode():
        out = hf.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **sample,
            max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


def test_one_and_two_images_answer_as_hf(checkpoint: tuple[Path, Any, Any]) -> None:
    model_dir, hf, image_processor = checkpoint
    cases = [
        [_image(1, (40, 56))],  # anyres 2 x 2, unpadded and shrunk: 44 rows
        [_image(2, (40, 56))],
        [_image(3, (24, 64)), _image(4, (64, 64))],  # each its base view and a newline: 17 rows
    ]
    prompts = [_prompt(hf, image_processor, images) for images in cases]
    assert [len(p[2][0].spans) and p[2][0].spans[0][1] for p in prompts] == [44, 44, 17]
    core = make_core(model_dir, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, (ids, _, items) in enumerate(prompts):
        assert core.add_request(EngineCoreRequest(f"r{i}", ids, params, mm_items=items)) == []
    outs, _ = drain(core)
    answers = [outs[f"r{i}"] for i in range(len(cases))]
    assert answers == [_hf_greedy(hf, ids, sample) for ids, sample, _ in prompts]
    assert answers[0] != answers[1]  # the same words, another image

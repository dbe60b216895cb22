"""workers/vision against Hugging Face: the tiny LLaVA (CLIP, 16 tokens an image) and Gemma 3 (SigLIP,
4 tokens a picture, pan & scan crops after the whole image) checkpoints, their images run through
the processor saved beside them; `ImageEncoder.encode` of each image gives the rows HF scatters
into that image's placeholder tokens, as many as the processor wrote."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from safetensors.torch import load_file

from tests.conftest import make_tiny_model
from workers.vision import ImageEncoder, build_image_encoder

HF_CLASSES = {
    "llava": transformers.LlavaForConditionalGeneration,
    "gemma3_vl": transformers.Gemma3ForConditionalGeneration,
    "qwen3_5_vl": transformers.Qwen3_5ForConditionalGeneration,
}


@pytest.fixture(scope="module")
def checkpoint(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path | None
) -> dict[str, Any]:
    """arch -> (directory, HF model, processor, loaded encoder), built on first use."""
    if tokenizer_dir is None:
        pytest.skip("needs the default model's tokenizer")
    built: dict[str, Any] = {}

    def get(arch: str) -> tuple[Path, Any, Any, ImageEncoder]:
        if arch not in built:
            model_dir = make_tiny_model(arch, tmp_path_factory.mktemp(arch), tokenizer_dir)
            hf = HF_CLASSES[arch].from_pretrained(model_dir, dtype=torch.float32).eval()
            processor = (  # Qwen3VLProcessor needs torchvision (videos): its image part
                transformers.AutoImageProcessor.from_pretrained(model_dir)
                if arch == "qwen3_5_vl"
                else transformers.AutoProcessor.from_pretrained(model_dir)
            )
            encoder = build_image_encoder(json.loads((model_dir / "config.json").read_text()))
            loaded = encoder.load_weights(load_file(model_dir / "model.safetensors").items())
            assert loaded == {name for name, _ in encoder.named_parameters()}
            built[arch] = (model_dir, hf, processor, encoder.eval())
        return built[arch]

    return get


def random_image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def hf_scattered_rows(
    hf: Any, inputs: dict[str, torch.Tensor], image_token_id: int
) -> torch.Tensor:
    """The rows of the embeddings HF's language model receives at the placeholder positions."""
    seen = {}

    def capture(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        seen["inputs_embeds"] = kwargs["inputs_embeds"]

    handle = hf.model.language_model.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with torch.no_grad():
            hf(**inputs)
    finally:
        handle.remove()
    return seen["inputs_embeds"][inputs["input_ids"] == image_token_id]


def encode_each(
    encoder: ImageEncoder, processor: Any, images: list[Image.Image], **image_kwargs: Any
) -> list[torch.Tensor]:
    """Each image through the processor's image processor alone, then the encoder."""
    out = []
    for image in images:
        tensors = processor.image_processor([image], return_tensors="pt", **image_kwargs)
        with torch.no_grad():
            out.append(encoder.encode(dict(tensors)))
    return out


def check_against_hf(arch: str, checkpoint: Any, images: list[Image.Image], **image_kwargs: Any):
    _, hf, processor, encoder = checkpoint(arch)
    assert encoder.image_token_id == hf.config.image_token_id
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": "What differs?"}]
    text = processor.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
    )
    inputs = processor(text=text, images=images, return_tensors="pt", **image_kwargs)
    features = encode_each(encoder, processor, images, **image_kwargs)
    num_placeholders = int((inputs["input_ids"] == encoder.image_token_id).sum())
    assert num_placeholders == sum(f.shape[0] for f in features)
    assert all(f.shape[1] == hf.config.text_config.hidden_size for f in features)
    # The images' pictures, one after the other, are what the processor batches.
    with torch.no_grad():
        hf_features = hf.get_image_features(pixel_values=inputs["pixel_values"]).pooler_output
    hf_rows = torch.cat(list(hf_features)).reshape(-1, hf.config.text_config.hidden_size)
    torch.testing.assert_close(torch.cat(features), hf_rows, atol=1e-5, rtol=0)
    scattered = hf_scattered_rows(hf, dict(inputs), encoder.image_token_id)
    torch.testing.assert_close(torch.cat(features), scattered, atol=1e-5, rtol=0)
    return text, inputs, features


@pytest.mark.parametrize("arch", ["llava", "gemma3_vl"])
def test_encoder_gives_the_rows_hf_scatters(arch: str, checkpoint: Any) -> None:
    images = [random_image(40, 56, seed=1), random_image(64, 48, seed=2)]
    _, _, features = check_against_hf(arch, checkpoint, images)
    rows = {"llava": 16, "gemma3_vl": 4}[arch]
    assert [f.shape[0] for f in features] == [rows, rows]
    assert (features[0] - features[1]).abs().max() > 1e-2  # two images, two sets of features


def test_gemma3_pan_and_scan_crops_follow_the_whole_image(checkpoint: Any) -> None:
    """A 3:1 image: the whole, then 3 crops, each 4 rows, in the order of the prompt's runs."""
    wide = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 8,
            "pan_and_scan_max_num_crops": 4, "pan_and_scan_min_ratio_to_activate": 1.2}  # fmt: skip
    images = [random_image(32, 96, seed=3), random_image(48, 48, seed=4)]  # crops, no crops
    text, inputs, features = check_against_hf("gemma3_vl", checkpoint, images, **wide)
    assert [f.shape[0] for f in features] == [16, 4]
    assert inputs["pixel_values"].shape[0] == 5
    assert text.count("<start_of_image>") == 2  # the processor expands each into its runs
    _, _, processor, _ = checkpoint("gemma3_vl")
    prompt = processor.decode(inputs["input_ids"][0])
    assert prompt.count("<start_of_image>") == 5 and "here are some crops" in prompt
    crops = features[0].reshape(4, 4, -1)
    assert all((crops[0] - crops[i]).abs().max() > 1e-2 for i in (1, 2, 3))


LLAVA_CONFIG = {
    "architectures": ["LlavaForConditionalGeneration"], "image_token_index": 7,
    "text_config": {"hidden_size": 64}, "vision_feature_layer": [-2, -1],
    "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                      "num_attention_heads": 2, "image_size": 32, "patch_size": 8},
}  # fmt: skip
GEMMA3_CONFIG = {
    "architectures": ["Gemma3ForConditionalGeneration"], "image_token_index": 9,
    "mm_tokens_per_image": 4, "text_config": {"hidden_size": 64},
    "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                      "num_attention_heads": 2, "image_size": 32, "patch_size": 8},
}  # fmt: skip


def test_checkpoint_names_map_to_the_encoder() -> None:
    """transformers-5 and older names, with or without the tower's `vision_model.`; None for the
    language model and for tower tensors no encoder runs; a stray tower tensor is an error."""
    llava = build_image_encoder(LLAVA_CONFIG)
    layer = "encoder.layers.1.self_attn.q_proj.weight"
    for prefix in ("model.vision_tower.", "vision_tower.", "model.vision_tower.vision_model.",
                   "vision_tower.vision_model."):  # fmt: skip
        assert llava.local_weight_name(prefix + layer) == "vision_tower." + layer
    for prefix in ("model.multi_modal_projector.", "multi_modal_projector."):
        assert (
            llava.local_weight_name(prefix + "linear_1.bias")
            == "multi_modal_projector.linear_1.bias"
        )
    assert llava.multi_modal_projector.linear_1.in_features == 64  # two layers side by side
    assert llava.image_token_id == 7
    for name in ("model.language_model.layers.0.mlp.up_proj.weight", "lm_head.weight",
                 "language_model.model.embed_tokens.weight",
                 "vision_tower.vision_model.embeddings.position_ids"):  # fmt: skip
        assert llava.local_weight_name(name) is None
    with pytest.raises(ValueError, match="no place"):
        llava.local_weight_name("vision_tower.encoder.layers.2.mlp.fc1.weight")
    gemma = build_image_encoder(GEMMA3_CONFIG)
    assert gemma.image_token_id == 9
    assert gemma.local_weight_name("vision_tower.vision_model.head.probe") is None
    assert (
        gemma.local_weight_name("model.multi_modal_projector.mm_input_projection_weight")
        == "multi_modal_projector.mm_input_projection_weight"
    )


def test_only_image_architectures_get_an_encoder() -> None:
    assert build_image_encoder({"architectures": ["LlamaForCausalLM"]}) is None
    assert build_image_encoder({}) is None
    with pytest.raises(ValueError, match="mm_tokens_per_image"):
        build_image_encoder({**GEMMA3_CONFIG, "mm_tokens_per_image": 9})  # 3 does not divide 4


def test_encode_takes_the_whole_image_then_its_crops() -> None:
    """Pictures batch independently: the rows of (whole, crop) are those of each alone, in order;
    a num_crops that disagrees with the pictures is refused."""
    torch.manual_seed(0)
    encoder = build_image_encoder(GEMMA3_CONFIG)
    with torch.no_grad():
        for p in encoder.parameters():
            p.normal_(0.0, 0.3)
        pictures = torch.randn(2, 3, 32, 32)
        both = encoder.encode({"pixel_values": pictures, "num_crops": torch.tensor([1])})
        alone = [encoder.encode({"pixel_values": pictures[i]}) for i in range(2)]
    torch.testing.assert_close(both, torch.cat(alone), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="num_crops"):
        encoder.encode({"pixel_values": pictures, "num_crops": torch.tensor([0])})


@pytest.mark.parametrize("layers", [-1, [0, -2, -1]])
def test_llava_keeps_the_class_token_and_stacks_layers(layers: int | list[int]) -> None:
    """ "full" keeps CLIP's class token (17 rows for 16 patches) and a list of layers is
    concatenated, as HF's; weights by the names a live transformers-5 model holds them under."""
    config = transformers.LlavaConfig(
        text_config=transformers.LlamaConfig(hidden_size=64, num_hidden_layers=1).to_dict(),
        vision_config=transformers.CLIPVisionConfig(**LLAVA_CONFIG["vision_config"]).to_dict(),
        vision_feature_layer=layers, vision_feature_select_strategy="full",
        multimodal_projector_bias=False, projector_hidden_act="quick_gelu",
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.LlavaForConditionalGeneration(config).eval()
    encoder = build_image_encoder({**config.to_dict(), "architectures": [type(hf).__name__]})
    loaded = encoder.load_weights(hf.state_dict().items())
    assert loaded == {name for name, _ in encoder.named_parameters()}
    pixel_values = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        expected = hf.get_image_features(pixel_values=pixel_values).pooler_output[0]
        got = encoder.encode({"pixel_values": pixel_values})
    assert got.shape == (17, 64)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_qwen3_5_encoder_gives_the_rows_hf_scatters(checkpoint: Any) -> None:
    """Qwen3.5's vision transformer (patch grid per image, interpolated position table, 2D rotary,
    the merger): each image alone gives HF's get_image_features rows and those HF scatters into
    its <|image_pad|> run; images of two shapes (2x4 and 4x3 merged tokens)."""
    model_dir, hf, image_processor, encoder = checkpoint("qwen3_5_vl")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    images = [random_image(20, 28, seed=1), random_image(64, 48, seed=2)]
    assert encoder.image_token_id == hf.config.image_token_id
    ids, features = tokenizer.encode("Look:"), []
    for image in images:
        tensors = dict(image_processor([image], return_tensors="pt"))
        with torch.no_grad():
            rows = encoder.encode(tensors)
            expected = hf.model.get_image_features(**tensors).pooler_output[0]
        # rtol 1e-6: rows reach ~20 (decisive random weights), where fp32 rounds at ~2e-6.
        torch.testing.assert_close(rows, expected, atol=1e-5, rtol=1e-6)
        features.append(rows)
        ids += [hf.config.vision_start_token_id] + [encoder.image_token_id] * rows.shape[0]
        ids += [hf.config.vision_end_token_id]
    assert [f.shape for f in features] == [(8, 64), (12, 64)]  # 2x4 and 4x3 merged tokens
    batch = dict(image_processor(images, return_tensors="pt"))
    input_ids = torch.tensor([ids])
    inputs = {**batch, "input_ids": input_ids,
              "mm_token_type_ids": (input_ids == encoder.image_token_id).int()}  # fmt: skip
    scattered = hf_scattered_rows(hf, inputs, encoder.image_token_id)
    torch.testing.assert_close(torch.cat(features), scattered, atol=1e-5, rtol=1e-6)


def test_qwen3_5_names_map_to_the_encoder() -> None:
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "image_token_id": 5,
              "vision_config": {"depth": 1, "hidden_size": 32, "intermediate_size": 64,
                                "num_heads": 2, "out_hidden_size": 64, "patch_size": 4,
                                "num_position_embeddings": 16}}  # fmt: skip
    qwen = build_image_encoder(config)
    assert qwen.image_token_id == 5
    for prefix in ("model.visual.", "visual."):
        assert qwen.local_weight_name(prefix + "merger.linear_fc2.bias") == (
            "vision_tower.merger.linear_fc2.bias"
        )
    assert qwen.local_weight_name("model.language_model.layers.0.mlp.up_proj.weight") is None
    with pytest.raises(ValueError, match="no place"):
        qwen.local_weight_name("model.visual.deepstack_merger_list.0.norm.weight")

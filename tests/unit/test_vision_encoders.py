"""workers/vision against Hugging Face: the tiny LLaVA (CLIP, 16 tokens an image), Gemma 3 (SigLIP,
4 tokens a picture, pan & scan crops after the whole image) and Idefics3 (SmolVLM's: 4 tokens a
tile, its tiles then the whole image) checkpoints, their images run through the processor saved
beside them; `ImageEncoder.encode` of each image gives the rows HF scatters into that image's
placeholder tokens, as many as the processor wrote."""

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
from workers.models.decoder import language_model_name
from workers.vision import ImageEncoder, build_image_encoder
from workers.vision.encoders import deepstack_layers

HF_CLASSES = {
    "llava": transformers.LlavaForConditionalGeneration,
    "gemma3_vl": transformers.Gemma3ForConditionalGeneration,
    "idefics3": transformers.Idefics3ForConditionalGeneration,
    "qwen3_5_vl": transformers.Qwen3_5ForConditionalGeneration,
    "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
    "qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
    "qwen2_vl": transformers.Qwen2VLForConditionalGeneration,
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
                if arch in ("qwen3_5_vl", "qwen2_5_vl", "qwen3_vl", "qwen2_vl")
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

    language_model = getattr(hf.model, "language_model", None) or hf.model.text_model
    handle = language_model.register_forward_pre_hook(capture, with_kwargs=True)
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
    pixels = {k: v for k, v in inputs.items() if k.startswith("pixel_")}  # Idefics3's mask too
    with torch.no_grad():
        hf_features = hf.get_image_features(**pixels).pooler_output
    hf_rows = torch.cat(list(hf_features)).reshape(-1, hf.config.text_config.hidden_size)
    torch.testing.assert_close(torch.cat(features), hf_rows, atol=1e-5, rtol=0)
    scattered = hf_scattered_rows(hf, dict(inputs), encoder.image_token_id)
    torch.testing.assert_close(torch.cat(features), scattered, atol=1e-5, rtol=0)
    return text, inputs, features


@pytest.mark.parametrize("arch", ["llava", "gemma3_vl", "idefics3"])
def test_encoder_gives_the_rows_hf_scatters(arch: str, checkpoint: Any) -> None:
    images = [random_image(40, 56, seed=1), random_image(64, 48, seed=2)]
    _, _, features = check_against_hf(arch, checkpoint, images)
    rows = {"llava": 16, "gemma3_vl": 4, "idefics3": 20}[arch]  # idefics3: 2 x 2 tiles + whole
    assert [f.shape[0] for f in features] == [rows, rows]
    assert (features[0] - features[1]).abs().max() > 1e-2  # two images, two sets of features


def _random_model_and_encoder(model_class: type, config: Any) -> tuple[Any, Any]:
    """Hugging Face's model with decisive random weights, and tern's encoder loaded from them
    (every parameter of the encoder, none left over)."""
    torch.manual_seed(0)
    hf = model_class(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    encoder = build_image_encoder({**config.to_dict(), "architectures": [type(hf).__name__]})
    loaded = encoder.load_weights(hf.state_dict().items())
    assert loaded == {name for name, _ in encoder.named_parameters()}
    return hf, encoder


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


def test_idefics3_tiles_then_the_whole_image(checkpoint: Any) -> None:
    """A 24 x 64 image is 1 x 2 tiles and the whole (12 rows), a 40 x 56 one 2 x 2 and the whole
    (20): each tile's 4 rows after its <row_r_col_c>, the whole image's after <global-img>; one
    image through the processor alone gives the tensors it has in the two-image prompt."""
    images = [random_image(24, 64, seed=3), random_image(40, 56, seed=4)]
    _, inputs, features = check_against_hf("idefics3", checkpoint, images)
    assert [f.shape[0] for f in features] == [12, 20]
    _, _, processor, _ = checkpoint("idefics3")
    prompt = processor.decode(inputs["input_ids"][0])
    assert prompt.count("<global-img>") == 2 and prompt.count("<row_1_col_2>") == 2
    assert prompt.count("<row_2_col_2>") == 1
    alone = [processor(text=["<image>"], images=[[im]], return_tensors="pt") for im in images]
    torch.testing.assert_close(
        torch.cat([a["pixel_values"] for a in alone], dim=1), inputs["pixel_values"]
    )
    pictures = features[1].reshape(5, 4, -1)  # 4 tiles, then the whole image
    assert all((pictures[i] - pictures[j]).abs().max() > 1e-2 for i in range(5) for j in range(i))


def test_idefics3_unsplit_images_are_one_picture(checkpoint: Any) -> None:
    images = [random_image(24, 64, seed=5), random_image(64, 64, seed=6)]
    _, _, features = check_against_hf("idefics3", checkpoint, images, do_image_splitting=False)
    assert [f.shape[0] for f in features] == [4, 4]


def test_idefics3_padded_pictures_and_scaled_positions_match_hf() -> None:
    """Pictures smaller than the tower's grid read its position embeddings at scaled positions, and
    padding (pixel_attention_mask 0) is attended by no patch: as Hugging Face's, with the tower's
    64 px grid under 32 px pictures, one of them half padding."""
    vision = transformers.Idefics3VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        image_size=64, patch_size=8,
    )  # fmt: skip
    config = transformers.Idefics3Config(
        text_config=transformers.LlamaConfig(
            hidden_size=64, num_hidden_layers=1, vocab_size=128, intermediate_size=64
        ).to_dict(),
        vision_config=vision.to_dict(), scale_factor=2, image_token_id=100,
    )  # fmt: skip
    hf, encoder = _random_model_and_encoder(transformers.Idefics3ForConditionalGeneration, config)
    pixel_values = torch.randn(1, 2, 3, 32, 32)
    mask = torch.ones(1, 2, 32, 32, dtype=torch.long)
    mask[0, 1, 16:, :] = 0  # the second picture's bottom half is padding
    mask[0, 1, :, 24:] = 0
    pixel_values[0, 1] *= mask[0, 1]
    tensors = {"pixel_values": pixel_values, "pixel_attention_mask": mask}
    with torch.no_grad():
        expected = torch.cat(hf.get_image_features(**tensors).pooler_output)
        got = encoder.encode(tensors)
    assert got.shape == (8, 64)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_idefics3_checkpoint_names() -> None:
    """The tower is model.vision_model, the projector model.connector; the text model's tensors
    (model.text_model.*) load into the language model under its own names."""
    encoder = build_image_encoder(
        {"architectures": ["Idefics3ForConditionalGeneration"], "image_token_id": 5,
         "text_config": {"hidden_size": 64}, "scale_factor": 2,
         "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                           "num_attention_heads": 2, "image_size": 32, "patch_size": 8}}
    )  # fmt: skip
    assert encoder.image_token_id == 5
    assert encoder.multi_modal_projector.modality_projection.proj.in_features == 128
    layer = "encoder.layers.0.mlp.fc1.weight"
    assert encoder.local_weight_name("model.vision_model." + layer) == "vision_tower." + layer
    assert (
        encoder.local_weight_name("model.connector.modality_projection.proj.weight")
        == "multi_modal_projector.modality_projection.proj.weight"
    )
    for name in ("model.text_model.embed_tokens.weight", "lm_head.weight"):
        assert encoder.local_weight_name(name) is None
    with pytest.raises(ValueError, match="no place"):
        encoder.local_weight_name("model.vision_model.encoder.layers.1.mlp.fc1.weight")
    assert language_model_name("model.text_model.layers.0.mlp.up_proj.weight") == (
        "model.layers.0.mlp.up_proj.weight"
    )
    assert language_model_name("model.vision_model." + layer) is None
    assert language_model_name("model.connector.modality_projection.proj.weight") is None
    assert language_model_name("lm_head.weight") == "lm_head.weight"


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


ONEVISION_GRIDS = [[32, 32], [32, 64], [64, 32], [64, 64]]


@pytest.fixture(scope="module")
def onevision() -> tuple[Any, Any, ImageEncoder]:
    """A random LLaVA-OneVision (2-layer SigLIP, 32 px views of 16 patches, grids up to 2 x 2
    views, shrunk past 2 views' worth), its PIL image processor and the encoder loaded from the
    model's transformers-5 tensor names. (Its full processor needs torchvision for videos.)"""
    config = transformers.LlavaOnevisionConfig(
        text_config=transformers.Qwen2Config(
            hidden_size=64, num_hidden_layers=1, vocab_size=128, intermediate_size=64,
            num_attention_heads=4, num_key_value_heads=2,
        ).to_dict(),
        vision_config=transformers.SiglipVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            image_size=32, patch_size=8, vision_use_head=False,
        ).to_dict(),
        vision_feature_layer=-1, vision_feature_select_strategy="full",
        image_grid_pinpoints=ONEVISION_GRIDS, vision_aspect_ratio="anyres_max_2",
        image_token_index=100, video_token_index=101,
    )  # fmt: skip
    hf, encoder = _random_model_and_encoder(
        transformers.LlavaOnevisionForConditionalGeneration, config
    )
    image_processor = transformers.LlavaOnevisionImageProcessorPil(
        size={"height": 32, "width": 32}, image_grid_pinpoints=ONEVISION_GRIDS
    )
    return hf, image_processor, encoder.eval()


@pytest.mark.parametrize(
    ("size", "rows"),
    [((40, 56), 16 + 4 * 7), ((64, 64), 16 + 5 * 6), ((20, 90), 16 + 2 * 9),
     ((24, 64), 16 + 4 * 9), ((64, 24), 16 + 8 * 5)],
)  # fmt: skip
def test_llava_onevision_anyres_rows_match_hf(
    onevision: tuple[Any, Any, ImageEncoder], size: tuple[int, int], rows: int
) -> None:
    """One image alone: the base view's 16 rows, then its grid of views (2 x 2: 8 x 8 patches;
    1 x 2: 4 x 8; 2 x 1: 8 x 4) unpadded to the image's aspect (40 x 56: 6 of 8 rows; 20 x 90: 2 of
    4), shrunk when over 2 views' worth (6 x 8 -> 4 x 6, 8 x 8 -> 5 x 5), each row then a newline;
    as HF's features and the rows it scatters."""
    hf, image_processor, encoder = onevision
    tensors = dict(image_processor([random_image(*size, seed=sum(size))], return_tensors="pt"))
    with torch.no_grad():
        got = encoder.encode(tensors)
        expected = hf.model.get_image_features(**tensors).pooler_output[0]
    assert got.shape == (rows, 64)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    input_ids = torch.tensor([[1, 2, *[100] * rows, 3]])
    scattered = hf_scattered_rows(hf, {"input_ids": input_ids, **tensors}, 100)
    torch.testing.assert_close(got, scattered, atol=1e-5, rtol=0)


def test_llava_onevision_images_sharing_a_prompt_are_their_base_view(
    onevision: tuple[Any, Any, ImageEncoder],
) -> None:
    """Two images in one prompt: each is its base view and one newline (17 rows), as HF encodes a
    two-image sample. NOTE: the processor pads such an image to a square before resizing it, so
    its tensors are not those it has alone: each image's item must carry the tensors of its
    prompt (pixel_values[i], image_sizes[i], batch_num_images)."""
    hf, image_processor, encoder = onevision
    images = [random_image(40, 56, seed=7), random_image(64, 24, seed=8)]
    sample = dict(image_processor([images], return_tensors="pt"))
    assert sample["batch_num_images"].tolist() == [2]
    with torch.no_grad():
        expected = hf.model.get_image_features(**sample).pooler_output
        got = [
            encoder.encode({"pixel_values": sample["pixel_values"][i : i + 1],
                            "image_sizes": sample["image_sizes"][i : i + 1],
                            "batch_num_images": sample["batch_num_images"]})
            for i in range(2)
        ]  # fmt: skip
    assert [g.shape[0] for g in got] == [17, 17]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=0)
    assert (got[0] - got[1]).abs().max() > 1e-2
    alone = image_processor([images[0]], return_tensors="pt")["pixel_values"]
    assert (alone[0, 0] - sample["pixel_values"][0, 0]).abs().max() > 1e-2  # not the same view


def test_llava_onevision_checkpoint_names(onevision: tuple[Any, Any, ImageEncoder]) -> None:
    _, _, encoder = onevision
    for name in ("model.image_newline", "image_newline"):  # transformers 5, llava-hf's releases
        assert encoder.local_weight_name(name) == "multi_modal_projector.image_newline"
        assert language_model_name(name) is None
    assert (
        encoder.local_weight_name("vision_tower.vision_model.post_layernorm.bias")
        == "vision_tower.post_layernorm.bias"
    )
    assert encoder.local_weight_name("model.language_model.norm.weight") is None


@pytest.mark.parametrize("arch", ["qwen3_5_vl", "qwen2_5_vl", "qwen3_vl", "qwen2_vl"])
def test_qwen_encoder_gives_the_rows_hf_scatters(arch: str, checkpoint: Any) -> None:
    """Qwen3.5's vision transformer (patch grid per image, interpolated position table, 2D rotary,
    the merger), Qwen2.5-VL's (RMSNorm blocks, windows of 2x2 merged tokens in its first block,
    the whole image in its second), Qwen3-VL's (Qwen3.5's with two deepstack mergers, whose rows
    follow the main one) and Qwen2-VL's (LayerNorm blocks, quick-GELU MLPs, no windows): each image alone gives HF's get_image_features rows and those HF
    scatters into its <|image_pad|> run; images of two shapes (2x4 and 4x3 merged tokens:
    Qwen2.5-VL's windows of 4 and of 2 merged tokens)."""
    model_dir, hf, image_processor, encoder = checkpoint(arch)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    images = [random_image(20, 28, seed=1), random_image(64, 48, seed=2)]
    assert encoder.image_token_id == hf.config.image_token_id
    ids, features = tokenizer.encode("Look:"), []
    for image in images:
        tensors = dict(image_processor([image], return_tensors="pt"))
        with torch.no_grad():
            rows = encoder.encode(tensors)
            hf_out = hf.model.get_image_features(**tensors)
        deepstack = [f[0] for f in getattr(hf_out, "deepstack_features", None) or []]
        assert len(deepstack) == (2 if arch == "qwen3_vl" else 0)
        expected = torch.cat([hf_out.pooler_output[0], *deepstack], -1)
        # rtol 1e-6: rows reach ~20 (decisive random weights), where fp32 rounds at ~2e-6;
        # Qwen2.5-VL's atol 2e-5: HF's own sdpa and eager towers differ by 1.1e-5 on it.
        atol = 2e-5 if arch == "qwen2_5_vl" else 1e-5
        torch.testing.assert_close(rows, expected, atol=atol, rtol=1e-6)
        features.append(rows[:, :64])  # the main rows: what the placeholders' embeddings become
        ids += [hf.config.vision_start_token_id] + [encoder.image_token_id] * rows.shape[0]
        ids += [hf.config.vision_end_token_id]
    assert [f.shape for f in features] == [(8, 64), (12, 64)]  # 2x4 and 4x3 merged tokens
    batch = dict(image_processor(images, return_tensors="pt"))
    input_ids = torch.tensor([ids])
    inputs = {**batch, "input_ids": input_ids,
              "mm_token_type_ids": (input_ids == encoder.image_token_id).int()}  # fmt: skip
    scattered = hf_scattered_rows(hf, inputs, encoder.image_token_id)
    torch.testing.assert_close(torch.cat(features), scattered, atol=atol, rtol=1e-6)


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


def test_qwen3_vl_deepstack_mergers_load_and_widen_the_rows() -> None:
    config = {"architectures": ["Qwen3VLForConditionalGeneration"],
              "vision_config": {"depth": 3, "hidden_size": 32, "intermediate_size": 64,
                                "num_heads": 2, "out_hidden_size": 64, "patch_size": 4,
                                "num_position_embeddings": 16,
                                "deepstack_visual_indexes": [0, 1]}}  # fmt: skip
    assert deepstack_layers(config) == 2
    assert (
        deepstack_layers({**config, "architectures": ["Qwen3VLMoeForConditionalGeneration"]}) == 2
    )
    assert deepstack_layers({**config, "architectures": ["Qwen3_5ForConditionalGeneration"]}) == 0
    qwen = build_image_encoder(config)
    assert qwen.local_weight_name("model.visual.deepstack_merger_list.1.norm.weight") == (
        "vision_tower.deepstack_merger_list.1.norm.weight"
    )
    with pytest.raises(ValueError, match="no place"):
        qwen.local_weight_name("model.visual.deepstack_merger_list.2.norm.weight")


def test_qwen2_vl_names_map_to_the_encoder() -> None:
    """config.json's embed_dim is the tower's width, its hidden_size the merger's output."""
    config = {"architectures": ["Qwen2VLForConditionalGeneration"],
              "vision_config": {"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2,
                                "mlp_ratio": 2, "patch_size": 4}}  # fmt: skip
    qwen = build_image_encoder(config)
    assert qwen.image_token_id == 151655  # Qwen2VLConfig's default
    for prefix in ("model.visual.", "visual."):
        for name in ("merger.mlp.2.bias", "merger.ln_q.bias", "blocks.0.mlp.fc1.weight",
                     "blocks.0.norm2.bias"):  # fmt: skip
            assert qwen.local_weight_name(prefix + name) == "vision_tower." + name
    params = dict(qwen.named_parameters())
    assert params["vision_tower.blocks.0.mlp.fc1.weight"].shape == (64, 32)
    assert params["vision_tower.merger.mlp.2.weight"].shape == (64, 128)
    with pytest.raises(ValueError, match="no place"):
        qwen.local_weight_name("visual.patch_embed.proj.bias")  # Qwen2-VL's has none


def test_qwen2_5_vl_names_map_to_the_encoder() -> None:
    """transformers-5 names (`model.visual.*`) and the released checkpoints' (`visual.*`, the
    language model's under `model.`), Hugging Face's merger (`mlp.0`, `mlp.2`, `ln_q`)."""
    config = {"architectures": ["Qwen2_5_VLForConditionalGeneration"],
              "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64,
                                "num_heads": 2, "out_hidden_size": 64, "patch_size": 4,
                                "fullatt_block_indexes": [1], "window_size": 16}}  # fmt: skip
    qwen = build_image_encoder(config)
    assert qwen.image_token_id == 151655  # Qwen2_5_VLConfig's default
    for prefix in ("model.visual.", "visual."):
        for name in ("merger.mlp.2.bias", "merger.ln_q.weight", "blocks.1.mlp.gate_proj.weight",
                     "patch_embed.proj.weight"):  # fmt: skip
            assert qwen.local_weight_name(prefix + name) == "vision_tower." + name
    assert qwen.local_weight_name("model.layers.0.mlp.up_proj.weight") is None
    assert language_model_name("visual.blocks.0.norm1.weight") is None
    with pytest.raises(ValueError, match="no place"):
        qwen.local_weight_name("visual.patch_embed.proj.bias")  # Qwen2.5-VL's has none

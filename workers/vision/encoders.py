"""`build_image_encoder(hf_config)`: the vision tower and multi-modal projector of a checkpoint
released with one, as one `ImageEncoder` module, or None for architectures without image input.

`ImageEncoder.encode` takes ONE image's tensors as the Hugging Face processor returns them and
gives the rows that replace that image's placeholder tokens (`image_token_id`) in the prompt's
embeddings, in prompt order: (num_placeholder_tokens, text hidden size).
- LLaVA: `pixel_values` (1, 3, S, S) -> one row per patch ((S / patch)^2, the class token dropped
  under "default").
- Gemma 3: `pixel_values` (1 + num_crops, 3, S, S): the whole image, then its pan-and-scan crops,
  which is the order the processor writes their placeholder runs in the prompt -> mm_tokens_per_image
  rows per picture, concatenated.
- Idefics3 / SmolVLM: `pixel_values` (1, N, 3, S, S) and `pixel_attention_mask` (1, N, S, S): the
  tiles row by row, then the whole image (or the whole image alone, unsplit) -> (S / patch /
  scale_factor)^2 rows per picture, concatenated: the order of the processor's `<image>` runs.
- LLaVA-OneVision: `pixel_values` (1, N, 3, S, S), `image_sizes` (1, 2), `batch_num_images` ->
  the base view's rows, then the grid's unpadded rows each followed by `image_newline`; or, for an
  image sharing its prompt (batch_num_images > 1), the base view's rows and one newline. NOTE: the
  processor pads such an image to a square first, so its tensors must be its share of the
  prompt's output, not the image processed alone. A video: `pixel_values_videos` (1, F, 3, S, S)
  -> each frame's rows pooled 2x2 (ceil(S / patch / 2)^2 a frame), then one `image_newline`.
- Mistral 3 (Pixtral): `pixel_values` (1, 3, H', W') padded beyond `image_sizes` (1, 2) -> one row
  per 2x2 block of patches, row by row: the `[IMG]` runs the processor separates with
  `[IMG_BREAK]`.
- Qwen3.5, Qwen2-VL, Qwen2.5-VL, Qwen3-VL: `pixel_values` (t h w, C T P P) patches and
  `image_grid_thw` (1, 3) -> one row per spatial_merge_size^2 block of patches (t h w / m^2);
  a video's `pixel_values_videos` and `video_grid_thw` alike;
  Qwen3-VL's rows carry its deepstack rows after the main one (`deepstack_layers` hidden sizes
  more).

Weights: the encoder takes the same stream of checkpoint tensors as the language model;
`local_weight_name` says which are its own (transformers-5 `model.vision_tower.*` /
`model.multi_modal_projector.*`, or the older names without `model.`, with or without the tower's
`vision_model.` level; Idefics3's `model.vision_model.*` / `model.connector.*`; LLaVA-OneVision's
`model.image_newline`; Qwen3.5's `model.visual.*`, tower and merger in
one) and what its parameter is called; None for every other tensor.

Tensor parallelism: the encoder is replicated whole on every rank (no sharding): it is small next
to the language model, runs once per image, and each rank then holds the rows it scatters.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from workers.vision.clip import CLIPVisionTransformer, clip_vision_config
from workers.vision.idefics3 import (
    Idefics3Connector,
    Idefics3VisionTransformer,
    idefics3_vision_config,
)
from workers.vision.llava_onevision import LlavaOnevisionProjector
from workers.vision.pixtral import (
    Mistral3MultiModalProjector,
    PixtralConfig,
    PixtralVisionTransformer,
)
from workers.vision.projectors import Gemma3MultiModalProjector, LlavaMultiModalProjector
from workers.vision.qwen2_5_vit import Qwen25VisionConfig, Qwen25VisionTransformer
from workers.vision.qwen2_vit import Qwen2VisionConfig, Qwen2VisionTransformer
from workers.vision.qwen_vit import QwenVisionConfig, QwenVisionTransformer
from workers.vision.siglip import SiglipVisionTransformer, siglip_vision_config

_TOWER_PREFIXES = ("model.vision_tower.", "vision_tower.")
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")
# Vision-tower tensors a checkpoint may carry that no encoder runs: the position ids older
# checkpoints saved as a buffer, SigLIP's attention-pooling head (Gemma 3 takes the patches).
_UNUSED_TOWER_TENSORS = ("embeddings.position_ids", "head.")


class ImageEncoder(nn.Module):
    """A vision tower and the projector after it. CHECKPOINT_PREFIXES: for each, the checkpoint's
    prefixes of its tensors (tried in order) and the submodule that holds them here."""

    CHECKPOINT_PREFIXES: tuple[tuple[tuple[str, ...], str], ...] = (
        (_TOWER_PREFIXES, "vision_tower."),
        (_PROJECTOR_PREFIXES, "multi_modal_projector."),
    )

    def __init__(
        self, vision_tower: nn.Module, multi_modal_projector: nn.Module, image_token_id: int
    ):
        super().__init__()
        self.vision_tower = vision_tower
        self.multi_modal_projector = multi_modal_projector
        self.image_token_id = image_token_id
        self._parameter_names = frozenset(name for name, _ in self.named_parameters())

    def encode(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's processor outputs -> (num_placeholder_tokens, text hidden size)."""
        pixel_values = tensors["pixel_values"]
        if pixel_values.dim() == 3:  # (3, S, S): one picture without its batch dimension
            pixel_values = pixel_values.unsqueeze(0)
        num_crops = tensors.get("num_crops")
        if num_crops is not None and int(num_crops.sum()) + 1 != pixel_values.shape[0]:
            raise ValueError(
                f"num_crops {num_crops.tolist()} does not match {pixel_values.shape[0]} pictures "
                "(one image: the whole, then its crops)"
            )
        weight = next(self.parameters())  # the encoder's device and dtype
        features = self.vision_tower(pixel_values.to(weight.device, weight.dtype))
        return self.multi_modal_projector(features).flatten(0, 1)  # pictures in processor order

    def local_weight_name(self, checkpoint_name: str) -> str | None:
        """This module's parameter for a checkpoint tensor; None for the language model's (and
        for the tower's tensors no encoder runs). A tower or projector tensor this module has no
        parameter for is a ValueError: a checkpoint it would silently half-load."""
        for prefixes, local in self.CHECKPOINT_PREFIXES:
            prefix = next((p for p in prefixes if checkpoint_name.startswith(p)), None)
            if prefix is None:
                continue
            rest = checkpoint_name[len(prefix) :]
            if local == "vision_tower.":
                rest = rest.removeprefix("vision_model.")
                if rest.startswith(_UNUSED_TOWER_TENSORS):
                    return None
            name = local + rest
            if name not in self._parameter_names:
                raise ValueError(f"checkpoint tensor {checkpoint_name} has no place in the encoder")
            return name
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy the encoder's tensors out of a checkpoint's (name, tensor) stream, skipping the
        rest; returns the parameters loaded."""
        params = dict(self.named_parameters())
        loaded = set()
        with torch.no_grad():
            for checkpoint_name, tensor in weights:
                name = self.local_weight_name(checkpoint_name)
                if name is None:
                    continue
                if params[name].shape != tensor.shape:
                    raise ValueError(
                        f"{checkpoint_name}: shape {tuple(tensor.shape)}, the encoder's "
                        f"{name} is {tuple(params[name].shape)}"
                    )
                params[name].copy_(tensor)
                loaded.add(name)
        return loaded


class Idefics3ImageEncoder(ImageEncoder):
    """Idefics3 / SmolVLM: the tower is `model.vision_model`, the projector `model.connector`.
    One image is `pixel_values` (1, N, 3, S, S) and `pixel_attention_mask` (1, N, S, S): its
    tiles row by row, then the whole image shrunk to one tile (or the whole image alone when it
    is not split), the order of the `<image>` runs the processor writes (each after
    `<fake_token_around_image><row_r_col_c>`, the whole image's after `<global-img>`)."""

    CHECKPOINT_PREFIXES = (
        (("model.vision_model.", "vision_model."), "vision_tower."),
        (("model.connector.", "connector."), "multi_modal_projector."),
    )

    def encode(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """-> (N * rows a picture, text hidden size), pictures in processor order."""
        pixel_values = tensors["pixel_values"]
        pixel_values = pixel_values.reshape(-1, *pixel_values.shape[-3:])  # (N, 3, S, S)
        mask = tensors.get("pixel_attention_mask")
        if mask is not None:
            mask = mask.reshape(-1, *mask.shape[-2:])  # (N, S, S)
            if mask.shape[0] != pixel_values.shape[0]:
                raise ValueError(
                    f"pixel_attention_mask has {mask.shape[0]} pictures, pixel_values "
                    f"{pixel_values.shape[0]}"
                )
            mask = mask.to(pixel_values.device)
        weight = next(self.parameters())
        features = self.vision_tower(pixel_values.to(weight.device, weight.dtype), mask)
        return self.multi_modal_projector(features).flatten(0, 1)


class LlavaOnevisionImageEncoder(ImageEncoder):
    """LLaVA-OneVision: one image is `pixel_values` (1, N, 3, S, S) (the base view, then the
    grid's tiles, then padding to the batch's N), `image_sizes` (1, 2) and `batch_num_images`; its
    rows are laid out by the projector (llava_onevision.py). A video is `pixel_values_videos`
    (1, F, 3, S, S), its frames pooled by the projector. The checkpoint's `image_newline` is the
    projector's."""

    CHECKPOINT_PREFIXES = (
        *ImageEncoder.CHECKPOINT_PREFIXES,
        (("model.image_newline", "image_newline"), "multi_modal_projector.image_newline"),
    )

    def encode(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        weight = next(self.parameters())
        if "pixel_values_videos" in tensors:  # one video: (1, F, 3, S, S) frames
            frames = tensors["pixel_values_videos"]
            frames = frames.reshape(-1, *frames.shape[-3:]).to(weight.device, weight.dtype)
            projected = self.multi_modal_projector(self.vision_tower(frames))
            return self.multi_modal_projector.video_layout(projected)
        pixel_values = tensors["pixel_values"]
        pixel_values = pixel_values.reshape(-1, *pixel_values.shape[-3:])  # (N, 3, S, S)
        height, width = (int(v) for v in tensors["image_sizes"].reshape(-1, 2)[0])
        shared = tensors.get("batch_num_images")
        shares_prompt = shared is not None and int(shared.reshape(-1)[0]) > 1
        num_pictures = (
            1 if shares_prompt else self.multi_modal_projector.num_pictures((height, width))
        )
        if num_pictures > pixel_values.shape[0]:
            raise ValueError(
                f"a {height}x{width} image is {num_pictures} pictures, pixel_values holds "
                f"{pixel_values.shape[0]}"
            )
        features = self.vision_tower(pixel_values[:num_pictures].to(weight.device, weight.dtype))
        pictures = self.multi_modal_projector(features)  # (N, P, text hidden)
        return self.multi_modal_projector.layout(pictures, (height, width))


class Mistral3ImageEncoder(ImageEncoder):
    """Mistral 3: the Pixtral tower at the image's own size, then the projector's 2x2 merge."""

    def encode(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        pixel_values = tensors["pixel_values"].reshape(-1, *tensors["pixel_values"].shape[-3:])
        height, width = (int(v) for v in tensors["image_sizes"].reshape(-1, 2)[0])
        if (
            pixel_values.shape[0] != 1
            or height > pixel_values.shape[-2]
            or (width > pixel_values.shape[-1])
        ):
            raise ValueError(
                f"one {height}x{width} image expected, pixel_values is {tuple(pixel_values.shape)}"
            )
        weight = next(self.parameters())
        features = self.vision_tower(pixel_values.to(weight.device, weight.dtype), (height, width))
        patch = self.vision_tower.config.patch_size
        return self.multi_modal_projector(features, height // patch, width // patch)


class QwenImageEncoder(ImageEncoder):
    """The Qwen VL towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5): the vision transformer ends in
    its own merger (no separate projector), and each image brings its patch grid
    (`image_grid_thw`). A video is encoded the same way, from `pixel_values_videos` and
    `video_grid_thw` (each frame pair attends within itself)."""

    CHECKPOINT_PREFIXES = ((("model.visual.", "visual."), "vision_tower."),)

    def encode(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        kind = "video" if "video_grid_thw" in tensors else "image"
        pixels = "pixel_values_videos" if kind == "video" else "pixel_values"
        grid = tensors[f"{kind}_grid_thw"].reshape(-1, 3)
        if grid.shape[0] != 1:
            raise ValueError(f"one {kind}'s tensors, not {grid.shape[0]} {kind}s'")
        weight = next(self.parameters())
        patches = tensors[pixels].to(weight.device, weight.dtype)
        t, h, w = (int(v) for v in grid[0])
        return self.multi_modal_projector(self.vision_tower(patches, (t, h, w)))


def image_token_id_of(hf_config: dict[str, Any], default: int) -> int:
    return int(hf_config.get("image_token_id", hf_config.get("image_token_index", default)))


def _llava(hf: dict[str, Any]) -> ImageEncoder:
    vision = hf.get("vision_config") or {}
    if vision.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise ValueError(f"LLaVA with a {vision['model_type']} vision tower is not supported")
    tower = CLIPVisionTransformer(
        clip_vision_config(vision),
        hf.get("vision_feature_layer", -2),
        hf.get("vision_feature_select_strategy", "default"),
    )
    text_hidden = (hf.get("text_config") or {}).get("hidden_size", 4096)  # LlamaConfig's default
    projector = LlavaMultiModalProjector(
        tower.feature_size, text_hidden, hf.get("projector_hidden_act", "gelu"),
        hf.get("multimodal_projector_bias", True),
    )  # fmt: skip
    return ImageEncoder(tower, projector, image_token_id_of(hf, 32000))


def _gemma3(hf: dict[str, Any]) -> ImageEncoder:
    config = siglip_vision_config(hf.get("vision_config") or {})
    text_hidden = (hf.get("text_config") or {}).get("hidden_size", 2304)  # Gemma3TextConfig's
    projector = Gemma3MultiModalProjector(
        config.hidden_size, text_hidden, config.patches_per_side,
        hf.get("mm_tokens_per_image", 256), config.layer_norm_eps,
    )  # fmt: skip
    return ImageEncoder(SiglipVisionTransformer(config), projector, image_token_id_of(hf, 262144))


def _idefics3(hf: dict[str, Any]) -> ImageEncoder:
    config = idefics3_vision_config(hf.get("vision_config") or {})
    text_hidden = (hf.get("text_config") or {}).get("hidden_size", 4096)  # LlamaConfig's default
    connector = Idefics3Connector(config.hidden_size, text_hidden, hf.get("scale_factor", 2))
    return Idefics3ImageEncoder(
        Idefics3VisionTransformer(config), connector, image_token_id_of(hf, 128257)
    )


def _llava_onevision(hf: dict[str, Any]) -> ImageEncoder:
    vision = hf.get("vision_config") or {}
    if vision.get("model_type", "siglip_vision_model") != "siglip_vision_model":
        raise ValueError(f"LLaVA-OneVision with a {vision['model_type']} tower is not supported")
    # LlavaOnevisionConfig's SigLIP (so400m, 384 px, patch 14), for what config.json leaves out.
    vision = {"hidden_size": 1152, "intermediate_size": 4304, "patch_size": 14, "image_size": 384,
              "num_hidden_layers": 26, "num_attention_heads": 16, **vision}  # fmt: skip
    config = siglip_vision_config(vision)
    tower = SiglipVisionTransformer(
        config, hf.get("vision_feature_layer", -1), hf.get("vision_feature_select_strategy", "full")
    )
    if not hf.get("image_grid_pinpoints"):
        raise ValueError("LLaVA-OneVision's config.json has no image_grid_pinpoints")
    text_hidden = (hf.get("text_config") or {}).get("hidden_size", 4096)  # Qwen2Config's default
    projector = LlavaOnevisionProjector(
        tower.feature_size, text_hidden, hf.get("projector_hidden_act", "gelu"),
        hf.get("multimodal_projector_bias", True), config.image_size, config.patches_per_side,
        hf["image_grid_pinpoints"], hf.get("vision_aspect_ratio", "anyres_max_9"),
    )  # fmt: skip
    return LlavaOnevisionImageEncoder(tower, projector, image_token_id_of(hf, 151646))


def _mistral3(hf: dict[str, Any]) -> ImageEncoder:
    vision = hf.get("vision_config") or {}
    if vision.get("model_type", "pixtral") != "pixtral":
        raise ValueError(f"Mistral 3 with a {vision['model_type']} tower is not supported")
    layer = hf.get("vision_feature_layer", -1)
    if not isinstance(layer, int):
        raise ValueError("Mistral 3 with several vision feature layers is not supported")
    config = PixtralConfig.from_hf(vision)
    text = hf.get("text_config") or {}
    projector = Mistral3MultiModalProjector(
        config.hidden_size,
        text.get("hidden_size", 5120),
        hf.get("spatial_merge_size", 2),
        text.get("rms_norm_eps", 1e-5),
        hf.get("projector_hidden_act", "gelu"),
        hf.get("multimodal_projector_bias", False),
    )  # fmt: skip  (Mistral3Config's defaults)
    return Mistral3ImageEncoder(
        PixtralVisionTransformer(config, layer), projector, image_token_id_of(hf, 10)
    )


def _qwen3_5(hf: dict[str, Any]) -> ImageEncoder:
    tower = QwenVisionTransformer(QwenVisionConfig.from_hf(hf.get("vision_config") or {}))
    return QwenImageEncoder(tower, nn.Identity(), image_token_id_of(hf, 248056))


def _qwen3_vl(hf: dict[str, Any]) -> ImageEncoder:
    config = QwenVisionConfig.from_hf(hf.get("vision_config") or {}, deepstack=True)
    return QwenImageEncoder(
        QwenVisionTransformer(config), nn.Identity(), image_token_id_of(hf, 151655)
    )


def _qwen2_5_vl(hf: dict[str, Any]) -> ImageEncoder:
    tower = Qwen25VisionTransformer(Qwen25VisionConfig.from_hf(hf.get("vision_config") or {}))
    return QwenImageEncoder(tower, nn.Identity(), image_token_id_of(hf, 151655))


def _qwen2_vl(hf: dict[str, Any]) -> ImageEncoder:
    tower = Qwen2VisionTransformer(Qwen2VisionConfig.from_hf(hf.get("vision_config") or {}))
    return QwenImageEncoder(tower, nn.Identity(), image_token_id_of(hf, 151655))


def _qwen2_audio(hf: dict[str, Any]) -> ImageEncoder:
    # NOTE: imported here: workers/audio builds on this module's ImageEncoder.
    from workers.audio.qwen2_audio import build_qwen2_audio

    return build_qwen2_audio(hf)


_BUILDERS = {
    "LlavaForConditionalGeneration": _llava,
    "Gemma3ForConditionalGeneration": _gemma3,
    "Idefics3ForConditionalGeneration": _idefics3,
    "LlavaOnevisionForConditionalGeneration": _llava_onevision,
    "Mistral3ForConditionalGeneration": _mistral3,
    "Qwen3_5ForConditionalGeneration": _qwen3_5,
    "Qwen3_5MoeForConditionalGeneration": _qwen3_5,  # the same tower as Qwen3.5's
    "Qwen2VLForConditionalGeneration": _qwen2_vl,
    "Qwen2_5_VLForConditionalGeneration": _qwen2_5_vl,
    "Qwen3VLForConditionalGeneration": _qwen3_vl,
    "Qwen3VLMoeForConditionalGeneration": _qwen3_vl,  # the same tower as Qwen3-VL's
    # An audio-language model: its audio tower fills placeholders as an image tower does.
    "Qwen2AudioForConditionalGeneration": _qwen2_audio,
}


def deepstack_layers(hf_config: dict[str, Any]) -> int:
    """How many of the language model's first layers add deepstack rows at the image's
    placeholders (Qwen3-VL, Qwen3-VL-MoE; 0 for every other model): the encoder's rows are that
    many hidden sizes wider than the main row."""
    archs = hf_config.get("architectures") or [""]
    if archs[0] not in ("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration"):
        return 0
    vision = hf_config.get("vision_config") or {}
    return len(vision.get("deepstack_visual_indexes", (8, 16, 24)))


def build_image_encoder(hf_config: dict[str, Any]) -> ImageEncoder | None:
    """The image encoder of config.json's first architecture; None when tern reads no images for
    it. Its parameters are not loaded: load them with `load_weights` / `local_weight_name`."""
    archs = hf_config.get("architectures") or []
    builder = _BUILDERS.get(archs[0]) if archs else None
    return builder(hf_config) if builder is not None else None

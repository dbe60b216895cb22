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
- Qwen3.5: `pixel_values` (t h w, C T P P) patches and `image_grid_thw` (1, 3) -> one row per
  spatial_merge_size^2 block of patches (t h w / m^2).

Weights: the encoder takes the same stream of checkpoint tensors as the language model;
`local_weight_name` says which are its own (transformers-5 `model.vision_tower.*` /
`model.multi_modal_projector.*`, or the older names without `model.`, with or without the tower's
`vision_model.` level; Qwen3.5's `model.visual.*`, tower and merger in one) and what its parameter
is called; None for every other tensor.

Tensor parallelism: the encoder is replicated whole on every rank (no sharding): it is small next
to the language model, runs once per image, and each rank then holds the rows it scatters.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from workers.vision.clip import CLIPVisionTransformer, clip_vision_config
from workers.vision.projectors import Gemma3MultiModalProjector, LlavaMultiModalProjector
from workers.vision.qwen_vit import QwenVisionConfig, QwenVisionTransformer
from workers.vision.siglip import SiglipVisionTransformer, siglip_vision_config

_TOWER_PREFIXES = ("model.vision_tower.", "vision_tower.")
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")
# Checkpoint prefixes -> the module that holds those tensors.
_LLAVA_STYLE_PREFIXES = ((_TOWER_PREFIXES, "vision_tower."),
                         (_PROJECTOR_PREFIXES, "multi_modal_projector."))  # fmt: skip
# Vision-tower tensors a checkpoint may carry that no encoder runs: the position ids older
# checkpoints saved as a buffer, SigLIP's attention-pooling head (Gemma 3 takes the patches).
_UNUSED_TOWER_TENSORS = ("embeddings.position_ids", "head.")


class ImageEncoder(nn.Module):
    weight_prefixes = _LLAVA_STYLE_PREFIXES

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
        for prefixes, local in self.weight_prefixes:
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


class QwenImageEncoder(ImageEncoder):
    """Qwen3.5: the vision transformer ends in its own merger (no separate projector), and each
    image brings its patch grid (`image_grid_thw`)."""

    weight_prefixes = ((("model.visual.", "visual."), "vision_tower."),)

    def encode(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        grid = tensors["image_grid_thw"].reshape(-1, 3)
        if grid.shape[0] != 1:
            raise ValueError(f"one image's tensors, not {grid.shape[0]} images'")
        weight = next(self.parameters())
        patches = tensors["pixel_values"].to(weight.device, weight.dtype)
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


def _qwen3_5(hf: dict[str, Any]) -> ImageEncoder:
    tower = QwenVisionTransformer(QwenVisionConfig.from_hf(hf.get("vision_config") or {}))
    return QwenImageEncoder(tower, nn.Identity(), image_token_id_of(hf, 248056))


_BUILDERS = {
    "LlavaForConditionalGeneration": _llava,
    "Gemma3ForConditionalGeneration": _gemma3,
    "Qwen3_5ForConditionalGeneration": _qwen3_5,
}


def build_image_encoder(hf_config: dict[str, Any]) -> ImageEncoder | None:
    """The image encoder of config.json's first architecture; None when tern reads no images for
    it. Its parameters are not loaded: load them with `load_weights` / `local_weight_name`."""
    archs = hf_config.get("architectures") or []
    builder = _BUILDERS.get(archs[0]) if archs else None
    return builder(hf_config) if builder is not None else None

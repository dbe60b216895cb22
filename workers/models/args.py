"""The arguments of a model: the part of a Hugging Face config.json the model code needs, read
without importing transformers, with the task the model is served for (enginecore/model_task.py:
the architectures, their decoder families and heads). Unsupported architectures, features or tasks
raise a ValueError naming what is missing. Every model module imports this one; it imports none of
them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from enginecore.model_task import (
    architecture_of,
    is_encoder_decoder,
    is_multimodal,
    model_task,
    num_labels_of,
    text_config_of,
)
from workers.layers.rotary import RopeParams


@dataclass(frozen=True)
class ModelArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: RopeParams
    attention_bias: bool = False
    mlp_bias: bool = False
    checkpoint_dtype: str | None = None  # "dtype" / "torch_dtype" of config.json
    num_labels: int = 0  # outputs of the score head of classifiers and reward models
    # Not from config.json: the serving options --quantization (set by the model runner), --task
    # (resolved: generate, embed, classify or reward) and --enable-expert-parallel.
    quantization: str | None = None
    task: str = "generate"
    expert_parallel: bool = False  # --enable-expert-parallel (set by the model runner)
    # Released with a vision tower (*ForConditionalGeneration): the language model's weights are
    # under its prefix; the vision tower's are skipped unless tern serves its images (takes_images:
    # the first pipeline stage then builds the image encoder from image_config, the outer config.json).
    multimodal: bool = False
    takes_images: bool = False
    takes_audio: bool = False  # an audio-language model whose audio tern serves (Qwen2-Audio)
    image_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # A speech-to-text encoder-decoder (Whisper): the decoder's sizes above, the encoder's in
    # hf_config under the checkpoint's own names.
    is_encoder_decoder: bool = False
    # The whole config.json (its text part), for what only one family reads: its DecoderSpec.
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_hf_config(
        cls, hf: dict[str, Any], task: str = "auto", language_model_only: bool = False
    ) -> ModelArgs:
        multimodal, outer = is_multimodal(hf), hf
        served = model_task(hf, task, language_model_only)  # which media its towers take
        task, images, audio = served.task, served.takes_images, served.takes_audio
        hf = text_config_of(hf)
        architecture = architecture_of(hf)
        heads = hf["num_attention_heads"]
        return cls(
            architecture=architecture,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf.get("intermediate_size", 0),  # 0: every MLP is experts
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=hf["max_position_embeddings"],
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope=RopeParams.from_hf_config(hf, "full_attention"),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            checkpoint_dtype=hf.get("dtype") or hf.get("torch_dtype"),
            num_labels=num_labels_of(hf),
            task=task,
            hf_config=hf,
            multimodal=multimodal,
            takes_images=images,
            takes_audio=audio,
            image_config=outer if images or audio else {},
            is_encoder_decoder=is_encoder_decoder(outer),
        )


def load_model_args(
    model_dir: str | Path, task: str = "auto", language_model_only: bool = False
) -> ModelArgs:
    """config.json's arguments, for the model served as --task `task` (its language model alone:
    `language_model_only`)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"no config.json in {model_dir}")
    return ModelArgs.from_hf_config(json.loads(path.read_text()), task, language_model_only)

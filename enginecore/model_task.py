"""What a served model does, from config.json's `architectures` and --task: generate text, or pool
each prompt's final hidden states into one vector (embed), the score head's logits (classify) or
a reward (reward).

Torch-free, so that the engine core (which validates requests by the task and announces it in
EngineReady) and the workers (which build the model's head by it) read the one table below.

Each architecture is a decoder family (its module under workers/models) and a head on the final
hidden states:
- "lm_head": *ForCausalLM. Tasks: generate (auto), embed (the LM head is then not built).
- "none": the bare decoder (LlamaModel, ...). Tasks: embed (auto).
- "score": *ForSequenceClassification, `score` = Linear(hidden, num_labels, bias=False).
  Tasks: classify (auto), reward (with num_labels 1), embed.
- "score_mlp": Qwen2ForRewardModel (Qwen2.5-Math-RM), `score` = Linear(hidden, hidden) -> ReLU ->
  Linear(hidden, 1), with biases. Tasks: reward (auto), embed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Architecture name -> (decoder family, head).
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "lm_head"),
    "LlamaModel": ("llama", "none"),
    "LlamaForSequenceClassification": ("llama", "score"),
    "Qwen2ForCausalLM": ("qwen2", "lm_head"),
    "Qwen2Model": ("qwen2", "none"),
    "Qwen2ForSequenceClassification": ("qwen2", "score"),
    "Qwen2ForRewardModel": ("qwen2", "score_mlp"),
    "Qwen3ForCausalLM": ("qwen3", "lm_head"),
    "Qwen3Model": ("qwen3", "none"),
    "Qwen3ForSequenceClassification": ("qwen3", "score"),
    "MistralForCausalLM": ("llama", "lm_head"),
    "MistralModel": ("llama", "none"),
    "MistralForSequenceClassification": ("llama", "score"),
    "MinistralForCausalLM": ("llama", "lm_head"),
    "MinistralModel": ("llama", "none"),
    "MinistralForSequenceClassification": ("llama", "score"),
    "Gemma2ForCausalLM": ("gemma2", "lm_head"),
    "Gemma2Model": ("gemma2", "none"),
    "Gemma2ForSequenceClassification": ("gemma2", "score"),
    "Gemma3ForCausalLM": ("gemma3", "lm_head"),
    "Gemma3TextModel": ("gemma3", "none"),
    "Gemma3TextForSequenceClassification": ("gemma3", "score"),
    "Phi3ForCausalLM": ("phi3", "lm_head"),
    "Phi3Model": ("phi3", "none"),
    "Phi3ForSequenceClassification": ("phi3", "score"),
    "SmolLM3ForCausalLM": ("smollm3", "lm_head"),
    "SmolLM3Model": ("smollm3", "none"),
    "SmolLM3ForSequenceClassification": ("smollm3", "score"),
    "Olmo2ForCausalLM": ("olmo2", "lm_head"),
    "Olmo2Model": ("olmo2", "none"),
    "Olmo2ForSequenceClassification": ("olmo2", "score"),
    "GraniteForCausalLM": ("granite", "lm_head"),
    "GraniteModel": ("granite", "none"),
    "Glm4ForCausalLM": ("glm4", "lm_head"),
    "Glm4Model": ("glm4", "none"),
    "Glm4ForSequenceClassification": ("glm4", "score"),
    "Qwen3_5ForCausalLM": ("qwen3_5", "lm_head"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "lm_head"),
    "Qwen3MoeModel": ("qwen3_moe", "none"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "lm_head"),
    "Qwen2MoeModel": ("qwen2_moe", "none"),
    "OlmoeForCausalLM": ("olmoe", "lm_head"),
    "OlmoeModel": ("olmoe", "none"),
    "MixtralForCausalLM": ("mixtral", "lm_head"),
    "MixtralModel": ("mixtral", "none"),
    "Qwen3_5MoeForCausalLM": ("qwen3_5_moe", "lm_head"),
    "GptOssForCausalLM": ("gpt_oss", "lm_head"),
    "GptOssModel": ("gpt_oss", "none"),
    "Qwen3_5MoeTextModel": ("qwen3_5_moe", "none"),
    "Qwen3_5TextModel": ("qwen3_5", "none"),
    # Released with a vision tower: tern serves their language model (text_config).
    "Gemma3ForConditionalGeneration": ("gemma3", "lm_head"),
    "Qwen3_5ForConditionalGeneration": ("qwen3_5", "lm_head"),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_5_moe", "lm_head"),
    "LlavaForConditionalGeneration": ("llama", "lm_head"),
    "Mistral3ForConditionalGeneration": ("llama", "lm_head"),  # a Mistral text model
    "Idefics3ForConditionalGeneration": ("llama", "lm_head"),  # SmolVLM: a Llama text model
    "LlavaOnevisionForConditionalGeneration": ("qwen2", "lm_head"),
    "Qwen2AudioForConditionalGeneration": ("qwen2", "lm_head"),  # a Qwen2 text model
    "Qwen2_5_VLForConditionalGeneration": ("qwen2", "lm_head"),  # Qwen2 with M-RoPE
    "Qwen3VLForConditionalGeneration": ("qwen3", "lm_head"),  # Qwen3 with M-RoPE, deepstack
    "Qwen3VLMoeForConditionalGeneration": ("qwen3_moe", "lm_head"),  # and Qwen3-MoE's
    "Qwen2VLForConditionalGeneration": ("qwen2", "lm_head"),  # Qwen2 with M-RoPE
    # Encoder-decoder: an audio encoder whose output the text decoder cross-attends to.
    "WhisperForConditionalGeneration": ("whisper", "lm_head"),
}
# Families with linear-attention layers.
HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe")
# Checkpoints whose config.json nests the language model's config in `text_config`.
MULTIMODAL_ARCHITECTURES = (
    "Gemma3ForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
    "LlavaForConditionalGeneration",
    "Idefics3ForConditionalGeneration",
    "LlavaOnevisionForConditionalGeneration",
    "Mistral3ForConditionalGeneration",
    "Qwen2AudioForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
    "Qwen2VLForConditionalGeneration",
)
# Of those, the ones whose images tern serves too (an encoder in workers/vision/); the others serve
# their language model only.
# The Qwen VL families (M-RoPE, Qwen's vision transformer, videos too).
QWEN_VL_ARCHITECTURES = (
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
    "Qwen2VLForConditionalGeneration",
)
IMAGE_INPUT_ARCHITECTURES = (
    "LlavaForConditionalGeneration",
    "Gemma3ForConditionalGeneration",
    "Idefics3ForConditionalGeneration",
    "LlavaOnevisionForConditionalGeneration",
    "Mistral3ForConditionalGeneration",
    *QWEN_VL_ARCHITECTURES,
)
# Of the multimodal ones, those whose audio tern serves (an audio tower whose rows fill the
# prompt's audio placeholders, as an image encoder's do: workers/audio/).
AUDIO_INPUT_ARCHITECTURES = ("Qwen2AudioForConditionalGeneration",)
# Of the image ones, those whose language model attends in both directions inside each image's
# placeholders (Hugging Face's Gemma 3): an image's run of placeholders is never split across prefill
# chunks nor cut by a prefix-cache hit.
WHOLE_IMAGE_SPAN_ARCHITECTURES = ("Gemma3ForConditionalGeneration",)
# Of those, the ones whose language model places every token after an image by that image's
# layout (M-RoPE: the Qwen VL models rotate by (t, h, w) positions), and the tensors of an image
# that say it: the workers get them for every image of a prompt, also those a prefix-cache hit
# skips.
_QWEN_VL_LAYOUT = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
IMAGE_LAYOUT_TENSORS = dict.fromkeys(QWEN_VL_ARCHITECTURES, _QWEN_VL_LAYOUT)

# Speech-to-text models: an audio encoder, and a text decoder that cross-attends to its output
# (workers/models/whisper.py). Each request carries one audio item with no placeholders in the
# decoder's prompt: it conditions every position.
AUDIO_ENCODER_DECODER_ARCHITECTURES = ("WhisperForConditionalGeneration",)

# Head -> the tasks it serves, the one `--task auto` picks first.
_TASKS_OF_HEAD = {
    "lm_head": ("generate", "embed"),
    "none": ("embed",),
    "score": ("classify", "reward", "embed"),
    "score_mlp": ("reward", "embed"),
}
POOLING_TASKS = ("embed", "classify", "reward")


@dataclass(frozen=True)
class ModelTask:
    architecture: str
    head: str  # see the module docstring
    task: str  # generate | embed | classify | reward
    hidden_size: int
    num_labels: int  # outputs of the score head (0 without one)
    id2label: dict[int, str] = field(default_factory=dict)  # for classify
    # Linear-attention layers (Qwen3.5): each sequence also carries a recurrent state, which a
    # prefix-cache hit could not restore (see EngineCore).
    has_linear_attention: bool = False
    # Its image inputs are served (IMAGE_INPUT_ARCHITECTURES); and each image's placeholders must be
    # computed in one step (WHOLE_IMAGE_SPAN_ARCHITECTURES).
    takes_images: bool = False
    whole_image_spans: bool = False
    image_layout_tensors: tuple[str, ...] = ()  # IMAGE_LAYOUT_TENSORS
    takes_audio: bool = False  # AUDIO_INPUT_ARCHITECTURES: audio placeholders in its prompts
    # A speech-to-text encoder-decoder (AUDIO_ENCODER_DECODER_ARCHITECTURES): every request
    # carries its audio's features, which its decoder's every position attends to.
    is_encoder_decoder: bool = False

    @property
    def is_pooling(self) -> bool:
        return self.task in POOLING_TASKS

    @property
    def pooled_size(self) -> int:
        """Length of a pooling request's output vector (0 for generate)."""
        if self.task == "embed":
            return self.hidden_size
        return self.num_labels if self.is_pooling else 0


def text_config_of(hf: dict[str, Any]) -> dict[str, Any]:
    """config.json of the language model: `hf` itself, or for a checkpoint released with a vision
    tower its `text_config` (with the checkpoint's architectures, and its tie_word_embeddings where
    the outer config sets it); for an encoder-decoder, its decoder's numbers under the names a
    decoder-only config gives them."""
    if is_encoder_decoder(hf):
        return decoder_config_of(hf)
    if not is_multimodal(hf) or "text_config" not in hf and "hidden_size" in hf:
        return hf  # not multimodal, or already the text part
    text = dict(hf.get("text_config") or {})
    if not text:
        raise ValueError(f"{hf['architectures'][0]}: config.json has no text_config")
    text["architectures"] = hf["architectures"]
    if "tie_word_embeddings" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text


def is_multimodal(hf: dict[str, Any]) -> bool:
    """Whether the checkpoint carries a vision tower tern does not serve (it serves the text)."""
    return bool(hf.get("architectures")) and hf["architectures"][0] in MULTIMODAL_ARCHITECTURES


def takes_audio(hf: dict[str, Any]) -> bool:
    """Whether tern serves the checkpoint's audio inputs (config.json, the outer one)."""
    return bool(hf.get("architectures")) and hf["architectures"][0] in AUDIO_INPUT_ARCHITECTURES


def is_encoder_decoder(hf: dict[str, Any]) -> bool:
    archs = hf.get("architectures") or []
    return bool(archs) and archs[0] in AUDIO_ENCODER_DECODER_ARCHITECTURES


def decoder_config_of(hf: dict[str, Any]) -> dict[str, Any]:
    """Whisper's config.json with its decoder's sizes as hidden_size, num_hidden_layers... (what
    the KV cache, the scheduler and the LM head are sized by; the encoder's sizes stay under
    Whisper's own names). Its LM head (proj_out) is always tied to the decoder's embedding."""
    heads = hf["decoder_attention_heads"]
    return {
        **hf,
        "hidden_size": hf["d_model"],
        "intermediate_size": hf["decoder_ffn_dim"],
        "num_hidden_layers": hf["decoder_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": hf["d_model"] // heads,
        "max_position_embeddings": hf["max_target_positions"],
        "rms_norm_eps": 1e-5,  # torch's LayerNorm default, which Whisper's layers keep
        "tie_word_embeddings": True,
    }


def takes_images(hf: dict[str, Any]) -> bool:
    """Whether tern serves the checkpoint's image inputs (config.json, the outer one)."""
    return bool(hf.get("architectures")) and hf["architectures"][0] in IMAGE_INPUT_ARCHITECTURES


def architecture_of(hf: dict[str, Any]) -> str:
    archs = hf.get("architectures") or []
    if not archs or archs[0] not in ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {archs[:1]} (supported: {sorted(ARCHITECTURES)})"
        )
    return archs[0]


def num_labels_of(hf: dict[str, Any]) -> int:
    """The score head's outputs (Hugging Face: len(id2label), else num_labels, default 2)."""
    head = ARCHITECTURES[architecture_of(hf)][1]
    if head == "score_mlp":
        return 1  # Qwen2ForRewardModel fixes it, whatever config.json says (it says nothing)
    if head != "score":
        return 0
    id2label = hf.get("id2label")
    return len(id2label) if id2label else int(hf.get("num_labels", 2))


def model_task(
    hf: dict[str, Any], requested: str = "auto", language_model_only: bool = False
) -> ModelTask:
    """The task `requested` (--task) resolves to for this config.json; ValueError if the model
    cannot serve it. `language_model_only`: its media towers are not served."""
    served_media = not language_model_only
    images, audio = takes_images(hf) and served_media, takes_audio(hf) and served_media
    hf = text_config_of(hf)
    arch = architecture_of(hf)
    head = ARCHITECTURES[arch][1]
    tasks = _TASKS_OF_HEAD[head]
    if arch in AUDIO_ENCODER_DECODER_ARCHITECTURES:
        tasks = ("generate",)  # its decoder's states are no text embedding
    num_labels = num_labels_of(hf)
    task = tasks[0] if requested == "auto" else requested
    if task not in tasks:
        raise ValueError(
            f"--task {requested}: {arch} serves {', '.join(tasks)}"
            + (" (generate needs a *ForCausalLM checkpoint)" if task == "generate" else "")
        )
    if task == "reward" and num_labels != 1:
        raise ValueError(
            f"--task reward needs a score head with one output; {arch} has {num_labels} "
            "(serve it with --task classify)"
        )
    id2label: dict[int, str] = {}
    if task == "classify":
        names = {int(k): str(v) for k, v in (hf.get("id2label") or {}).items()}
        id2label = {i: names.get(i, f"LABEL_{i}") for i in range(num_labels)}
    linear = ARCHITECTURES[arch][0] in HYBRID_FAMILIES
    return ModelTask(
        arch, head, task, int(hf["hidden_size"]), num_labels, id2label, linear,
        takes_images=images and task == "generate",
        whole_image_spans=images and arch in WHOLE_IMAGE_SPAN_ARCHITECTURES,
        image_layout_tensors=IMAGE_LAYOUT_TENSORS.get(arch, ()) if images else (),
        is_encoder_decoder=arch in AUDIO_ENCODER_DECODER_ARCHITECTURES,
        takes_audio=audio and task == "generate",
    )  # fmt: skip


def read_model_task(
    model_dir: str | Path, requested: str = "auto", language_model_only: bool = False
) -> ModelTask:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"no config.json in {model_dir}")
    return model_task(json.loads(path.read_text()), requested, language_model_only)

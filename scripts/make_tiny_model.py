"""Build a tiny random-weight Hugging Face checkpoint for tests: `make_tiny_model(arch, out_dir)`.

Three flavours, each exercising a different path of the worker's model code:
- "llama": tied embeddings, llama3 rope scaling, config.json in transformers-5 style
  (`rope_parameters`);
- "qwen2": untied embeddings, bias on q/k/v, linear rope scaling, config.json rewritten in
  transformers-4 style (`rope_theta` + `rope_scaling`);
- "qwen3": q/k RMSNorm, head_dim (32) != hidden_size / heads (16);
- the model zoo (ZOO_ARCHS: mistral, ministral, gemma2, gemma3, phi3, smollm3, olmo2, granite, glm4,
  qwen3_5): each with what its family changes on (sliding windows of 8 tokens, softcapping, NoPE
  layers, multipliers, yarn / longrope / dynamic rope, Gated DeltaNet layers; `_zoo_config_kwargs`);
- "gemma3_vl", "qwen3_5_vl": *ForConditionalGeneration, the tiny gemma3 / qwen3_5 beside a random
  one-layer vision tower; "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration, a tiny Qwen2 (M-RoPE in
  sections) beside a two-block windowed tower (one window block, one full-attention block);
  "qwen3_vl": Qwen3VLForConditionalGeneration, the tiny qwen3 (interleaved M-RoPE) beside a
  three-block tower whose first two blocks feed deepstack rows to its first two layers;
  "qwen3_vl_moe": Qwen3VLMoeForConditionalGeneration, the same with the tiny qwen3_moe's experts
  (48 features each) stacked and transposed as the released checkpoints store them;
  "qwen2_vl": Qwen2VLForConditionalGeneration, the tiny qwen2 (M-RoPE in sections) beside a
  two-block Qwen2-VL tower (LayerNorm, quick-GELU MLP, no windows); "llava": LlavaForConditionalGeneration, the tiny llama beside a random
  two-layer CLIP; "idefics3": Idefics3ForConditionalGeneration (SmolVLM's), the tiny llama
  (untied) beside a random two-layer SigLIP-style tower and pixel-shuffle connector;
  "llava_onevision": LlavaOnevisionForConditionalGeneration, the tiny qwen2 beside a random
  two-layer SigLIP (32 px views of 16 patches, anyres grids up to 2 x 2 views, at most 2 views'
  worth of grid features an image). llava and
  gemma3_vl take 32 px images (16 and 4 placeholder tokens), idefics3 32 px tiles (4 tokens each:
  an image is up to 2 x 2 tiles and the whole image) and, with a tokenizer, carry their processor
  (LlavaProcessor / Gemma3Processor / Idefics3Processor: the tokenizer with the image tokens
  added, a PIL image processor, a chat template rendering image parts), the text vocabulary
  padded to 49216 past the added tokens.
All have hidden size 64, 4 heads / 2 KV heads, and vocab 49152 with the tokenizer files of
`tokenizer_dir` copied in, else vocab 512 and no tokenizer.

`head` picks the model on the decoder: "lm_head" (*ForCausalLM, the default), "score"
(*ForSequenceClassification with `num_labels`), "none" (the bare *Model), or, for qwen2 only,
"score_mlp": a Qwen2ForRewardModel checkpoint as Qwen2.5-Math-RM's (transformers has no such
class: a Qwen2Model's weights under `model.`, plus `score.0` Linear(64, 64) and `score.2`
Linear(64, 1) with biases).

CLI: python scripts/make_tiny_model.py ARCH OUT_DIR [--tokenizer-dir DIR] [--seed N]
     [--head HEAD] [--num-labels N]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "added_tokens.json",
)
_FAMILIES = {
    "llama": "Llama",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "mistral": "Mistral",
    "ministral": "Ministral",
    "gemma2": "Gemma2",
    "gemma3": "Gemma3",  # Gemma3TextConfig, Gemma3ForCausalLM
    "phi3": "Phi3",
    "smollm3": "SmolLM3",
    "olmo2": "Olmo2",
    "granite": "Granite",
    "glm4": "Glm4",
    "qwen3_5": "Qwen3_5",  # Qwen3_5TextConfig, Qwen3_5ForCausalLM
    "qwen3_moe": "Qwen3Moe",
    "qwen2_moe": "Qwen2Moe",
    "olmoe": "Olmoe",
    "mixtral": "Mixtral",
    "qwen3_5_moe": "Qwen3_5Moe",  # Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM
    "gpt_oss": "GptOss",
}
# gemma3_vl / qwen3_5_vl / qwen3_5_moe_vl / qwen2_5_vl / qwen3_vl / qwen2_vl / llava / idefics3:
# *ForConditionalGeneration, the tiny gemma3 / qwen3_5 / qwen3_5_moe / qwen2 / qwen3 / qwen2 / llama /
# llama beside a random vision tower (`_make_with_vision_tower`).
_VISION_ARCHS = ("gemma3_vl", "qwen3_5_vl", "qwen3_5_moe_vl", "qwen2_5_vl", "qwen3_vl",
                 "qwen3_vl_moe", "qwen2_vl", "llava", "idefics3", "mistral3_vl",
                 "llava_onevision")  # fmt: skip
# Those whose processor is Qwen's (Qwen2VLImageProcessor, <|image_pad|> runs).
_QWEN_VL_ARCHS = ("qwen3_5_vl", "qwen3_5_moe_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe",
                  "qwen2_vl")  # fmt: skip
ARCHS = (*_FAMILIES, *_VISION_ARCHS)
# Mixture-of-experts families: 8 experts, top 2.
MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "qwen3_5_moe", "gpt_oss")
# The families added for the 2026 model zoo: each exercises what its DecoderSpec changes, with a
# sliding window (8) shorter than the test prompts where the family has one.
ZOO_ARCHS = tuple(a for a in tuple(_FAMILIES)[3:] if a not in MOE_ARCHS)
# Head -> the transformers class built (its family's name + this).
HEADS = {
    "lm_head": "ForCausalLM",
    "score": "ForSequenceClassification",
    "none": "Model",
    "score_mlp": "Model",
}
# Random weights of the usual scale (0.02) give near-uniform logits whose argmax ties break
# differently in any two implementations; larger weights give decisive, varied greedy outputs.
INIT_STD = 0.25


def _config_kwargs(arch: str, vocab_size: int) -> dict[str, Any]:
    common = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "initializer_range": INIT_STD,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if arch == "llama":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return {
            **common,
            "num_hidden_layers": 3,
            "tie_word_embeddings": True,
            "rope_parameters": rope,
        }
    if arch == "qwen2":
        return {
            **common,
            "num_hidden_layers": 2,
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0},
        }
    if arch == "qwen3":
        return {
            **common,
            "num_hidden_layers": 4,
            "head_dim": 32,
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        }
    zoo = _zoo_config_kwargs(arch)
    if zoo is not None:
        return {**common, **zoo}
    raise ValueError(f"unknown tiny architecture {arch!r} (one of {ARCHS})")


def _zoo_config_kwargs(arch: str) -> dict[str, Any] | None:
    s, f = "sliding_attention", "full_attention"
    if arch == "mistral":  # every layer slides
        return {"num_hidden_layers": 2, "sliding_window": 8, "tie_word_embeddings": False}
    if arch == "ministral":
        return {"num_hidden_layers": 4, "head_dim": 16, "sliding_window": 8,
                "layer_types": [s, f, s, f], "tie_word_embeddings": False}  # fmt: skip
    if arch == "gemma2":  # softcapping on the attention and the final logits
        return {"num_hidden_layers": 4, "head_dim": 16, "query_pre_attn_scalar": 24,
                "sliding_window": 8, "attn_logit_softcapping": 20.0,
                "final_logit_softcapping": 15.0, "tie_word_embeddings": True}  # fmt: skip
    if arch == "gemma3":  # two rope bases, the global one scaled
        rope = {f: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                s: {"rope_type": "default", "rope_theta": 10000.0}}  # fmt: skip
        return {"num_hidden_layers": 6, "head_dim": 16, "query_pre_attn_scalar": 16,
                "sliding_window": 8, "layer_types": [s, s, f, s, s, f],
                "rope_parameters": rope, "tie_word_embeddings": True}  # fmt: skip
    if arch == "phi3":  # Phi-4-mini's partial rotation and longrope
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "original_max_position_embeddings": 1024,
                "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                "long_factor": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]}  # fmt: skip
        return {"num_hidden_layers": 2, "rope_parameters": rope, "tie_word_embeddings": False,
                "pad_token_id": 0}  # fmt: skip
    if arch == "smollm3":  # NoPE every other layer
        return {"num_hidden_layers": 4, "no_rope_layers": [1, 0, 1, 0],
                "tie_word_embeddings": True, "pad_token_id": 0}  # fmt: skip
    if arch == "olmo2":
        rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                "rope_theta": 10000.0}  # fmt: skip
        return {"num_hidden_layers": 2, "rope_parameters": rope, "tie_word_embeddings": False}
    if arch == "granite":
        return {"num_hidden_layers": 2, "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
                "attention_multiplier": 0.1, "logits_scaling": 4.0, "tie_word_embeddings": True,
                "rope_parameters": {"rope_type": "dynamic", "factor": 2.0,
                                    "rope_theta": 10000.0}}  # fmt: skip
    if arch == "qwen3_5":  # Gated DeltaNet layers around gated full attention
        lin = "linear_attention"
        return {"num_hidden_layers": 6, "head_dim": 16, "linear_num_key_heads": 2,
                "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                "linear_value_head_dim": 16, "layer_types": [lin, lin, f, lin, lin, f],
                "tie_word_embeddings": False}  # fmt: skip
    if arch == "glm4":
        return {"num_hidden_layers": 2, "head_dim": 16, "attention_bias": True,
                "partial_rotary_factor": 0.5, "tie_word_embeddings": False,
                "pad_token_id": 0}  # fmt: skip
    return _moe_config_kwargs(arch)


def _moe_config_kwargs(arch: str) -> dict[str, Any] | None:
    experts = {"num_experts_per_tok": 2, "tie_word_embeddings": False, "pad_token_id": 0,
               "output_router_logits": False}  # fmt: skip
    if arch == "qwen3_moe":  # the middle layer keeps a dense MLP; top-2 renormalised
        return {**experts, "num_hidden_layers": 3, "head_dim": 32, "num_experts": 8,
                "moe_intermediate_size": 32, "mlp_only_layers": [1], "norm_topk_prob": True}  # fmt: skip
    if arch == "qwen2_moe":  # a shared expert beside the routed ones
        return {**experts, "num_hidden_layers": 2, "num_experts": 8, "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 48, "norm_topk_prob": False}  # fmt: skip
    if arch == "olmoe":
        return {**experts, "num_hidden_layers": 2, "num_experts": 8, "intermediate_size": 32,
                "norm_topk_prob": False}  # fmt: skip
    if arch == "mixtral":  # with Mistral's sliding window
        return {**experts, "num_hidden_layers": 2, "num_local_experts": 8,
                "intermediate_size": 32, "sliding_window": 8}  # fmt: skip
    if arch == "qwen3_5_moe":  # Qwen3.5's hybrid layers, experts and a shared expert
        lin = "linear_attention"
        return {**experts, "num_hidden_layers": 4, "head_dim": 16, "linear_num_key_heads": 2,
                "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                "linear_value_head_dim": 16, "layer_types": [lin, lin, lin, "full_attention"],
                "num_experts": 8, "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 48}  # fmt: skip
    if (
        arch == "gpt_oss"
    ):  # sinks, alternating window, router bias, clamped SwiGLU (limit 1.5 bites)
        return {**experts, "num_hidden_layers": 2, "head_dim": 16, "num_local_experts": 8,
                "intermediate_size": 32, "sliding_window": 8, "swiglu_limit": 1.5,
                "layer_types": ["sliding_attention", "full_attention"]}  # fmt: skip
    return None


# With a tokenizer, the multimodal checkpoints add their image tokens to it (ids 49152...) and pad
# the text vocabulary past them, as released ones do; without one, the last ids of 512 stand in.
_PADDED_VOCAB = 49152 + 64
# The processors' chat templates: each family's turn format, rendering {"type": "image"} parts
# as the placeholder its processor expands (LLaVA 1.5's "USER: <image>\n... ASSISTANT:", Gemma 3's
# turns with <start_of_image>), the system prompt in front of the first turn.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}{% else %}"
    "{% for part in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}"
    "{% for part in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ part['text'] + ' ' }}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else 'user' %}"
    "{% if not (loop.index0 == 1 and messages[0]['role'] == 'system') %}"
    "<start_of_turn>{{ role }}\n{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "{% if message['role'] == 'system' %}{{ '\\n\\n' }}{% else %}<end_of_turn>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# SmolVLM's: "<|im_start|>User:<image>What is this?<end_of_utterance>\nAssistant:".
IDEFICS3_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}{% else %}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
QWEN_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# LLaVA-OneVision's (llava-hf's Qwen2 checkpoints): a turn's images side by side, its videos,
# then its text.
LLAVA_ONEVISION_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + ' ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>' }}{% endfor %}"
    "{% for part in message['content'] | selectattr('type', 'equalto', 'video') %}"
    "{{ '<video>' }}{% endfor %}"
    "{% for part in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ '\n' + part['text'] }}{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Mistral 3's layout: [INST] text and [IMG] markers [/INST].
MISTRAL3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}[INST]"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}[IMG]"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "[/INST]{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
# The tokens each processor expands images into, added to the tokenizer as special tokens.
_IMAGE_TOKENS = {
    "llava": {"image_token": "<image>"},
    "gemma3_vl": {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>",
                  "eoi_token": "<end_of_image>"},
    "idefics3": {"image_token": "<image>", "fake_image_token": "<fake_token_around_image>",
                 "global_image_token": "<global-img>",
                 "end_of_utterance_token": "<end_of_utterance>"},
    "mistral3_vl": {"image_token": "[IMG]", "image_break_token": "[IMG_BREAK]",
                    "image_end_token": "[IMG_END]"},
    "llava_onevision": {"image_token": "<image>", "video_token": "<video>"},
    "qwen3_5_vl": {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                   "vision_start_token": "<|vision_start|>",
                   "vision_end_token": "<|vision_end|>"},
}  # fmt: skip
for _arch in _QWEN_VL_ARCHS:
    _IMAGE_TOKENS[_arch] = _IMAGE_TOKENS["qwen3_5_vl"]
# Idefics3's tile tags (Idefics3Processor writes <row_r_col_c> before tile (r, c)'s run).
_IDEFICS3_TILE_TOKENS = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]


def _image_tokenizer(arch: str, tokenizer_dir: Path | None) -> Any:
    """The default model's tokenizer with `arch`'s image tokens added (None without one)."""
    import transformers

    if tokenizer_dir is None:
        return None
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        tokenizer_dir, extra_special_tokens=_IMAGE_TOKENS[arch]
    )
    if arch == "idefics3":
        tokenizer.add_tokens(_IDEFICS3_TILE_TOKENS, special_tokens=True)
    return tokenizer


def _image_token_ids(arch: str, tokenizer: Any) -> dict[str, int]:
    """Config field -> id of each image token: the tokenizer's, else the last ids of 512."""
    fields = {"image_token": "image_token_index", "boi_token": "boi_token_index",
              "eoi_token": "eoi_token_index"}  # fmt: skip
    if arch == "idefics3":  # Idefics3Config's one image token field (the others: processor only)
        fields = {"image_token": "image_token_id"}
    if arch == "llava_onevision":
        fields = {"image_token": "image_token_index", "video_token": "video_token_index"}
    if arch in _QWEN_VL_ARCHS:  # Qwen3_5Config / Qwen2_5_VLConfig name them *_token_id
        fields = {name: name + "_id" for name in _IMAGE_TOKENS[arch]}
    names = [n for n in _IMAGE_TOKENS[arch] if n in fields]
    if tokenizer is None:
        return {fields[n]: 511 - i for i, n in enumerate(names)}
    return {fields[n]: tokenizer.convert_tokens_to_ids(_IMAGE_TOKENS[arch][n]) for n in names}


def _multimodal_config(arch: str, vocab_size: int, token_ids: dict[str, int]) -> Any:
    """LLaVA: the tiny llama beside a 2-layer CLIP (32 px, patch 8: 16 image tokens, the class
    token dropped, features of the last layer but one). Gemma 3: the tiny gemma3 beside a 1-layer
    SigLIP (32 px, patch 8: a 4x4 grid pooled to 2x2 = 4 image tokens). Idefics3: the tiny llama
    (untied) beside a 2-layer SigLIP-style tower (32 px tiles, patch 8, pixel shuffle by 2: 4 image
    tokens a tile). Qwen3.5: 1-layer tower."""
    import transformers

    if arch == "idefics3":
        text = transformers.LlamaConfig(
            **{**_config_kwargs("llama", vocab_size), "tie_word_embeddings": False}
        )
        vision = transformers.Idefics3VisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            image_size=32, patch_size=8, initializer_range=INIT_STD,
        )  # fmt: skip
        return transformers.Idefics3Config(
            text_config=text.to_dict(), vision_config=vision.to_dict(), scale_factor=2,
            tie_word_embeddings=False, **token_ids,
        )  # fmt: skip

    if arch == "llava":
        text = transformers.LlamaConfig(**_config_kwargs("llama", vocab_size))
        vision = transformers.CLIPVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            image_size=32, patch_size=8, projection_dim=32,
        )  # fmt: skip
        return transformers.LlavaConfig(
            text_config=text.to_dict(), vision_config=vision.to_dict(), vision_feature_layer=-2,
            vision_feature_select_strategy="default", projector_hidden_act="gelu",
            multimodal_projector_bias=True, tie_word_embeddings=True, image_seq_length=16,
            **token_ids,
        )  # fmt: skip
    if arch == "gemma3_vl":
        text = transformers.Gemma3TextConfig(**_config_kwargs("gemma3", vocab_size))
        vision = transformers.SiglipVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            image_size=32, patch_size=8, vision_use_head=False,
        )  # fmt: skip
        return transformers.Gemma3Config(
            text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
            **token_ids,
        )  # fmt: skip
    if arch == "mistral3_vl":
        return _mistral3_config(vocab_size, token_ids)
    if arch == "llava_onevision":
        return _llava_onevision_config(vocab_size, token_ids)
    if arch == "qwen2_5_vl":
        return _qwen2_5_vl_config(vocab_size, token_ids)
    if arch in ("qwen3_vl", "qwen3_vl_moe"):
        return _qwen3_vl_config(vocab_size, token_ids, moe=arch == "qwen3_vl_moe")
    if arch == "qwen2_vl":
        return _qwen2_vl_config(vocab_size, token_ids)
    # M-RoPE over 12 of each head's 16 dims: 6 frequencies, 2 each for t, h and w, interleaved.
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "mrope_section": [2, 2, 2], "mrope_interleaved": True}  # fmt: skip
    moe = arch == "qwen3_5_moe_vl"
    text_config = transformers.Qwen3_5MoeTextConfig if moe else transformers.Qwen3_5TextConfig
    text = text_config(
        **{**_config_kwargs("qwen3_5_moe" if moe else "qwen3_5", vocab_size),
           "rope_parameters": rope}
    )  # fmt: skip
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
              "out_hidden_size": 64, "patch_size": 4, "spatial_merge_size": 2,
              "temporal_patch_size": 2, "num_position_embeddings": 16,
              "initializer_range": INIT_STD}  # fmt: skip
    config_class = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
    return config_class(
        text_config=text.to_dict(), vision_config=vision,
        **{"image_token_id": vocab_size - 1, "video_token_id": vocab_size - 2,
           "vision_start_token_id": vocab_size - 3, "vision_end_token_id": vocab_size - 4,
           **token_ids},
    )  # fmt: skip


def _mistral3_config(vocab_size: int, token_ids: dict[str, int]) -> Any:
    """The tiny mistral (no sliding window) beside a 2-layer Pixtral tower (8 px patches, 2D
    rotary at the image's own aspect ratio) and the 2x2 patch merger: 16 px a merged token."""
    import transformers

    text = transformers.MistralConfig(
        **{**_config_kwargs("llama", vocab_size), "num_hidden_layers": 2, "head_dim": 16,
           "sliding_window": None, "tie_word_embeddings": False, "rope_parameters": None}
    )  # fmt: skip
    vision = transformers.PixtralVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        image_size=64, patch_size=8, hidden_act="silu", initializer_range=INIT_STD,
    )  # fmt: skip
    return transformers.Mistral3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), spatial_merge_size=2,
        vision_feature_layer=-1, **token_ids,
    )  # fmt: skip


# LLaVA-OneVision's anyres grids (in px) for the tiny tower's 32 px views.
LLAVA_ONEVISION_GRIDS = [[32, 32], [32, 64], [64, 32], [64, 64]]


def _llava_onevision_config(vocab_size: int, token_ids: dict[str, int]) -> Any:
    """The tiny qwen2 beside a 2-layer SigLIP (32 px views, patch 8: 16 features a view, all
    patches kept), grids of up to 2 x 2 views, the grid's features shrunk to 2 views' worth."""
    import transformers

    text = transformers.Qwen2Config(**_config_kwargs("qwen2", vocab_size))
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        image_size=32, patch_size=8, vision_use_head=False,
    )  # fmt: skip
    return transformers.LlavaOnevisionConfig(
        text_config=text.to_dict(), vision_config=vision.to_dict(), vision_feature_layer=-1,
        vision_feature_select_strategy="full", image_grid_pinpoints=LLAVA_ONEVISION_GRIDS,
        vision_aspect_ratio="anyres_max_2", tie_word_embeddings=False,
        **token_ids,
    )  # fmt: skip


def _qwen2_5_vl_config(vocab_size: int, token_ids: dict[str, int]) -> Any:
    """The tiny qwen2 with M-RoPE in sections (of each head's 8 frequencies the first 2 turn by
    time, the next 3 by height, the last 3 by width) beside a two-block tower: 4 px patches, 2x2
    merged, windows of 2x2 merged tokens (16 px); the first block attends within its window, the
    second over the whole image."""
    import transformers

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    text = transformers.Qwen2_5_VLTextConfig(
        **{**_config_kwargs("qwen2", vocab_size), "rope_parameters": rope}
    )
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
              "out_hidden_size": 64, "patch_size": 4, "spatial_merge_size": 2,
              "temporal_patch_size": 2, "window_size": 16, "fullatt_block_indexes": [1],
              "initializer_range": INIT_STD}  # fmt: skip
    return transformers.Qwen2_5_VLConfig(
        text_config=text.to_dict(), vision_config=vision,
        **{"image_token_id": vocab_size - 1, "video_token_id": vocab_size - 2,
           "vision_start_token_id": vocab_size - 3, "vision_end_token_id": vocab_size - 4,
           **token_ids},
    )  # fmt: skip


def _qwen3_vl_config(vocab_size: int, token_ids: dict[str, int], moe: bool = False) -> Any:
    """The tiny qwen3 (4 layers, head_dim 32: 16 frequencies, interleaved M-RoPE over 6 + 5 + 5),
    or with `moe` the tiny qwen3_moe, beside a three-block tower like Qwen3.5's whose first two
    blocks' outputs, each through its own merger, are added to the hidden states after the
    language model's first two layers."""
    import transformers

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 5, 5],
            "mrope_interleaved": True}  # fmt: skip
    text_config = transformers.Qwen3VLMoeTextConfig if moe else transformers.Qwen3VLTextConfig
    kwargs = {
        **_config_kwargs("qwen3_moe" if moe else "qwen3", vocab_size),
        "rope_parameters": rope,
    }
    if moe:  # 2 x 48 gate and up features: no square matrix, whose orientation a file cannot tell
        # Its router renormalises whatever norm_topk_prob says (Hugging Face's reads no such field).
        kwargs.update(moe_intermediate_size=48, norm_topk_prob=False)
    text = text_config(**kwargs)
    vision = {"depth": 3, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
              "out_hidden_size": 64, "patch_size": 4, "spatial_merge_size": 2,
              "temporal_patch_size": 2, "num_position_embeddings": 16,
              "deepstack_visual_indexes": [0, 1], "initializer_range": INIT_STD}  # fmt: skip
    config_class = transformers.Qwen3VLMoeConfig if moe else transformers.Qwen3VLConfig
    return config_class(
        text_config=text.to_dict(), vision_config=vision,
        **{"image_token_id": vocab_size - 1, "video_token_id": vocab_size - 2,
           "vision_start_token_id": vocab_size - 3, "vision_end_token_id": vocab_size - 4,
           **token_ids},
    )  # fmt: skip


def _qwen2_vl_config(vocab_size: int, token_ids: dict[str, int]) -> Any:
    """The tiny qwen2 with M-RoPE in sections [2, 3, 3] beside a two-block Qwen2-VL tower (4 px
    patches, 2x2 merged, each frame attended whole)."""
    import transformers

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    text = transformers.Qwen2VLTextConfig(
        **{**_config_kwargs("qwen2", vocab_size), "rope_parameters": rope}
    )
    vision = {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2,
              "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2,
              "initializer_range": INIT_STD}  # fmt: skip
    return transformers.Qwen2VLConfig(
        text_config=text.to_dict(), vision_config=vision,
        **{"image_token_id": vocab_size - 1, "video_token_id": vocab_size - 2,
           "vision_start_token_id": vocab_size - 3, "vision_end_token_id": vocab_size - 4,
           **token_ids},
    )  # fmt: skip


def _processor(arch: str, tokenizer: Any, config: Any) -> Any:
    """The checkpoint's processor: its image processor (PIL backend) sized to the tiny tower."""
    import transformers

    side = config.vision_config.image_size
    if arch == "idefics3":  # images up to 2 x 2 tiles of 32 px, then the whole image as one tile
        image_processor = transformers.Idefics3ImageProcessorPil(
            size={"longest_edge": 2 * side}, max_image_size={"longest_edge": side}
        )
        per_tile = (side // config.vision_config.patch_size // config.scale_factor) ** 2
        return transformers.Idefics3Processor(
            image_processor=image_processor, tokenizer=tokenizer, image_seq_len=per_tile,
            chat_template=IDEFICS3_CHAT_TEMPLATE,
        )  # fmt: skip
    if arch == "llava":
        image_processor = transformers.CLIPImageProcessorPil(
            size={"shortest_edge": side}, crop_size={"height": side, "width": side}
        )
        return transformers.LlavaProcessor(
            image_processor=image_processor, tokenizer=tokenizer,
            patch_size=config.vision_config.patch_size, num_additional_image_tokens=1,
            vision_feature_select_strategy=config.vision_feature_select_strategy,
            chat_template=LLAVA_CHAT_TEMPLATE,
        )  # fmt: skip
    image_processor = transformers.Gemma3ImageProcessorPil(size={"height": side, "width": side})
    return transformers.Gemma3Processor(
        image_processor=image_processor, tokenizer=tokenizer,
        image_seq_length=config.mm_tokens_per_image, chat_template=GEMMA3_CHAT_TEMPLATE,
    )  # fmt: skip


def _save_qwen_processor_parts(tokenizer: Any, config: Any, out_dir: Path) -> None:
    """Qwen3VLProcessor's parts (it cannot be built without torchvision, which its video processor
    needs): the image processor (8 px a merged token, images resized to at most 32x32 px: up to 16
    tokens an image), the tokenizer with the vision tokens, the chat template. Qwen3-VL's and
    Qwen3.5's video processor settings are their own file (at most 8 frames of 32x32 px a
    video); Qwen2-VL's and Qwen2.5-VL's are the image processor's, as their releases have it."""
    import transformers

    vision = config.vision_config
    factor = vision.patch_size * vision.spatial_merge_size
    transformers.Qwen2VLImageProcessorPil(
        patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
        merge_size=vision.spatial_merge_size,
        size={"shortest_edge": 2 * factor * factor, "longest_edge": 16 * factor * factor},
    ).save_pretrained(out_dir)  # fmt: skip
    if config.architectures[0].startswith(("Qwen3VL", "Qwen3_5")):
        video = {"video_processor_type": "Qwen3VLVideoProcessor", "do_sample_frames": True,
                 "size": {"shortest_edge": 2 * factor * factor,
                          "longest_edge": 8 * 16 * factor * factor},
                 "patch_size": vision.patch_size, "merge_size": vision.spatial_merge_size,
                 "temporal_patch_size": vision.temporal_patch_size, "fps": 2, "min_frames": 4,
                 "max_frames": 768, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
                 "rescale_factor": 1 / 255}  # fmt: skip
        (out_dir / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    tokenizer.chat_template = QWEN_VL_CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    (out_dir / "chat_template.jinja").write_text(QWEN_VL_CHAT_TEMPLATE)


def _save_pixtral_processor_parts(tokenizer: Any, config: Any, out_dir: Path) -> None:
    """PixtralProcessor's parts (it requires torchvision): the image processor (images at their
    own aspect ratio, at most 64 px a side: up to 4x4 merged tokens), processor_config.json with
    the patch and merge sizes, the tokenizer with [IMG], [IMG_BREAK], [IMG_END], the template."""
    import transformers

    patch, merge = config.vision_config.patch_size, config.spatial_merge_size
    transformers.PixtralImageProcessorPil(
        size={"longest_edge": config.vision_config.image_size}, patch_size=patch * merge
    ).save_pretrained(out_dir)
    settings = {"processor_class": "PixtralProcessor", "patch_size": patch,
                "spatial_merge_size": merge, **_IMAGE_TOKENS["mistral3_vl"]}  # fmt: skip
    (out_dir / "processor_config.json").write_text(json.dumps(settings, indent=2))
    tokenizer.chat_template = MISTRAL3_CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    (out_dir / "chat_template.jinja").write_text(MISTRAL3_CHAT_TEMPLATE)


def _save_llava_onevision_processor_parts(tokenizer: Any, config: Any, out_dir: Path) -> None:
    """LlavaOnevisionProcessor's parts (its video processor requires torchvision): the image
    processor (PIL backend), processor_config.json as the processor saves it, the video
    processor's settings (32 px frames), the tokenizer with <image> and <video>, the template."""
    import transformers

    side = config.vision_config.image_size
    transformers.LlavaOnevisionImageProcessorPil(
        size={"height": side, "width": side}, image_grid_pinpoints=config.image_grid_pinpoints
    ).save_pretrained(out_dir)
    settings = {"processor_class": "LlavaOnevisionProcessor",
                "num_image_tokens": (side // config.vision_config.patch_size) ** 2,
                "vision_feature_select_strategy": config.vision_feature_select_strategy,
                "vision_aspect_ratio": config.vision_aspect_ratio,
                **_IMAGE_TOKENS["llava_onevision"]}  # fmt: skip
    (out_dir / "processor_config.json").write_text(json.dumps(settings, indent=2))
    video = {"video_processor_type": "LlavaOnevisionVideoProcessor",
             "size": {"height": side, "width": side}, "image_mean": [0.5] * 3,
             "image_std": [0.5] * 3, "rescale_factor": 1 / 255}  # fmt: skip
    (out_dir / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    tokenizer.chat_template = LLAVA_ONEVISION_CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    (out_dir / "chat_template.jinja").write_text(LLAVA_ONEVISION_CHAT_TEMPLATE)


def _randomise_vision(model: Any) -> None:
    """What from_config leaves at 1 or 0 in the vision part and a trained checkpoint does not:
    every LayerNorm's scale, Gemma 3's projection (zeros). Idefics3 names its tower vision_model
    and its projector connector."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            vision_parts = ("vision_tower", "multi_modal_projector", "vision_model", "connector",
                            "visual.")  # fmt: skip
            if not any(part in name for part in vision_parts):
                continue
            if name.endswith("mm_input_projection_weight"):
                p.normal_(0.0, INIT_STD)
            elif ("norm" in name or "ln_q" in name) and name.endswith(".weight") and p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)  # ln_q: Qwen2.5-VL's merger's RMSNorm


def _make_with_vision_tower(
    arch: str, out_dir: Path, tokenizer_dir: Path | None, seed: int
) -> Path:
    """*ForConditionalGeneration; llava and gemma3_vl with their processor beside (given a
    tokenizer): AutoProcessor.from_pretrained(out_dir) expands their images' placeholders."""
    import torch
    import transformers

    with_processor = arch in _IMAGE_TOKENS and tokenizer_dir is not None
    vocab_size = _PADDED_VOCAB if with_processor else 49152 if tokenizer_dir is not None else 512
    tokenizer = _image_tokenizer(arch, tokenizer_dir) if with_processor else None
    token_ids = _image_token_ids(arch, tokenizer) if arch in _IMAGE_TOKENS else {}
    config = _multimodal_config(arch, vocab_size, token_ids)
    model_class = {"llava": transformers.LlavaForConditionalGeneration,
                   "gemma3_vl": transformers.Gemma3ForConditionalGeneration,
                   "qwen3_5_vl": transformers.Qwen3_5ForConditionalGeneration,
                   "qwen3_5_moe_vl": transformers.Qwen3_5MoeForConditionalGeneration,
                   "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
                   "qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
                   "qwen3_vl_moe": transformers.Qwen3VLMoeForConditionalGeneration,
                   "qwen2_vl": transformers.Qwen2VLForConditionalGeneration,
                   "idefics3": transformers.Idefics3ForConditionalGeneration,
                   "mistral3_vl": transformers.Mistral3ForConditionalGeneration,
                   "llava_onevision": transformers.LlavaOnevisionForConditionalGeneration,
                   }[arch]  # fmt: skip
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    _perturb(model)
    if arch in _IMAGE_TOKENS:
        _randomise_vision(model)
    model.save_pretrained(out_dir, safe_serialization=True)
    if arch == "qwen3_vl_moe":
        _transpose_stacked_experts(out_dir / "model.safetensors")
    _copy_tokenizer(out_dir, tokenizer_dir)
    if with_processor and arch in _QWEN_VL_ARCHS:
        _save_qwen_processor_parts(tokenizer, config, out_dir)
    elif with_processor and arch == "mistral3_vl":
        _save_pixtral_processor_parts(tokenizer, config, out_dir)
    elif with_processor and arch == "llava_onevision":
        _save_llava_onevision_processor_parts(tokenizer, config, out_dir)
    elif with_processor:  # over the copied tokenizer files: the tokenizer with its image tokens
        _processor(arch, tokenizer, config).save_pretrained(out_dir)
    return out_dir


def _transpose_stacked_experts(path: Path) -> None:
    """Qwen3-VL-MoE's released layout: each expert's matrices transposed, gate_up_proj (E, H, 2I),
    down_proj (E, I, H); transformers 5 saves them as it holds them and transposes on loading."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    for name, tensor in tensors.items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            tensors[name] = tensor.transpose(1, 2).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})


def _perturb(model: Any) -> None:
    """Norms start at 1.0 (or 0 for 1 + weight): perturb them, and the biases, so a wrong one shows."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
            elif name.endswith(".bias"):
                p.normal_(0.0, INIT_STD)


def _copy_tokenizer(out_dir: Path, tokenizer_dir: Path | None) -> None:
    generation_config = {"bos_token_id": 1, "eos_token_id": 2}
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copy(Path(tokenizer_dir) / name, out_dir / name)
        source = Path(tokenizer_dir) / "generation_config.json"
        if source.is_file():
            generation_config = json.loads(source.read_text())
    (out_dir / "generation_config.json").write_text(json.dumps(generation_config, indent=2))


def _to_transformers4_style(config_path: Path) -> None:
    """Rewrite rope_parameters as top-level rope_theta plus rope_scaling {type, factor}."""
    cfg = json.loads(config_path.read_text())
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    rope_type = rope.pop("rope_type")
    cfg["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, **rope}
    config_path.write_text(json.dumps(cfg, indent=2))


def _save_reward_model(model: Any, out_dir: Path) -> None:
    """A Qwen2Model plus a random score MLP, saved under Qwen2ForRewardModel's names."""
    import torch
    from safetensors.torch import save_file

    h = model.config.hidden_size
    tensors = {f"model.{k}": v.contiguous() for k, v in model.state_dict().items()}
    tensors["score.0.weight"] = torch.randn(h, h) * h**-0.5
    tensors["score.0.bias"] = torch.randn(h) * INIT_STD
    tensors["score.2.weight"] = torch.randn(1, h) * h**-0.5
    tensors["score.2.bias"] = torch.randn(1) * INIT_STD
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    model.config.architectures = ["Qwen2ForRewardModel"]
    model.config.save_pretrained(out_dir)


def make_tiny_model(
    arch: str,
    out_dir: Path,
    tokenizer_dir: Path | None = None,
    seed: int = 0,
    head: str = "lm_head",
    num_labels: int = 1,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Write a random tiny `arch` checkpoint (with `head`, its config's sizes changed by
    `overrides`) to out_dir (created); return out_dir."""
    import torch
    import transformers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_size = 49152 if tokenizer_dir is not None else 512
    if arch not in ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r} (one of {ARCHS})")
    if head not in HEADS or (head == "score_mlp" and arch != "qwen2"):
        raise ValueError(
            f"unknown head {head!r} for {arch} (one of {sorted(HEADS)}; score_mlp: qwen2)"
        )
    if arch in _VISION_ARCHS:
        return _make_with_vision_tower(arch, out_dir, tokenizer_dir, seed)
    family = _FAMILIES[arch]
    config_class = getattr(transformers, f"{family}Config")
    model_class = getattr(transformers, family + HEADS[head])
    if arch == "qwen3_5_moe":
        config_class = transformers.Qwen3_5MoeTextConfig
        model_class = getattr(
            transformers, {"Model": "Qwen3_5MoeTextModel"}.get(HEADS[head], family + HEADS[head])
        )
    if arch == "qwen3_5":
        config_class = transformers.Qwen3_5TextConfig
        model_class = getattr(
            transformers, {"Model": "Qwen3_5TextModel"}.get(HEADS[head], family + HEADS[head])
        )
    if arch == "gemma3":  # the text-only classes (Gemma3Config is the multimodal one)
        config_class = transformers.Gemma3TextConfig
        model_class = getattr(
            transformers, {"Model": "Gemma3TextModel"}.get(HEADS[head], family + HEADS[head])
        )
        if head == "score":
            model_class = transformers.Gemma3TextForSequenceClassification
    kwargs = {**_config_kwargs(arch, vocab_size), **(overrides or {})}
    if head == "score":
        kwargs["num_labels"] = num_labels
    config = config_class(**kwargs)
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    _perturb(model)
    if head == "score_mlp":
        _save_reward_model(model, out_dir)
    else:
        model.save_pretrained(out_dir, safe_serialization=True)
    if arch == "qwen2":
        _to_transformers4_style(out_dir / "config.json")

    _copy_tokenizer(out_dir, tokenizer_dir)
    return out_dir


def add_mtp_head(model_dir: Path, out_dir: Path, seed: int = 0) -> Path:
    """A copy of a tiny qwen3_5 / qwen3_5_moe checkpoint with a random multi-token-prediction head
    as Qwen3.5 releases carry one (`mtp_num_hidden_layers: 1`; `mtp.fc` [hidden, 2 * hidden],
    `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.norm` and `mtp.layers.0.*`
    shaped as the last full-attention layer), which transformers neither builds nor saves."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    out_dir = Path(out_dir)
    shutil.copytree(model_dir, out_dir, dirs_exist_ok=True)
    config = json.loads((out_dir / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    weights = load_file(out_dir / "model.safetensors")
    last_full = max(i for i, t in enumerate(config["layer_types"]) if t == "full_attention")
    prefix = f"model.layers.{last_full}."
    gen = torch.Generator().manual_seed(seed)
    hidden = config["hidden_size"]

    def like(t: torch.Tensor, name: str) -> torch.Tensor:
        if name.endswith("norm.weight"):  # 1 + weight norms: around 0
            return torch.randn(t.shape, generator=gen) * 0.2
        return torch.randn(t.shape, generator=gen) * max(float(t.float().std()), INIT_STD)

    for name, t in list(weights.items()):
        if name.startswith(prefix):
            mtp_name = "mtp.layers.0." + name[len(prefix) :]
            weights[mtp_name] = like(t, mtp_name).to(t.dtype)
    weights["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) * INIT_STD
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        weights[f"mtp.{norm}.weight"] = torch.randn(hidden, generator=gen) * 0.2
    save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir


def make_eagle3_head(
    target_dir: Path,
    out_dir: Path,
    feature_layers: list[int],
    draft_vocab_size: int = 256,
    seed: int = 0,
) -> Path:
    """A random EAGLE-3 head for the tiny checkpoint `target_dir`, in the layout EAGLE-3 releases
    use (`LlamaForCausalLMEagle3`: `midlayer.*` whose q/k/v take [embedding, features], `fc`
    [hidden, 3 * target hidden], `norm`, `lm_head` over a draft vocabulary of `draft_vocab_size`
    target ids picked at random, `d2t` (target id - draft id) and `t2d`); no own embedding."""
    import torch
    from safetensors.torch import save_file

    target = json.loads((Path(target_dir) / "config.json").read_text())
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hidden, heads, kv_heads, head_dim, inter = 64, 4, 2, 16, 96
    vocab = target["vocab_size"]
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6, "vocab_size": vocab, "draft_vocab_size": draft_vocab_size,
        "max_position_embeddings": 2048, "rope_theta": 10000.0, "hidden_act": "silu",
        "target_hidden_size": target["hidden_size"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": feature_layers},
    }  # fmt: skip
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float = INIT_STD) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std

    ids = torch.randperm(vocab, generator=gen)[:draft_vocab_size].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    weights = {
        "fc.weight": randn(hidden, 3 * target["hidden_size"]),
        "norm.weight": 1 + randn(hidden, std=0.2),
        "lm_head.weight": randn(draft_vocab_size, hidden, std=1.0),
        "d2t": ids - torch.arange(draft_vocab_size),
        "t2d": t2d,
    }
    layer = {
        "input_layernorm.weight": 1 + randn(hidden, std=0.2),
        "hidden_norm.weight": 1 + randn(hidden, std=0.2),
        "post_attention_layernorm.weight": 1 + randn(hidden, std=0.2),
        "self_attn.q_proj.weight": randn(heads * head_dim, 2 * hidden),
        "self_attn.k_proj.weight": randn(kv_heads * head_dim, 2 * hidden),
        "self_attn.v_proj.weight": randn(kv_heads * head_dim, 2 * hidden),
        "self_attn.o_proj.weight": randn(hidden, heads * head_dim),
        "mlp.gate_proj.weight": randn(inter, hidden),
        "mlp.up_proj.weight": randn(inter, hidden),
        "mlp.down_proj.weight": randn(hidden, inter),
    }
    weights.update({f"midlayer.{k}": v for k, v in layer.items()})
    save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir


_FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_lora_adapter(
    base_dir: Path,
    out_dir: Path,
    rank: int = 8,
    targets: tuple[str, ...] = LORA_TARGETS,
    seed: int = 0,
    alpha: float = 16.0,
    use_rslora: bool = False,
    scale: float = 0.5,
) -> Path:
    """A PEFT LoRA adapter of the model in base_dir, written by peft as trainers write them, with
    random A and B (B times `scale`, so that the adapter changes the model's choices without
    drowning it); return out_dir."""
    import peft
    import torch
    import transformers

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora,
        init_lora_weights=False, lora_dropout=0.0,
    )  # fmt: skip
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(scale)
    model.save_pretrained(out_dir)
    return Path(out_dir)


def _to_mxfp4(w: Any) -> tuple[Any, Any]:
    """float (..., K) with K % 32 == 0 -> (blocks (..., K / 32, 16) uint8, scales (..., K / 32)
    uint8): each block of 32 values scaled by a power of two that puts its largest at most 6,
    each value rounded to the nearest e2m1 (sign, two exponent bits, one mantissa bit)."""
    import torch

    groups = w.float().unflatten(-1, (-1, 32))
    peak = groups.abs().amax(-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(peak / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    grid = torch.tensor(_FP4)
    code = (scaled.abs().unsqueeze(-1) - grid).abs().argmin(-1)  # nearest magnitude
    code = code + 8 * (scaled < 0)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exponent + 127).to(torch.uint8)


def write_mxfp4_gpt_oss(model_dir: Path, mxfp4_dir: Path) -> None:
    """gpt-oss as released: the tiny checkpoint's experts quantized to MXFP4 in mxfp4_dir (their
    `_blocks` and `_scales`, laid out (E, rows, columns / 32, 16) as the released files), and
    model_dir rewritten with the dequantized experts: the weights Hugging Face then runs."""
    from safetensors.torch import load_file, save_file

    import workers.weight_loader as loader

    (file,) = Path(model_dir).glob("*.safetensors")
    tensors = load_file(file)
    quantized = {}
    for name in list(tensors):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = _to_mxfp4(tensors[name].transpose(1, 2))  # (E, rows, columns)
            quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
            deq = loader.dequantize_mxfp4(blocks, scales).transpose(1, 2)
            tensors[name] = deq.to(tensors[name].dtype).contiguous()
    save_file(tensors, file, metadata={"format": "pt"})
    mxfp4_dir = Path(mxfp4_dir)
    mxfp4_dir.mkdir(parents=True, exist_ok=True)
    for f in Path(model_dir).iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, mxfp4_dir / f.name)
    kept = {k: v for k, v in tensors.items() if k + "_blocks" not in quantized}
    save_file({**kept, **quantized}, mxfp4_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((mxfp4_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]}  # fmt: skip
    (mxfp4_dir / "config.json").write_text(json.dumps(config, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("arch", choices=ARCHS)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--tokenizer-dir", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--head", choices=sorted(HEADS), default="lm_head")
    parser.add_argument("--num-labels", type=int, default=1)
    args = parser.parse_args()
    print(
        make_tiny_model(
            args.arch, args.out_dir, args.tokenizer_dir, args.seed, args.head, args.num_labels
        )
    )


if __name__ == "__main__":
    main()

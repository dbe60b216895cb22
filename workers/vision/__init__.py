"""Vision encoders for image inputs: a checkpoint's vision tower and multi-modal projector in plain
torch, turning one image's processor outputs into the rows that replace its placeholder tokens in
the prompt's embeddings (Hugging Face's `get_image_features`, to fp32 rounding).

- vit.py: the pre-norm transformer block CLIP and SigLIP share, and its config;
- clip.py: CLIP's vision transformer (class token, pre-layernorm) as LLaVA selects its layers;
- siglip.py: SigLIP's vision transformer (no class token, post-layernorm) as Gemma 3 uses it;
- llava_onevision.py: LLaVA-OneVision's anyres layout (base view, unpadded grid, image_newline);
- idefics3.py: Idefics3's (SmolVLM's) SigLIP-style tower with variable-resolution positions and
  padding masks, and its pixel-shuffle connector;
- projectors.py: LLaVA's two-layer MLP and Gemma 3's pooled, normed projection;
- qwen_vit.py: Qwen3.5's vision transformer (patch grid, 2D rotary, its own patch merger);
- encoders.py: `build_image_encoder(hf_config)` -> an `ImageEncoder` per architecture, with the
  mapping from checkpoint tensor names to its parameters.

The encoders know nothing of tokens, prompts or the KV cache; the model runner scatters their rows.
They are small next to the language model and are replicated whole on every tensor-parallel rank.
"""

from workers.vision.encoders import ImageEncoder, build_image_encoder

__all__ = ["ImageEncoder", "build_image_encoder"]

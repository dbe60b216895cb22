"""Audio encoders whose rows fill an audio-language model's placeholders (Qwen2-Audio)."""

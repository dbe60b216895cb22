"""Model architectures tern can run, keyed by config.json's `architectures[0]`, and their arguments.

`ModelArgs` is the part of a Hugging Face config.json the model code needs, read without importing
transformers. Unsupported architectures or features raise a ValueError naming what is missing.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from workers.distributed import ParallelContext
from workers.layers.rotary import RopeParams

# Architecture name -> "module:class", imported on demand (the model modules import this one).
_ARCHITECTURES = {
    "LlamaForCausalLM": "workers.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "workers.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "workers.models.qwen3:Qwen3ForCausalLM",
}


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
    use_sliding_window: bool = False
    checkpoint_dtype: str | None = None  # "dtype" / "torch_dtype" of config.json
    # Not from config.json: the serving option --quantization, set by the model runner.
    quantization: str | None = None

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelArgs:
        archs = hf.get("architectures") or []
        if not archs or archs[0] not in _ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {archs[:1]} (supported: {sorted(_ARCHITECTURES)})"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
        heads = hf["num_attention_heads"]
        return cls(
            architecture=archs[0],
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=hf["max_position_embeddings"],
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope=RopeParams.from_hf_config(hf),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            use_sliding_window=bool(hf.get("use_sliding_window", False)),
            checkpoint_dtype=hf.get("dtype") or hf.get("torch_dtype"),
        )


def load_model_args(model_dir: str | Path) -> ModelArgs:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"no config.json in {model_dir}")
    return ModelArgs.from_hf_config(json.loads(path.read_text()))


def build_model(args: ModelArgs, ctx: ParallelContext) -> nn.Module:
    """An uninitialised model of `args.architecture` (parameters are filled by the weight loader)."""
    module_name, class_name = _ARCHITECTURES[args.architecture].split(":")
    model_class = getattr(importlib.import_module(module_name), class_name)
    return model_class(args, ctx)

"""Model architectures tern can run, keyed by config.json's `architectures[0]`, and their arguments.

`ModelArgs` is the part of a Hugging Face config.json the model code needs, read without importing
transformers, with the task the model is served for (enginecore/model_task.py: the architectures,
their decoder families and heads). Unsupported architectures, features or tasks raise a ValueError
naming what is missing.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from enginecore.model_task import ARCHITECTURES, architecture_of, model_task, num_labels_of
from workers.distributed import ParallelContext
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
    use_sliding_window: bool = False
    checkpoint_dtype: str | None = None  # "dtype" / "torch_dtype" of config.json
    num_labels: int = 0  # outputs of the score head of classifiers and reward models
    # Not from config.json: the serving options --quantization (set by the model runner) and --task
    # (resolved: generate, embed, classify or reward).
    quantization: str | None = None
    task: str = "generate"

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], task: str = "auto") -> ModelArgs:
        architecture = architecture_of(hf)
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
        heads = hf["num_attention_heads"]
        return cls(
            architecture=architecture,
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
            num_labels=num_labels_of(hf),
            task=model_task(hf, task).task,
        )


def load_model_args(model_dir: str | Path, task: str = "auto") -> ModelArgs:
    """config.json's arguments, for the model served as --task `task`."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"no config.json in {model_dir}")
    return ModelArgs.from_hf_config(json.loads(path.read_text()), task)


def build_model(args: ModelArgs, ctx: ParallelContext) -> nn.Module:
    """An uninitialised model of `args.architecture` for `args.task` (the weight loader fills the
    parameters): the decoder of the architecture's family under an LM head (generate) or a
    pooling head (workers/models/pooling.py)."""
    # NOTE: imported here: the model modules import this one (ModelArgs).
    from workers.models.llama import LlamaForCausalLM
    from workers.models.pooling import DecoderForPooling

    family, head = ARCHITECTURES[args.architecture]
    variant = importlib.import_module(f"workers.models.{family}").decoder_variant(args)
    if args.task == "generate":
        return LlamaForCausalLM(args, ctx, variant)
    return DecoderForPooling(args, ctx, variant, "none" if args.task == "embed" else head)

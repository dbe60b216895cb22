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
}

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

    @property
    def is_pooling(self) -> bool:
        return self.task in POOLING_TASKS

    @property
    def pooled_size(self) -> int:
        """Length of a pooling request's output vector (0 for generate)."""
        if self.task == "embed":
            return self.hidden_size
        return self.num_labels if self.is_pooling else 0


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


def model_task(hf: dict[str, Any], requested: str = "auto") -> ModelTask:
    """The task `requested` (--task) resolves to for this config.json; ValueError if the model
    cannot serve it."""
    arch = architecture_of(hf)
    head = ARCHITECTURES[arch][1]
    tasks = _TASKS_OF_HEAD[head]
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
    return ModelTask(arch, head, task, int(hf["hidden_size"]), num_labels, id2label)


def read_model_task(model_dir: str | Path, requested: str = "auto") -> ModelTask:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"no config.json in {model_dir}")
    return model_task(json.loads(path.read_text()), requested)

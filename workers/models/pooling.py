"""A decoder served as a pooling model: embeddings, sequence classifiers, reward models.

`DecoderForPooling` is the family's DecoderModel (the same layers, KV cache and pipeline split as for
generation) with, on the last pipeline stage, one of these heads on the pooled hidden state
(pooling itself is workers/layers/pooler.py, run by the model runner across prefill chunks):
- "none" (task embed): the pooled hidden state itself; an LM head or score head in the checkpoint
  is not built and its weights are skipped.
- "score" (*ForSequenceClassification): Hugging Face's `score` Linear(hidden, num_labels,
  bias=False), replicated on every tensor-parallel rank (it is tiny).
- "score_mlp" (Qwen2ForRewardModel, as Qwen2.5-Math-RM's modeling_qwen2_rm.py):
  `score` = Sequential(Linear(hidden, hidden), ReLU, Linear(hidden, 1)), biases on both, so the
  checkpoint names are score.0.* and score.2.*; column- then row-parallel, so under TP the last
  stage's ranks meet in one all-reduce.
Heads stay unquantized under --quantization: they are small and their outputs are the answer.

Checkpoint names: `model.*` as for generation; a bare decoder's checkpoint (LlamaModel saved on its
own: `layers.*`, `embed_tokens.*`, `norm.*`) is read as if under `model.`.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.distributed import ParallelContext
from workers.layers.attention import AttentionMetadata
from workers.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from workers.models.args import ModelArgs
from workers.models.decoder import DecoderModel, DecoderSpec, language_model_name

_BARE_DECODER_PREFIXES = ("layers", "embed_tokens", "norm")


def build_score_head(head: str, args: ModelArgs, ctx: ParallelContext) -> nn.Module | None:
    if head == "none":
        return None
    if head == "score":
        return ReplicatedLinear(args.hidden_size, args.num_labels, bias=False, ctx=ctx)
    if head == "score_mlp":
        h = args.hidden_size
        return nn.Sequential(
            ColumnParallelLinear(h, h, bias=True, ctx=ctx),
            nn.ReLU(),
            RowParallelLinear(h, args.num_labels, bias=True, ctx=ctx),
        )
    raise ValueError(f"unknown pooling head {head!r}")


class DecoderForPooling(nn.Module):
    def __init__(self, args: ModelArgs, ctx: ParallelContext, spec: DecoderSpec, head: str) -> None:
        super().__init__()
        self.args = args
        self.ctx = ctx
        self.model = DecoderModel(args, ctx, spec)
        self.head = head
        self.score = build_score_head(head, args, ctx) if ctx.is_last_stage else None

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        intermediate: torch.Tensor | None = None,
        image_embeds: None = None,
    ) -> torch.Tensor:
        """As DecoderForCausalLM's: final hidden states (T, hidden) on the last stage, hidden states
        and residual (2, T, hidden) on the others (pooling models take no images)."""
        return self.model(input_ids, meta, intermediate)

    def local_weight_name(self, name: str) -> str | None:
        """The name this stage loads checkpoint tensor `name` as, or None to skip it (another
        stage's, or a head this model does not build)."""
        if self.args.multimodal and (name := language_model_name(name)) is None:
            return None
        parts = name.split(".")
        if parts[0] in _BARE_DECODER_PREFIXES:
            name, parts = f"model.{name}", ["model", *parts]
        if parts[0] == "lm_head":
            return None
        if parts[0] == "score":
            return name if self.head != "none" and self.ctx.is_last_stage else None
        return name if self.model.holds(name) else None

    def compute_pooled(self, pooled: torch.Tensor) -> torch.Tensor:
        """Pooled hidden states (N, hidden) float32 -> the requests' outputs (N, pooled_size)
        float32: the vectors themselves (embed) or the score head's logits. Last stage only; every
        rank of it calls this (a collective under TP for score_mlp)."""
        assert self.ctx.is_last_stage, "only the last pipeline stage pools"
        if self.score is None:
            return pooled
        dtype = self.model.norm.weight.dtype
        return self.score(pooled.to(dtype)).float()

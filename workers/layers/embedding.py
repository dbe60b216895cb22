"""Vocabulary-parallel token embedding and LM head.

Each rank holds a contiguous slice of ceil(vocab / tp_size) rows (the last slice zero-padded). The
embedding looks up the ids it owns and all-reduces; the LM head computes its slice of the logits
and all-gathers them, trimming the padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.distributed import ParallelContext
from workers.layers.linear import copy_checked


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, *, ctx: ParallelContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.num_embeddings = num_embeddings
        self.num_per_partition = -(-num_embeddings // ctx.tp_size)
        self.vocab_start = ctx.tp_rank * self.num_per_partition
        self.vocab_end = min(self.vocab_start + self.num_per_partition, num_embeddings)
        self.weight = nn.Parameter(
            torch.empty(self.num_per_partition, embedding_dim), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if shard_id is not None:
            raise ValueError(f"unexpected shard {shard_id!r} for {type(self).__name__}")
        expected = (self.num_embeddings, param.size(1))
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(
                f"weight shape mismatch: expected {expected}, got {tuple(loaded_weight.shape)}"
            )
        size = self.vocab_end - self.vocab_start
        param.data[size:].zero_()
        copy_checked(param.data[:size], loaded_weight.narrow(0, self.vocab_start, size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, D)
        if self.ctx.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        is_local = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(is_local, input_ids - self.vocab_start, 0)
        y = F.embedding(local_ids, self.weight) * is_local.unsqueeze(-1).to(self.weight.dtype)
        return self.ctx.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states -> logits over the whole vocabulary. May share its weight with the embedding."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, ctx: ParallelContext) -> None:
        super().__init__(num_embeddings, embedding_dim, ctx=ctx)

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's weight (tie_word_embeddings): the checkpoint has no lm_head."""
        assert embedding.weight.shape == self.weight.shape
        self.weight = embedding.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # (N, D) -> (N, vocab)
        logits = F.linear(hidden_states, self.weight)
        if self.ctx.tp_size > 1:
            logits = self.ctx.all_gather(logits, dim=-1)
        return logits[..., : self.num_embeddings]

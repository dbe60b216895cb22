"""Vocabulary-parallel token embedding and LM head.

Each rank holds a contiguous slice of ceil(vocab / tp_size) rows (the last slice zero-padded). The
embedding looks up the ids it owns and all-reduces; the LM head computes its slice of the logits
and all-gathers them, trimming the padding. With `quant="int8"` the rows are stored int8 with one
scale each (quantization.py), quantized as they are loaded; a tied LM head shares them. A GGUF
file's Q8_0 / Q4_0 / Q4_1 rows are kept as stored (`keep_gguf_blocks`, gguf_blocks.py): looked up
and dequantized, and multiplied as the linear layers multiply them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.distributed import ParallelContext
from workers.layers.linear import copy_checked, dense_linear, pack_weight
from workers.quant import gguf_blocks, quantization


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        ctx: ParallelContext,
        quant: str | None = None,
    ) -> None:
        super().__init__()
        quantization.check_quantization(quant)
        self.ctx = ctx
        self.quant = quant
        self.dtype = torch.get_default_dtype()  # of the model: int8 rows are dequantized to it
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.num_per_partition = -(-num_embeddings // ctx.tp_size)
        self.vocab_start = ctx.tp_rank * self.num_per_partition
        self.vocab_end = min(self.vocab_start + self.num_per_partition, num_embeddings)
        if quant is None:
            self.weight = nn.Parameter(
                torch.empty(self.num_per_partition, embedding_dim), requires_grad=False
            )
        else:
            self.weight = quantization.new_packed_weight(self.num_per_partition, embedding_dim)
        self._int8 = quantization.PackedInt8(self.num_per_partition)
        self.weight.weight_loader = self.weight_loader

    def keep_gguf_blocks(self, block_type: str, quantize_x: bool = False) -> None:
        """Store the rows as GGUF blocks of `block_type` (the padding rows zero: dequantized to
        zeros); before the checkpoint loads."""
        self.weight = gguf_blocks.new_parameter(
            self.num_per_partition, self.embedding_dim, block_type
        )
        self.weight.weight_loader = self.weight_loader
        self.quant, self.block_type, self.gguf_quantize_x = "gguf", block_type, quantize_x

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if shard_id is not None:
            raise ValueError(f"unexpected shard {shard_id!r} for {type(self).__name__}")
        expected = (self.num_embeddings, self.embedding_dim)
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(
                f"weight shape mismatch: expected {expected}, got {tuple(loaded_weight.shape)}"
            )
        size = self.vocab_end - self.vocab_start
        rows = loaded_weight.narrow(0, self.vocab_start, size)
        if self.quant is None:
            param.data[size:].zero_()
            copy_checked(param.data[:size], rows)
            return
        if self.quant == "gguf":
            param.data[size:].zero_()
            copy_checked(
                param.data[:size], gguf_blocks.rows_of(rows, self.block_type, self.embedding_dim)
            )
            return
        if not isinstance(rows, torch.Tensor):  # a lazy checkpoint slice: read it now
            rows = rows.materialize()
        padding = torch.zeros(self.num_per_partition - size, rows.size(1))
        quantization.store_rows(param.data, self.num_per_partition, 0, torch.cat((rows, padding)))

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is None:  # .to: a bfloat16-stored weight under float32 activations
            return F.embedding(ids, self.weight).to(self.dtype)
        if self.quant == "gguf":
            rows = self.weight[ids.flatten()]
            values = gguf_blocks.dequantize(rows, self.block_type, self.embedding_dim)
            return values.view(*ids.shape, -1).to(self.dtype)
        weight, scale = self._int8.views(self.weight)
        return (F.embedding(ids, weight).float() * scale[ids].unsqueeze(-1)).to(self.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, D)
        if self.ctx.tp_size == 1:
            return self._lookup(input_ids)
        is_local = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(is_local, input_ids - self.vocab_start, 0)
        y = self._lookup(local_ids) * is_local.unsqueeze(-1).to(self.dtype)
        return self.ctx.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states -> logits over the whole vocabulary. May share its weight with the embedding."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        ctx: ParallelContext,
        quant: str | None = None,
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, ctx=ctx, quant=quant)
        self.packed_weight: torch.Tensor | None = None
        self.gguf_packed: list[torch.Tensor | None] | None = None  # as LinearBase's
        self.batch_invariant = False  # --batch-invariant (set by the model runner)

    def repack_weights(self) -> None:
        packs = self.quant is None and self.dtype == torch.bfloat16
        self.packed_weight = pack_weight(self.weight) if packs else None
        self.gguf_packed = None
        if self.quant == "gguf" and self.gguf_quantize_x:
            self.gguf_packed = gguf_blocks.repack_layer(
                self.weight, self.block_type, None, self.embedding_dim
            )

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's weight (tie_word_embeddings): the checkpoint has no lm_head."""
        if embedding.quant == "gguf":  # its kept blocks, shared as they are
            self.quant, self.block_type = "gguf", embedding.block_type
            self.gguf_quantize_x = embedding.gguf_quantize_x
        assert embedding.quant == self.quant
        assert (embedding.num_embeddings, embedding.embedding_dim) == (
            self.num_embeddings,
            self.embedding_dim,
        )
        self.weight = embedding.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # (N, D) -> (N, vocab)
        if self.quant is None:
            logits = dense_linear(
                hidden_states, self.weight, None, self.packed_weight, self.batch_invariant
            )
        elif self.quant == "gguf":
            logits = gguf_blocks.linear(
                hidden_states, self.weight, self.block_type, self.embedding_dim, None,
                self.gguf_quantize_x, self.gguf_packed[0] if self.gguf_packed else None,
            )  # fmt: skip
        else:
            weight, scale = self._int8.views(self.weight)
            backend = quantization.int8_backend(hidden_states)
            logits = quantization.int8_matmul(hidden_states, weight, scale, None, backend)
        if self.ctx.tp_size > 1:
            logits = self.ctx.all_gather(logits, dim=-1)
        return logits[..., : self.num_embeddings]

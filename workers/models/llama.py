"""The Llama decoder (LlamaModel, LlamaForCausalLM) in plain torch, from the tensor-parallel layers.

The same blocks serve Qwen2 (bias on q/k/v) and Qwen3 (per-head RMSNorm on q and k): how a family
differs is a `DecoderVariant`, given by its module's `decoder_variant(args)`. Module names mirror
Hugging Face (`model.layers.N.self_attn.qkv_proj`, ...) so the weight loader only has to map q/k/v
and gate/up. Pooling models (embeddings, classifiers, reward models) put another head on the same
LlamaModel: workers/models/pooling.py.

Pipeline parallelism: a stage builds only its own decoder layers (the others are parameterless
`MissingLayer` placeholders, so layer N keeps the name `model.layers.N`), the embedding only on the
first stage, the final norm and the LM head only on the last. A stage that is not last returns its
hidden states and residual stacked (2, T, hidden) for the next stage, which passes them back in as
`intermediate`; `local_weight_name` tells the loader which checkpoint tensors this stage holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from workers.distributed import ParallelContext, mlp_shard, shard_heads, stage_layers
from workers.layers.activation import SiluAndMul
from workers.layers.attention import Attention, AttentionMetadata
from workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from workers.layers.fused_decode import DecodeLayerSpec, FusedDecodeLayer
from workers.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from workers.layers.norm import RMSNorm
from workers.layers.rotary import RotaryEmbedding
from workers.models.registry import ModelArgs


@dataclass(frozen=True)
class DecoderVariant:
    """How a family's decoder layers differ from Llama's."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)


def decoder_variant(args: ModelArgs) -> DecoderVariant:
    """Llama: biases on q/k/v/o when config.json's `attention_bias` says so."""
    return DecoderVariant(qkv_bias=args.attention_bias, o_bias=args.attention_bias)


class LlamaAttention(nn.Module):
    def __init__(self, args: ModelArgs, ctx: ParallelContext, variant: DecoderVariant) -> None:
        super().__init__()
        head_dim = args.head_dim
        self.qkv_proj = QKVParallelLinear(
            args.hidden_size,
            head_dim,
            args.num_attention_heads,
            args.num_key_value_heads,
            bias=variant.qkv_bias,
            ctx=ctx,
            quant=args.quantization,
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(
            args.num_attention_heads * head_dim,
            args.hidden_size,
            bias=variant.o_bias,
            ctx=ctx,
            input_shard=(self.qkv_proj.head_start * head_dim, self.num_heads * head_dim),
            quant=args.quantization,
        )
        self.rotary_emb = RotaryEmbedding(head_dim, args.max_position_embeddings, args.rope)
        self.attn = Attention(self.num_heads, head_dim, self.num_kv_heads, head_dim**-0.5)
        if variant.qk_norm:
            self.q_norm = RMSNorm(head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, args.rms_norm_eps)
        self.qk_norm = variant.qk_norm

    def forward(self, hidden_states: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # (T, (H + 2 Hkv) D)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(meta.positions, q, k)
        o = self.attn(q, k, v, meta)  # (T, H, D)
        return self.o_proj(o.flatten(1))


def mlp_shard_of(args: ModelArgs, tp_size: int, tp_rank: int) -> tuple[int, int]:
    heads = [
        shard_heads(args.num_attention_heads, args.num_key_value_heads, tp_size, r)
        for r in range(tp_size)
    ]
    return mlp_shard(args.intermediate_size, args.hidden_size, args.head_dim, heads, tp_rank)


class LlamaMLP(nn.Module):
    def __init__(self, args: ModelArgs, ctx: ParallelContext) -> None:
        super().__init__()
        inter = args.intermediate_size
        quant = args.quantization
        shard = mlp_shard_of(args, ctx.tp_size, ctx.tp_rank)
        self.gate_up_proj = MergedColumnParallelLinear(
            args.hidden_size, [inter, inter], ctx=ctx, quant=quant, shard=shard
        )
        self.down_proj = RowParallelLinear(
            inter, args.hidden_size, ctx=ctx, input_shard=shard, quant=quant
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, ctx: ParallelContext, variant: DecoderVariant) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(args, ctx, variant)
        self.mlp = LlamaMLP(args, ctx)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        attn, mlp = self.self_attn, self.mlp
        spec = DecodeLayerSpec(
            qkv=attn.qkv_proj, o=attn.o_proj, gate_up=mlp.gate_up_proj, down=mlp.down_proj,
            input_norm=self.input_layernorm, post_norm=self.post_attention_layernorm,
            attention=attn.attn, rotary=attn.rotary_emb, qk_norm=attn.qk_norm,
            silu_gate=isinstance(mlp.act_fn, SiluAndMul),
        )  # fmt: skip
        self.fused_decode = FusedDecodeLayer(spec)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        fused = self.fused_decode(x, residual, meta)  # one native call for small decode steps
        if fused is not None:
            return fused
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class MissingLayer(nn.Module):
    """Stands in for a decoder layer that lives on another pipeline stage."""

    def forward(self, *args: object) -> None:
        raise AssertionError("a layer of another pipeline stage was called")


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs, ctx: ParallelContext, variant: DecoderVariant) -> None:
        super().__init__()
        if args.mlp_bias:
            raise ValueError("mlp_bias=true is not supported")
        self.ctx = ctx
        self.stage_layers = stage_layers(args.num_hidden_layers, ctx.pp_size, ctx.pp_rank)
        self.embed_tokens = (
            VocabParallelEmbedding(
                args.vocab_size, args.hidden_size, ctx=ctx, quant=args.quantization
            )
            if ctx.is_first_stage
            else None
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(args, ctx, variant) if i in self.stage_layers else MissingLayer()
            for i in range(args.num_hidden_layers)
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps) if ctx.is_last_stage else None

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        intermediate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(T,) ids, or on later stages the previous stage's (2, T, hidden) -> see LlamaForCausalLM."""
        if self.embed_tokens is not None:
            x, residual = self.embed_tokens(input_ids), None
        else:
            assert intermediate is not None, (
                "a later pipeline stage needs the previous one's output"
            )
            x, residual = intermediate[0], intermediate[1]
        for i in self.stage_layers:
            x, residual = self.layers[i](x, residual, meta)
        if self.norm is None:
            return torch.stack((x, residual))  # (2, T, hidden)
        x, _ = self.norm(x, residual)
        return x

    def holds(self, name: str) -> bool:
        """Whether this pipeline stage holds checkpoint tensor `name` (model.*)."""
        parts = name.split(".")
        if parts[:2] == ["model", "layers"]:
            return int(parts[2]) in self.stage_layers
        if parts[:2] == ["model", "embed_tokens"]:
            return self.embed_tokens is not None
        if parts[:2] == ["model", "norm"]:
            return self.norm is not None
        return True


class LlamaForCausalLM(nn.Module):
    def __init__(
        self, args: ModelArgs, ctx: ParallelContext, variant: DecoderVariant | None = None
    ) -> None:
        """`variant`: the family's (Qwen2, Qwen3); by default Llama's, from `args`."""
        super().__init__()
        self.args = args
        self.ctx = ctx
        self.model = LlamaModel(args, ctx, variant or decoder_variant(args))
        self.lm_head = None
        if ctx.is_last_stage:
            self.lm_head = ParallelLMHead(
                args.vocab_size, args.hidden_size, ctx=ctx, quant=args.quantization
            )
            if args.tie_word_embeddings and self.model.embed_tokens is not None:
                self.lm_head.tie_to(self.model.embed_tokens)

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        intermediate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids (T,) -> final hidden states (T, hidden) on the last pipeline stage, hidden
        states and residual stacked (2, T, hidden) on the others. Positions come from `meta`;
        `intermediate` is the previous stage's output (None on the first stage)."""
        return self.model(input_ids, meta, intermediate)

    def local_weight_name(self, name: str) -> str | None:
        """The name this stage loads checkpoint tensor `name` as, or None if another stage holds it.

        With tied embeddings, a last stage without the embedding loads it as its LM head.
        """
        parts = name.split(".")
        if parts[:2] == ["model", "embed_tokens"] and self.model.embed_tokens is None:
            if self.lm_head is not None and self.args.tie_word_embeddings:
                return ".".join(["lm_head", *parts[2:]])
            return None
        if parts[0] == "lm_head":
            return name if self.ctx.is_last_stage else None
        return name if self.model.holds(name) else None

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Hidden states of the rows that sample (N, hidden) -> logits (N, vocab); last stage only."""
        assert self.lm_head is not None, "only the last pipeline stage has the LM head"
        return self.lm_head(hidden_states)

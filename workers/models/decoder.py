"""The decoder every dense family shares (DecoderModel, DecoderForCausalLM), in plain torch from the
tensor-parallel layers; a family is a `DecoderSpec` its module returns from `decoder_spec(args)`.

A spec says where a family departs from Llama: which norms a layer has and where (before attention,
on its output, before the MLP, on the MLP's output) under Hugging Face's names, their form (Gemma's
1 + weight), q/k norms per head or over the whole projection, the MLP's activation, the attention
scale and logit softcapping, each layer's sliding window and rotation (its own rope base, none for
NoPE layers, partial or interleaved), and the multipliers of the embedding, the residual branches and
the logits, and the final logit softcapping; and for hybrids (Qwen3.5) which layers are Gated DeltaNet
linear attention (workers/layers/gated_delta_net.py) and that attention has an output gate. Module
names mirror Hugging Face (`model.layers.N.self_attn.qkv_proj`, ...) so the weight loader only maps
q/k/v and gate/up (and splits checkpoints that store them fused: Phi-3, GLM-4). Pooling models put
another head on the same DecoderModel: workers/models/pooling.py. Checkpoints released with a vision
tower (`*ForConditionalGeneration`) load their language model (`language_model_name`), and where
tern serves their images (LLaVA) the first stage also holds the image encoder (`vision`), whose rows
replace the image placeholders' embeddings.

Every softmax-attention layer of these families can take the fused decode path
(workers/kernels/fused_decode.py: norms where the spec puts them, q/k norms, rotation whole, partial,
in pairs or none, softcapping, SiLU or GELU-tanh gates, multipliers, output gates); where its
dtypes or parallel layout rule it out, it says why, and the start-up log shows it.

Pipeline parallelism: a stage builds only its own decoder layers (the others are parameterless
`MissingLayer` placeholders, so layer N keeps the name `model.layers.N`), the embedding only on the
first stage, the final norm and the LM head only on the last. A stage that is not last returns its
hidden states and residual stacked (2, T, hidden) for the next stage, which passes them back in as
`intermediate`; `local_weight_name` tells the loader which checkpoint tensors this stage holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from workers.distributed import ParallelContext, mlp_shard, shard_heads, stage_layers
from workers.kernels import elementwise_ops
from workers.kernels.fused_decode import DecodeLayerSpec, FusedDecodeLayer, FusedDecodeStack
from workers.layers.activation import GATED_ACTIVATIONS, GeluTanhAndMul
from workers.layers.attention import Attention, AttentionMetadata
from workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from workers.layers.gated_delta_net import GatedDeltaNet
from workers.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    copy_checked,
    default_weight_loader,
)
from workers.layers.moe import MoESpec, SparseMoE
from workers.layers.norm import RMSNorm, ShardedRMSNorm
from workers.layers.rotary import RopeParams, RotaryEmbedding
from workers.models.args import ModelArgs
from workers.models.kv_cache_groups import cache_slots, plan_kv_cache_groups
from workers.vision.encoders import build_image_encoder, deepstack_layers

# The norm slots of a layer, in the order the residual stream meets them.
NORM_SLOTS = ("input", "attn_out", "pre_mlp", "mlp_out")
LLAMA_NORMS = {"input": "input_layernorm", "pre_mlp": "post_attention_layernorm"}


@dataclass(frozen=True)
class LayerKind:
    """What differs between the layers of one model."""

    rope: RopeParams | None  # None: no rotation (SmolLM3's NoPE layers)
    sliding_window: int | None = None  # keys q - window < k <= q; None: all earlier keys
    # "attention" (softmax attention over the KV cache) or "linear_attention" (Gated DeltaNet over
    # per-sequence states: Qwen3.5's linear layers)
    mixer: str = "attention"
    mlp: str = "dense"  # or "moe": the spec's mixture of experts (workers/layers/moe.py)


@dataclass(frozen=True)
class DecoderSpec:
    """How a family's decoder differs from Llama's (see the module docstring)."""

    layers: tuple[LayerKind, ...]  # one per decoder layer
    norms: dict[str, str] = field(default_factory=lambda: dict(LLAMA_NORMS))  # slot -> HF name
    norm_offset: float = 0.0  # Gemma: the norms multiply by 1 + weight
    norm_weight_in_float32: bool = False  # the norm multiplies before casting back (OLMo 2, Gemma)
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str | None = None  # "head": per head before rotation (Qwen3); "full": whole projection
    activation: str = "silu"
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None
    final_softcap: float | None = None
    embed_scale: float = 1.0  # multiplies the token embeddings (Gemma: sqrt(hidden); Granite)
    residual_scale: float = 1.0  # multiplies each branch before the residual add (Granite)
    logits_divisor: float = 1.0  # divides the logits (Granite's logits_scaling)
    rope_interleaved: bool = False  # rotate pairs (GLM) rather than halves
    attn_output_gate: bool = False  # q_proj also gives a per-head gate: o * sigmoid(gate) (Qwen3.5)
    attn_sinks: bool = False  # each head has a learned sink logit in its softmax (gpt-oss)
    # Gated DeltaNet's sizes (linear_attention layers): heads, head dims, conv kernel.
    linear_attention: dict[str, int] = field(default_factory=dict)
    moe: MoESpec | None = None  # the experts of the layers whose kind has mlp="moe"

    def with_experts(self, moe: MoESpec, sparse: Sequence[bool]) -> DecoderSpec:
        """This spec with a mixture of experts as the MLP of the layers `sparse` marks."""
        layers = tuple(replace(k, mlp="moe") if s else k for k, s in zip(self.layers, sparse))
        return replace(self, layers=layers, moe=moe)


def layer_kinds(args: ModelArgs, default_types: list[str] | None = None) -> tuple[LayerKind, ...]:
    """Each layer's rotation and window from config.json: `layer_types` ("sliding_attention" /
    "full_attention"; else `default_types`, else Qwen's `max_window_layers` rule, else every layer
    sliding when the config has a window, as Mistral's), with each type's rotation (rope_parameters
    may hold one per type). Qwen's `use_sliding_window: false` turns the window off; a window no
    shorter than max_position_embeddings is no window."""
    hf, n = args.hf_config, args.num_hidden_layers
    window = hf.get("sliding_window")
    if hf.get("use_sliding_window") is False or (
        window is not None and window >= args.max_position_embeddings
    ):
        window = None
    types = hf.get("layer_types") or default_types
    if types is None:
        if window is None:
            types = ["full_attention"] * n
        elif "max_window_layers" in hf:
            types = ["sliding_attention" if i >= hf["max_window_layers"] else "full_attention"
                     for i in range(n)]  # fmt: skip
        else:
            types = ["sliding_attention"] * n
    kinds = {"sliding_attention", "full_attention", "linear_attention"}
    if set(types) - kinds or len(types) != n:
        raise ValueError(f"layer_types must name {n} layers, each one of {sorted(kinds)}")
    ropes = {t: RopeParams.from_hf_config(hf, t) for t in set(types) if t != "linear_attention"}
    return tuple(
        LayerKind(
            ropes.get(t),
            window if t == "sliding_attention" else None,
            "linear_attention" if t == "linear_attention" else "attention",
        )
        for t in types
    )


class DecoderAttention(nn.Module):
    def __init__(
        self,
        args: ModelArgs,
        ctx: ParallelContext,
        spec: DecoderSpec,
        kind: LayerKind,
        rotary: RotaryEmbedding | None,
    ) -> None:
        super().__init__()
        head_dim = args.head_dim
        self.qkv_proj = QKVParallelLinear(
            args.hidden_size,
            head_dim,
            args.num_attention_heads,
            args.num_key_value_heads,
            bias=spec.qkv_bias,
            ctx=ctx,
            quant=args.quantization,
            q_per_head=2 if spec.attn_output_gate else 1,
        )
        self.output_gate = spec.attn_output_gate
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(
            args.num_attention_heads * head_dim,
            args.hidden_size,
            bias=spec.o_bias,
            ctx=ctx,
            input_shard=(self.qkv_proj.head_start * head_dim, self.num_heads * head_dim),
            quant=args.quantization,
        )
        self.rotary_emb = rotary
        scale = spec.attn_scale if spec.attn_scale is not None else head_dim**-0.5
        self.attn = Attention(
            self.num_heads, head_dim, self.num_kv_heads, scale, kind.sliding_window,
            spec.attn_softcap, spec.attn_sinks,
        )  # fmt: skip
        if self.attn.sinks is not None:
            self.attn.sinks.weight_loader = self._load_sinks
        self.qk_norm = spec.qk_norm
        eps = args.rms_norm_eps
        if spec.qk_norm == "head":
            norm_args = (head_dim, eps, spec.norm_offset, spec.norm_weight_in_float32)
            self.q_norm, self.k_norm = RMSNorm(*norm_args), RMSNorm(*norm_args)
        elif spec.qk_norm == "full":
            if ctx.tp_size > args.num_key_value_heads:
                raise ValueError(
                    "q/k norms over the whole projection need --tp <= num_key_value_heads "
                    f"({args.num_key_value_heads}): replicated KV heads would count twice"
                )
            q_shard = (self.qkv_proj.head_start * head_dim, self.num_heads * head_dim)
            kv_start = self.qkv_proj.kv_head_index * head_dim
            self.q_norm = ShardedRMSNorm(args.num_attention_heads * head_dim, q_shard, eps, ctx)
            self.k_norm = ShardedRMSNorm(
                args.num_key_value_heads * head_dim,
                (kv_start, self.num_kv_heads * head_dim),
                eps,
                ctx,
            )

    def _load_sinks(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        """This rank's heads' sinks."""
        if shard_id is not None:
            raise ValueError(f"unexpected shard {shard_id!r}")
        copy_checked(param.data, loaded.narrow(0, self.qkv_proj.head_start, self.num_heads))

    def forward(self, hidden_states: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # (T, (H + 2 Hkv) D)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        gate = None
        if self.output_gate:  # each head's rows: its query, then its gate
            q, gate = q.unflatten(-1, (self.num_heads, 2 * self.head_dim)).chunk(2, dim=-1)
            q, gate = q.flatten(1), gate.flatten(1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(-1, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = _per_head(self.q_norm, q), _per_head(self.k_norm, k)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(meta.positions, q, k, meta.mrope_positions)
        o = self.attn(q, k, v, meta).flatten(1)  # (T, H D)
        if gate is not None:
            if (
                elementwise_ops.usable(o, gate) and o.is_contiguous()
            ):  # the fused layer's arithmetic
                elementwise_ops.sigmoid_gate_(o, gate)
            else:
                o = o * torch.sigmoid(gate)
        return self.o_proj(o)


def _per_head(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm over each head of x (T, heads, D), as rows (T * heads, D): tern's kernel, the one
    the fused decode layer runs, where it applies."""
    t, heads, d = x.shape
    return norm(x.reshape(t * heads, d)).view(t, heads, d)


def mlp_shard_of(args: ModelArgs, tp_size: int, tp_rank: int) -> tuple[int, int]:
    heads = [
        shard_heads(args.num_attention_heads, args.num_key_value_heads, tp_size, r)
        for r in range(tp_size)
    ]
    return mlp_shard(args.intermediate_size, args.hidden_size, args.head_dim, heads, tp_rank)


class DecoderMLP(nn.Module):
    def __init__(self, args: ModelArgs, ctx: ParallelContext, activation: str) -> None:
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
        if activation not in GATED_ACTIVATIONS:
            raise ValueError(
                f"activation {activation!r} is not supported (supported: {sorted(GATED_ACTIVATIONS)})"
            )
        self.act_fn = GATED_ACTIVATIONS[activation]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        args: ModelArgs,
        ctx: ParallelContext,
        spec: DecoderSpec,
        kind: LayerKind,
        rotary: RotaryEmbedding | None,
    ) -> None:
        super().__init__()
        if kind.mixer == "linear_attention":
            la = spec.linear_attention
            self.linear_attn = GatedDeltaNet(
                args.hidden_size, la["num_k_heads"], la["num_v_heads"], la["head_k_dim"],
                la["head_v_dim"], la["conv_kernel"], args.rms_norm_eps, ctx, args.quantization,
            )  # fmt: skip
            self.mixer: nn.Module = self.linear_attn
        else:
            self.self_attn = DecoderAttention(args, ctx, spec, kind, rotary)
            self.mixer = self.self_attn
        if kind.mlp == "moe":
            assert spec.moe is not None
            if args.quantization is not None:
                raise ValueError(
                    f"--quantization {args.quantization} does not cover expert weights yet"
                )
            self.mlp: nn.Module = SparseMoE(
                spec.moe, args.hidden_size, spec.activation, ctx, args.expert_parallel
            )
        else:
            self.mlp = DecoderMLP(args, ctx, spec.activation)
        self.residual_scale = spec.residual_scale
        self.norm_names = {slot: spec.norms.get(slot) for slot in NORM_SLOTS}
        for name in spec.norms.values():
            norm = RMSNorm(
                args.hidden_size, args.rms_norm_eps, spec.norm_offset, spec.norm_weight_in_float32
            )
            setattr(self, name, norm)
        self.fused_decode = None
        self.kv_group = (
            0  # its KV-cache group (workers/models/kv_cache_groups.py), set by the model
        )
        if kind.mixer != "attention":
            return
        attn, mlp = self.self_attn, self.mlp
        dense = kind.mlp == "dense"  # the experts of a MoE layer run after its fused attention
        fused = DecodeLayerSpec(
            qkv=attn.qkv_proj, o=attn.o_proj, gate_up=mlp.gate_up_proj if dense else None,
            down=mlp.down_proj if dense else None,
            input_norm=self._norm("input"), post_norm=self._norm("pre_mlp"),
            attn_out_norm=self._norm("attn_out"), mlp_out_norm=self._norm("mlp_out"),
            q_norm=getattr(attn, "q_norm", None), k_norm=getattr(attn, "k_norm", None),
            attention=attn.attn, rotary=attn.rotary_emb,
            gelu=dense and isinstance(mlp.act_fn, GeluTanhAndMul),
            residual_scale=spec.residual_scale,
            output_gate=spec.attn_output_gate,
        )  # fmt: skip
        self.fused_decode = FusedDecodeLayer(fused)

    def _norm(self, slot: str) -> RMSNorm | None:
        name = self.norm_names[slot]
        return None if name is None else getattr(self, name)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's branch output, the residual stream before it is added): each layer adds
        the previous one's branch into the stream inside its first norm."""
        meta = meta.for_kv_group(self.kv_group)
        # (The fused layers rotate by `positions`: not the M-RoPE positions of a step with images.)
        if self.fused_decode is not None and meta.mrope_positions is None:
            fused = self.fused_decode(x, residual, meta)  # one native call for small decode steps
            if fused is not None:
                if isinstance(self.mlp, DecoderMLP):
                    return fused
                h, stream = fused  # the experts' input, after the fused attention
                return self._mlp_branch(h), stream
        input_norm, attn_out = self._norm("input"), self._norm("attn_out")
        pre_mlp = self._norm("pre_mlp")
        if input_norm is not None:
            h, stream = (input_norm(x), x) if residual is None else input_norm(x, residual)
        else:
            stream = x if residual is None else x + residual
            h = stream
        h = self.mixer(h, meta)
        if attn_out is not None:
            h = attn_out(h)
        if self.residual_scale != 1.0:
            h = h * self.residual_scale
        if pre_mlp is not None:
            h, stream = pre_mlp(h, stream)
        else:
            stream = stream + h
            h = stream
        return self._mlp_branch(h), stream

    def _mlp_branch(self, h: torch.Tensor) -> torch.Tensor:
        h = self.mlp(h)
        mlp_out = self._norm("mlp_out")
        if mlp_out is not None:
            h = mlp_out(h)
        if self.residual_scale != 1.0:
            h = h * self.residual_scale
        return h


class MissingLayer(nn.Module):
    """Stands in for a decoder layer that lives on another pipeline stage."""

    def forward(self, *args: object) -> None:
        raise AssertionError("a layer of another pipeline stage was called")


class DecoderModel(nn.Module):
    def __init__(self, args: ModelArgs, ctx: ParallelContext, spec: DecoderSpec) -> None:
        super().__init__()
        if args.mlp_bias:
            raise ValueError("mlp_bias=true is not supported")
        if len(spec.layers) != args.num_hidden_layers:
            raise ValueError(f"{len(spec.layers)} layer kinds for {args.num_hidden_layers} layers")
        self.ctx = ctx
        self.spec = spec
        self.stage_layers = stage_layers(args.num_hidden_layers, ctx.pp_size, ctx.pp_rank)
        self.embed_tokens = (
            VocabParallelEmbedding(
                args.vocab_size, args.hidden_size, ctx=ctx, quant=args.quantization
            )
            if ctx.is_first_stage
            else None
        )
        # One table per distinct rotation, shared by the layers that rotate by it.
        rotaries: dict[RopeParams, RotaryEmbedding] = {}

        def rotary_of(kind: LayerKind) -> RotaryEmbedding | None:
            if kind.rope is None:
                return None
            key = _hashable(kind.rope)
            if key not in rotaries:
                rotaries[key] = RotaryEmbedding(
                    args.head_dim, args.max_position_embeddings, kind.rope, spec.rope_interleaved
                )
            return rotaries[key]

        self.layers = nn.ModuleList(
            DecoderLayer(args, ctx, spec, kind, rotary_of(kind))
            if i in self.stage_layers
            else MissingLayer()
            for i, kind in enumerate(spec.layers)
        )
        self.kv_cache_groups = plan_kv_cache_groups(
            {i: k.sliding_window for i, k in enumerate(spec.layers) if k.mixer == "attention"}
        )
        for i, (group, slot) in cache_slots(self.kv_cache_groups, self.stage_layers).items():
            self.layers[i].kv_group = group
            self.layers[i].self_attn.attn.kv_slot = slot
        self.norm = (
            RMSNorm(
                args.hidden_size, args.rms_norm_eps, spec.norm_offset, spec.norm_weight_in_float32
            )
            if ctx.is_last_stage
            else None
        )
        # An EAGLE-3 head's layers (workers/models/eagle3.py): the residual stream before each is
        # kept, concatenated, as `features` (T, hidden * len(feature_layers)) by every forward.
        self.feature_layers: tuple[int, ...] = ()
        self.features: torch.Tensor | None = None
        # The stage's layers in one native call for small decode steps, where each is fused with
        # its MLP and all read one KV-cache group (dense models without sliding windows).
        stage = [self.layers[i] for i in self.stage_layers]
        self.fused_stack = (
            FusedDecodeStack(stage)
            if stage
            and all(
                layer.fused_decode is not None
                and isinstance(layer.mlp, DecoderMLP)
                and layer.kv_group == stage[0].kv_group
                for layer in stage
            )
            else None
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        intermediate: torch.Tensor | None = None,
        image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """(T,) ids, or on later stages the previous stage's (2, T, hidden) -> see DecoderForCausalLM."""
        deepstack = None  # Qwen3-VL: (rows, (R, k, hidden)) added after each of the first k layers
        if self.embed_tokens is not None:
            x, residual = self.embed_tokens(input_ids), None
            if self.spec.embed_scale != 1.0:
                # NOTE: the scale rounded to the activations' dtype first, as Hugging Face's Gemma.
                x = x * torch.tensor(self.spec.embed_scale).to(x.dtype)
            if image_embeds is not None:
                # The image encoder's rows replace its placeholders' embeddings (after the scale,
                # which Hugging Face applies to the text's only); Qwen3-VL's deepstack rows
                # follow each row's main part, one hidden size each.
                rows, features = image_embeds
                features = features.to(x.dtype).view(rows.numel(), -1, x.shape[-1])
                x = x.index_copy(0, rows, features[:, 0])
                if features.shape[1] > 1:
                    deepstack = rows, features[:, 1:]
        else:
            assert intermediate is not None, (
                "a later pipeline stage needs the previous one's output"
            )
            x, residual = intermediate[0], intermediate[1]
        features = []
        stacked = None
        if (
            self.fused_stack is not None
            and not self.feature_layers
            and meta.mrope_positions is None
            and deepstack is None
        ):
            group = self.layers[self.stage_layers[0]].kv_group
            stacked = self.fused_stack(x, residual, meta.for_kv_group(group))
        if stacked is not None:
            x, residual = stacked
        for i in self.stage_layers if stacked is None else ():
            if i in self.feature_layers:
                features.append(x if residual is None else x + residual)
            x, residual = self.layers[i](x, residual, meta)
            if deepstack is not None and i < deepstack[1].shape[1]:
                # NOTE: Hugging Face adds to the layer's output (residual + x); x is its last term.
                x = x.index_add(0, deepstack[0], deepstack[1][:, i])
        if features:
            self.features = torch.cat(features, -1)
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


# Where checkpoints released with a vision tower keep the language model: transformers 5 names
# first, then the earlier ones (Gemma 3 as Google released it); Idefics3 / SmolVLM's text model.
_LANGUAGE_MODEL_PREFIXES = (
    ("model.language_model.", "model."),
    ("model.text_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
# The vision tower and its projector (Gemma 3's, Qwen3.5's, Idefics3's vision_model and connector,
# LLaVA-OneVision's image_newline), and Qwen3.5's multi-token-prediction head (loaded only when it
# drafts: DecoderForCausalLM.local_weight_name).
_SKIPPED_PREFIXES = (
    "model.vision_tower.", "model.multi_modal_projector.", "vision_tower.",
    "multi_modal_projector.", "model.visual.", "visual.", "model.vision_model.",
    "model.connector.", "model.image_newline", "image_newline", "mtp.", "model.audio_tower.",
    "audio_tower.",
)  # fmt: skip


def language_model_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor name as the text model names it; None for what tern does
    not serve (vision tower, projector, multi-token prediction)."""
    for prefix, replacement in _LANGUAGE_MODEL_PREFIXES:
        if name.startswith(prefix):
            return replacement + name[len(prefix) :]
    return None if name.startswith(_SKIPPED_PREFIXES) else name


def _hashable(rope: RopeParams) -> tuple:
    return (
        rope.theta,
        rope.rope_type,
        repr(sorted(rope.scaling.items())),
        rope.partial_rotary_factor,
    )


class DecoderForCausalLM(nn.Module):
    def __init__(self, args: ModelArgs, ctx: ParallelContext, spec: DecoderSpec) -> None:
        super().__init__()
        self.args = args
        self.ctx = ctx
        self.spec = spec
        self.model = DecoderModel(args, ctx, spec)
        self.mtp: nn.Module | None = None  # the multi-token-prediction head, when it drafts
        # The image encoder (workers/vision/), on the first pipeline stage of a model whose images
        # tern serves: its parameters are the model's (loaded, updated and slept with them).
        self.vision = (
            build_image_encoder(args.image_config)
            if (args.takes_images or args.takes_audio) and ctx.is_first_stage
            else None
        )
        for param in self.vision.parameters() if self.vision is not None else ():
            param.weight_loader = default_weight_loader  # unsharded: copied whole on every rank
        num_deepstack = deepstack_layers(args.image_config) if args.takes_images else 0
        if num_deepstack > len(stage_layers(args.num_hidden_layers, ctx.pp_size, 0)):
            raise ValueError(
                f"the vision tower's {num_deepstack} deepstack layers must be on the first "
                f"pipeline stage, which holds fewer of the {args.num_hidden_layers} layers at "
                f"--pp {ctx.pp_size}"
            )
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
        image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Token ids (T,) -> final hidden states (T, hidden) on the last pipeline stage, hidden
        states and residual stacked (2, T, hidden) on the others. Positions come from `meta`;
        `intermediate` is the previous stage's output (None on the first stage); `image_embeds`
        (first stage), the flat batch's image placeholder rows (R,) and their features (R, hidden)."""
        return self.model(input_ids, meta, intermediate, image_embeds)

    def local_weight_name(self, name: str) -> str | None:
        """The name this stage loads checkpoint tensor `name` as, or None if another stage holds it.

        With tied embeddings, a last stage without the embedding loads it as its LM head.
        """
        if name.startswith("mtp."):  # Qwen3.5's multi-token-prediction head, if it drafts
            return name if self.mtp is not None else None
        if self.vision is not None and (local := self.vision.local_weight_name(name)) is not None:
            return "vision." + local
        if self.args.multimodal and (name := language_model_name(name)) is None:
            return None
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
        logits = self.lm_head(hidden_states)
        if self.spec.logits_divisor != 1.0:
            logits = logits / self.spec.logits_divisor
        cap = self.spec.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

"""An EAGLE-3 draft head (speculative method `eagle3`, workers/spec/head_drafter.py): one decoder layer
trained on the served model's own hidden states, released as its own checkpoint
(`LlamaForCausalLMEagle3`: `midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`).

Position i of the head takes the served model's residual stream at three depths (before layers
`eagle_aux_hidden_state_layer_ids`, by default 2, L / 2 and L - 3: the low, middle and high
features), concatenated and projected to the head's width by `fc`, and the token after it,
t_{i+1}. Its layer normalises the token's embedding (`input_layernorm`) and the features
(`hidden_norm`) apart, and attends over their concatenation (q/k/v take twice the width); the
features are the residual the attention and MLP branches add to. The final norm of that stream
feeds the head's LM head over a smaller draft vocabulary, whose ids map to the served model's by
`d2t` (target id = draft id + d2t[draft id]); the stream before the norm stands in for the
features when the head drafts further. The token embeddings are the served model's unless the
checkpoint carries its own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from workers.distributed import ParallelContext
from workers.layers.attention import Attention, AttentionMetadata
from workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from workers.layers.linear import (
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    copy_checked,
)
from workers.layers.norm import RMSNorm
from workers.layers.rotary import RopeParams, RotaryEmbedding
from workers.models.args import ModelArgs
from workers.models.decoder import DecoderMLP

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def eagle3_config(path: str | Path) -> dict[str, Any]:
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise ValueError(f"the EAGLE-3 head {path}: no config.json")
    hf = json.loads(config_path.read_text())
    arch = (hf.get("architectures") or ["?"])[0]
    if arch not in EAGLE3_ARCHITECTURES:
        raise ValueError(
            f"{path} is a {arch} checkpoint, not an EAGLE-3 head ({', '.join(EAGLE3_ARCHITECTURES)})"
        )
    if hf.get("num_hidden_layers", 1) != 1:
        raise ValueError(
            f"the EAGLE-3 head {path} has {hf['num_hidden_layers']} layers; one served"
        )
    return hf


def aux_layer_ids(hf: dict[str, Any], num_target_layers: int) -> tuple[int, ...]:
    """The served model's layers before which the head's features are taken."""
    ids = hf.get("eagle_aux_hidden_state_layer_ids") or (hf.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    if not ids:
        ids = (2, num_target_layers // 2, num_target_layers - 3)
    if len(set(ids)) != 3 or not all(0 <= i < num_target_layers for i in ids):
        raise ValueError(
            f"EAGLE-3 feature layers {list(ids)}: three distinct layers of the served model's "
            f"{num_target_layers} are needed"
        )
    return tuple(sorted(ids))  # concatenated in the order the forward meets them


class Eagle3Layer(nn.Module):
    def __init__(self, args: ModelArgs, ctx: ParallelContext) -> None:
        super().__init__()
        hidden, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.self_attn = nn.Module()
        qkv = QKVParallelLinear(
            2 * hidden, args.head_dim, args.num_attention_heads, args.num_key_value_heads,
            bias=args.attention_bias, ctx=ctx,
        )  # fmt: skip
        self.self_attn.qkv_proj = qkv
        self.self_attn.o_proj = RowParallelLinear(
            args.num_attention_heads * args.head_dim, hidden, ctx=ctx,
            input_shard=(qkv.head_start * args.head_dim, qkv.num_heads * args.head_dim),
        )  # fmt: skip
        self.rotary = RotaryEmbedding(args.head_dim, args.max_position_embeddings, args.rope)
        self.attn = Attention(
            qkv.num_heads, args.head_dim, qkv.num_kv_heads, args.head_dim**-0.5, None, None, False
        )
        self.mlp = DecoderMLP(args, ctx, args.hf_config.get("hidden_act", "silu"))

    def forward(
        self, embeds: torch.Tensor, features: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (the MLP branch, the residual stream before it)."""
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(features)), -1)
        qkv = self.self_attn.qkv_proj(x)
        q_size, kv_size = self.self_attn.qkv_proj.q_size, self.self_attn.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        d = self.attn.head_dim
        q, k = self.rotary(meta.positions, q.reshape(q.size(0), -1, d), k.reshape(k.size(0), -1, d))
        o = self.attn(q, k, v.reshape(v.size(0), -1, d), meta).flatten(1)
        h, stream = self.post_attention_layernorm(self.self_attn.o_proj(o), features)
        return self.mlp(h), stream


class Eagle3Head(nn.Module):
    def __init__(
        self,
        hf: dict[str, Any],
        target: ModelArgs,
        ctx: ParallelContext,
        own_embedding: bool,
    ) -> None:
        super().__init__()
        heads = hf["num_attention_heads"]
        self.args = ModelArgs(
            architecture=hf["architectures"][0],
            vocab_size=hf.get("vocab_size", target.vocab_size),
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=1,
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=hf.get(
                "max_position_embeddings", target.max_position_embeddings
            ),
            tie_word_embeddings=False,
            rope=RopeParams.from_hf_config(
                {"max_position_embeddings": target.max_position_embeddings, **hf}
            ),
            attention_bias=bool(hf.get("attention_bias", False)),
            hf_config=hf,
        )
        if self.args.vocab_size != target.vocab_size:
            raise ValueError(
                f"the EAGLE-3 head's vocabulary ({self.args.vocab_size}) is not the served "
                f"model's ({target.vocab_size})"
            )
        hidden = self.args.hidden_size
        feature_size = 3 * hf.get("target_hidden_size", target.hidden_size)
        self.fc = ReplicatedLinear(feature_size, hidden, ctx=ctx)
        self.midlayer = Eagle3Layer(self.args, ctx)
        self.norm = RMSNorm(hidden, self.args.rms_norm_eps)
        self.draft_vocab_size = hf.get("draft_vocab_size") or self.args.vocab_size
        self.lm_head = ParallelLMHead(self.draft_vocab_size, hidden, ctx=ctx)
        self.d2t = nn.Parameter(
            torch.zeros(self.draft_vocab_size, dtype=torch.int64), requires_grad=False
        )
        self.d2t.weight_loader = _load_d2t
        self.embed_tokens = (
            VocabParallelEmbedding(self.args.vocab_size, hidden, ctx=ctx) if own_embedding else None
        )

    def local_weight_name(self, name: str) -> str | None:
        """Checkpoint names as this module names them: the speculators format's `model.` prefix
        and `layers.0` dropped; `t2d` (the inverse map) is not needed."""
        name = name.removeprefix("model.")
        if name == "t2d":
            return None
        if name.startswith("layers.0."):
            return "midlayer." + name.removeprefix("layers.0.")
        return name

    def forward(
        self, embeds: torch.Tensor, features: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings of t_{i+1} and the features at i (the served model's three, concatenated,
        or the head's own stream from the draft before) -> (the normed stream, for the LM head;
        the stream, for the next draft)."""
        if features.size(-1) != self.args.hidden_size:
            features = self.fc(features)
        x, stream = self.midlayer(embeds, features, meta)
        return self.norm(x, stream)

    def compute_logits(self, x: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> logits (N, served vocabulary): the draft vocabulary's at their ids in
        the served one, -inf elsewhere."""
        draft = self.lm_head(x).float()
        logits = torch.full(
            (x.size(0), self.args.vocab_size), float("-inf"), dtype=draft.dtype, device=x.device
        )
        ids = torch.arange(self.draft_vocab_size, device=x.device) + self.d2t
        logits[:, ids] = draft
        return logits


def _load_d2t(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    if shard_id is not None:
        raise ValueError(f"unexpected shard {shard_id!r}")
    copy_checked(param.data, loaded)


def load_eagle3_head(
    path: str, target: ModelArgs, ctx: ParallelContext, device: torch.device, dtype: torch.dtype
) -> tuple[Eagle3Head, tuple[int, ...]]:
    """The head of checkpoint `path`, loaded, and the served model's layers it takes features
    before."""
    from safetensors import safe_open

    from workers.layers.linear import LinearBase
    from workers.weight_loader import load_checkpoint

    hf = eagle3_config(path)
    names: set[str] = set()
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())  # noqa: SIM118 (safe_open is not iterable)
    own_embedding = bool({"embed_tokens.weight", "model.embed_tokens.weight"} & names)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            head = Eagle3Head(hf, target, ctx, own_embedding)
    finally:
        torch.set_default_dtype(previous)
    load_checkpoint(head, path)
    for module in head.modules():
        if isinstance(module, (LinearBase, ParallelLMHead, RMSNorm)):
            module.repack_weights()
    return head.eval(), aux_layer_ids(hf, target.num_hidden_layers)

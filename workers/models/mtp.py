"""A checkpoint's own multi-token-prediction layer (Qwen3.5's and Qwen3.5-MoE's `mtp.*`), the draft
of speculative decoding's `mtp` method (workers/spec/head_drafter.py).

Position i of the head takes the served model's final hidden state there, h_i, and the token
after it, t_{i+1}: both RMS-normed (`pre_fc_norm_hidden`, `pre_fc_norm_embedding`), concatenated
[embedding, hidden] and projected back to the hidden size (`fc`), then one decoder layer of the
served model's full-attention kind and a final norm; the served model's LM head turns that into a
guess at t_{i+2}, and the same output stands in for h_{i+1} when the head drafts further.
The layer keeps its keys and values in one more slot of the served model's KV cache (the first
KV-cache group's block tables), so it is sized, sharded, slept and woken with the rest.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.distributed import ParallelContext
from workers.layers.attention import Attention, AttentionMetadata
from workers.layers.linear import ReplicatedLinear
from workers.layers.norm import RMSNorm
from workers.layers.rotary import RotaryEmbedding
from workers.models.args import ModelArgs
from workers.models.decoder import DecoderForCausalLM, DecoderLayer, DecoderSpec


def num_mtp_layers(args: ModelArgs) -> int:
    """The multi-token-prediction layers config.json declares (`mtp_num_hidden_layers`)."""
    return int(args.hf_config.get("mtp_num_hidden_layers") or 0)


class MultiTokenPredictor(nn.Module):
    def __init__(
        self, args: ModelArgs, ctx: ParallelContext, spec: DecoderSpec, kv_slot: int
    ) -> None:
        super().__init__()
        if num_mtp_layers(args) != 1:
            raise ValueError(
                "speculative method mtp drafts with the checkpoint's multi-token-prediction "
                f"layer; this {args.architecture} checkpoint declares {num_mtp_layers(args)} "
                "(config.json mtp_num_hidden_layers), tern serves one"
            )
        full = [k for k in spec.layers if k.mixer == "attention" and k.sliding_window is None]
        if not full:
            raise ValueError(f"{args.architecture} has no full-attention layer kind for its MTP")
        kind = full[-1]
        hidden, eps = args.hidden_size, args.rms_norm_eps

        def norm() -> RMSNorm:
            return RMSNorm(hidden, eps, spec.norm_offset, spec.norm_weight_in_float32)

        self.pre_fc_norm_embedding = norm()
        self.pre_fc_norm_hidden = norm()
        self.fc = ReplicatedLinear(2 * hidden, hidden, ctx=ctx, quant=args.quantization)
        rotary = None
        if kind.rope is not None:
            rotary = RotaryEmbedding(
                args.head_dim, args.max_position_embeddings, kind.rope, spec.rope_interleaved
            )
        self.layers = nn.ModuleList([DecoderLayer(args, ctx, spec, kind, rotary)])
        self.layers[0].self_attn.attn.kv_slot = kv_slot
        self.norm = norm()

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings of t_{i+1} and the hidden states h_i (T, hidden) at the positions `meta`
        gives -> the head's output (T, hidden), both for the LM head and for the next draft."""
        x = torch.cat((self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)), -1)
        x, residual = self.layers[0](self.fc(x), None, meta)
        x, _ = self.norm(x, residual)
        return x, x


def attach_mtp(model: DecoderForCausalLM) -> None:
    """Builds the checkpoint's multi-token-prediction head onto `model` (as `model.mtp`) before the
    weights load, its KV in the slot after this stage's others."""
    if not (model.ctx.is_first_stage and model.ctx.is_last_stage):
        raise ValueError("speculative method mtp is not served with pipeline parallelism")
    slots = [m.kv_slot for m in model.model.modules() if isinstance(m, Attention)]
    model.mtp = MultiTokenPredictor(model.args, model.ctx, model.spec, max(slots, default=-1) + 1)

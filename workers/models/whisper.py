"""Whisper (WhisperForConditionalGeneration): tern's encoder-decoder, as Hugging Face computes it.

The encoder turns one 30-second window's log-mel features (num_mel_bins, 3000) into 1500 states
(two convolutions with GELU, learned positions, pre-norm transformer layers attending both ways,
a final LayerNorm). The decoder is a pre-norm transformer over the text tokens: learned positions,
causal self-attention through the paged KV cache like every other tern model, then attention over
the encoder's states, then the MLP. Its LM head (proj_out) is the token embedding.

What a request's decoder reads from its audio is fixed once the audio is encoded: each decoder
layer's cross-attention keys and values, computed once per request (`cross_attention_kv`) and
kept beside the paged cache by the model runner (workers/runner/audio.py), which hands them in
with the step's metadata (`AttentionMetadata.cross_kv`). The model knows nothing about requests.

Under tensor parallelism every projection is split by heads (column-parallel q/k/v and fc1,
row-parallel out_proj and fc2, which all-reduce), the encoder's as the decoder's; the
convolutions, positions and norms are replicated. Pipeline parallelism is not offered: the
decoder needs the encoder's output at every layer.

As Hugging Face's WhisperAttention, queries are scaled before the product (Whisper is sensitive
to that order in low precision) and attention itself then scales by 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.distributed import ParallelContext
from workers.layers.attention import Attention, AttentionMetadata, CrossAttentionCapture
from workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from workers.layers.linear import ColumnParallelLinear, RowParallelLinear, default_weight_loader
from workers.models.args import ModelArgs
from workers.models.kv_cache_groups import KVCacheGroup

# One encoder window: 30 s of 10 ms frames, halved by the second convolution's stride.
WINDOW_FRAMES = 3000
# A decoder layer's cross-attention keys and values for one request: (H_local, S, D) each.
CrossKV = tuple[torch.Tensor, torch.Tensor]


class WhisperAttention(nn.Module):
    """Projections of one attention block, split by heads; how it attends is the caller's."""

    def __init__(self, d_model: int, num_heads: int, ctx: ParallelContext) -> None:
        super().__init__()
        if num_heads % ctx.tp_size:
            raise ValueError(f"{num_heads} attention heads do not split over --tp {ctx.tp_size}")
        self.head_dim = d_model // num_heads
        self.num_heads = num_heads // ctx.tp_size  # this rank's
        self.scale = self.head_dim**-0.5
        self.q_proj = ColumnParallelLinear(d_model, d_model, bias=True, ctx=ctx)
        self.k_proj = ColumnParallelLinear(d_model, d_model, bias=False, ctx=ctx)
        self.v_proj = ColumnParallelLinear(d_model, d_model, bias=True, ctx=ctx)
        self.out_proj = RowParallelLinear(d_model, d_model, bias=True, ctx=ctx)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """(T, H D) -> (H, T, D)."""
        return x.view(x.size(0), self.num_heads, self.head_dim).transpose(0, 1)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        return self.q_proj(x) * self.scale

    def keys_values(self, x: torch.Tensor) -> CrossKV:
        """States (S, d_model) -> this rank's heads' keys and values, (H, S, D) each."""
        return self.heads(self.k_proj(x)).contiguous(), self.heads(self.v_proj(x)).contiguous()


class WhisperLayer(nn.Module):
    """What encoder and decoder layers share: the MLP after a LayerNorm (Hugging Face's names)."""

    def __init__(self, d_model: int, ffn_dim: int, ctx: ParallelContext) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(d_model, ffn_dim, bias=True, ctx=ctx)
        self.fc2 = RowParallelLinear(ffn_dim, d_model, bias=True, ctx=ctx)
        self.final_layer_norm = nn.LayerNorm(d_model)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.final_layer_norm(h))))


class WhisperEncoderLayer(WhisperLayer):
    def __init__(self, hf: dict, ctx: ParallelContext) -> None:
        d = hf["d_model"]
        super().__init__(d, hf["encoder_ffn_dim"], ctx)
        self.self_attn = WhisperAttention(d, hf["encoder_attention_heads"], ctx)
        self.self_attn_layer_norm = nn.LayerNorm(d)

    def forward(self, h: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """h (S, d_model): one window's states; key_mask (S,) bool: the frames attended to
        (Qwen2-Audio's, which masks a window's padding; Whisper attends to all)."""
        attn = self.self_attn
        x = self.self_attn_layer_norm(h)
        q, (k, v) = attn.heads(attn.query(x)), attn.keys_values(x)
        o = _attend(q, k, v, key_mask)  # (H, S, D)
        h = h + attn.out_proj(o.transpose(0, 1).flatten(1))
        return h + self.mlp(h)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Attention of (H, T, D) queries over (H, S, D) keys and values (those key_mask (S,) keeps),
    queries scaled. NOTE: with a batch dimension torch takes its flash kernel on CPU (never
    forming the S x S scores): 4x faster over a 1500-frame window than the 3-D call's math path."""
    mask = None if key_mask is None else key_mask[None, None, None, :]
    return F.scaled_dot_product_attention(q[None], k[None], v[None], mask, scale=1.0)[0]


class WhisperEncoder(nn.Module):
    def __init__(self, hf: dict, ctx: ParallelContext) -> None:
        super().__init__()
        d = hf["d_model"]
        self.conv1 = nn.Conv1d(hf["num_mel_bins"], d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(hf["max_source_positions"], d)
        self.layers = nn.ModuleList(
            WhisperEncoderLayer(hf, ctx) for _ in range(hf["encoder_layers"])
        )
        self.layer_norm = nn.LayerNorm(d)
        self.num_frames = 2 * hf["max_source_positions"]

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """One window's log-mel features (num_mel_bins, frames) -> its states (S, d_model)."""
        return self.layer_norm(self.layer_states(features))

    def layer_states(self, features: torch.Tensor, key_mask: torch.Tensor | None = None):
        """The states after the last layer, before the final norm (S, d_model)."""
        if features.dim() != 2 or features.size(1) != self.num_frames:
            raise ValueError(
                f"Whisper's encoder takes (mel bins, {self.num_frames}) features; got "
                f"{tuple(features.shape)}"
            )
        x = features.to(self.conv1.weight.dtype).unsqueeze(0)
        x = F.gelu(self.conv2(F.gelu(self.conv1(x))))[0].transpose(0, 1)  # (S, d_model)
        h = x + self.embed_positions.weight
        for layer in self.layers:
            h = layer(h, key_mask)
        return h


class WhisperDecoderLayer(WhisperLayer):
    def __init__(self, hf: dict, ctx: ParallelContext, kv_slot: int) -> None:
        d = hf["d_model"]
        super().__init__(d, hf["decoder_ffn_dim"], ctx)
        self.self_attn = WhisperAttention(d, hf["decoder_attention_heads"], ctx)
        heads, head_dim = self.self_attn.num_heads, self.self_attn.head_dim
        self.attn = Attention(heads, head_dim, heads, 1.0)  # queries come scaled
        self.attn.kv_slot = kv_slot  # the layer's index: the cache keeps a slot per layer
        self.first_head = ctx.tp_rank * heads  # this rank's heads are the global ones from it
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.encoder_attn = WhisperAttention(d, hf["decoder_attention_heads"], ctx)
        self.encoder_attn_layer_norm = nn.LayerNorm(d)

    def forward(
        self, h: torch.Tensor, meta: AttentionMetadata, cross_kv: list[CrossKV], starts: list[int]
    ) -> torch.Tensor:
        """h (T, d_model): the step's tokens; cross_kv: each sequence's keys and values; starts:
        each sequence's first row, then the step's row count (query_start_loc as ints)."""
        attn, heads, head_dim = self.self_attn, self.self_attn.num_heads, self.self_attn.head_dim
        x = self.self_attn_layer_norm(h)
        q = attn.query(x).view(-1, heads, head_dim)
        k = attn.k_proj(x).view(-1, heads, head_dim)
        v = attn.v_proj(x).view(-1, heads, head_dim)
        h = h + attn.out_proj(self.attn(q, k, v, meta).flatten(1))
        x = self.encoder_attn_layer_norm(h)
        h = h + self._cross_attend(x, cross_kv, starts, meta.cross_attention)
        return h + self.mlp(h)

    def _cross_attend(
        self,
        x: torch.Tensor,
        cross_kv: list[CrossKV],
        starts: list[int],
        capture: CrossAttentionCapture | None,
    ) -> torch.Tensor:
        attn = self.encoder_attn
        q = attn.query(x)  # (T, H D)
        out = torch.empty_like(q)
        # NOTE: one product per sequence: each reads its own audio's keys, which no other shares.
        for i, (k, v) in enumerate(cross_kv):
            lo, hi = starts[i], starts[i + 1]
            qh = attn.heads(q[lo:hi])
            o = _attend(qh, k, v)
            out[lo:hi] = o.transpose(0, 1).flatten(1)
            if capture is not None and i in capture.heads:
                self._keep_probabilities(capture, i, qh, k)
        return attn.out_proj(out)

    def _keep_probabilities(
        self, capture: CrossAttentionCapture, seq: int, q: torch.Tensor, k: torch.Tensor
    ) -> None:
        """Sequence `seq`'s attention probabilities at the pairs of this layer's heads on this
        rank, as Hugging Face's eager attention computes them (softmax of the scaled scores)."""
        for j, (layer, head) in enumerate(capture.heads[seq]):
            local = head - self.first_head
            if layer == self.attn.kv_slot and 0 <= local < self.encoder_attn.num_heads:
                scores = q[local].float() @ k[local].float().transpose(0, 1)  # (T, S)
                capture.rows[seq][:, j] = scores.softmax(dim=-1)


class WhisperDecoder(nn.Module):
    def __init__(self, args: ModelArgs, ctx: ParallelContext) -> None:
        super().__init__()
        hf = args.hf_config
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, ctx=ctx)
        self.embed_positions = nn.Embedding(hf["max_target_positions"], args.hidden_size)
        self.layers = nn.ModuleList(
            WhisperDecoderLayer(hf, ctx, i) for i in range(args.num_hidden_layers)
        )
        self.layer_norm = nn.LayerNorm(args.hidden_size)

    def forward(
        self, input_ids: torch.Tensor, meta: AttentionMetadata, cross_kv: list[list[CrossKV]]
    ) -> torch.Tensor:
        """cross_kv: per sequence of the step, per layer."""
        h = self.embed_tokens(input_ids) + self.embed_positions(meta.positions)
        starts = meta.query_start_loc.tolist()  # once per step, not per layer
        for i, layer in enumerate(self.layers):
            h = layer(h, meta, [per_layer[i] for per_layer in cross_kv], starts)
        return self.layer_norm(h)


class WhisperModel(nn.Module):
    def __init__(self, args: ModelArgs, ctx: ParallelContext) -> None:
        super().__init__()
        self.encoder = WhisperEncoder(args.hf_config, ctx)
        self.decoder = WhisperDecoder(args, ctx)
        # The model runner's view of the paged cache: one group, every decoder layer.
        self.kv_cache_groups = [KVCacheGroup(None, tuple(range(args.num_hidden_layers)))]


class WhisperForConditionalGeneration(nn.Module):
    # Checkpoint names are the parameters' own: q/k/v stay apart (Whisper's k_proj has no bias).
    verbatim_weight_names = True

    def __init__(self, args: ModelArgs, ctx: ParallelContext) -> None:
        super().__init__()
        if ctx.pp_size > 1:
            raise ValueError("Whisper is served without pipeline parallelism (--pp 1)")
        self.args = args
        self.ctx = ctx
        self.model = WhisperModel(args, ctx)
        self.lm_head = ParallelLMHead(args.vocab_size, args.hidden_size, ctx=ctx)
        self.lm_head.tie_to(self.model.decoder.embed_tokens)
        for param in self.parameters():
            if not hasattr(param, "weight_loader"):  # convolutions, positions, norms: whole
                param.weight_loader = default_weight_loader

    def encode(self, features: torch.Tensor) -> torch.Tensor:
        """One window's log-mel features (num_mel_bins, 3000) -> encoder states (1500, d_model)."""
        return self.model.encoder(features)

    def cross_attention_kv(self, encoder_states: torch.Tensor) -> list[CrossKV]:
        """Each decoder layer's keys and values over the encoder's states (this rank's heads)."""
        return [
            layer.encoder_attn.keys_values(encoder_states) for layer in self.model.decoder.layers
        ]

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        intermediate: None = None,
        image_embeds: None = None,
    ) -> torch.Tensor:
        """Token ids (T,) -> the decoder's final states (T, d_model); each sequence's
        cross-attention keys and values come in meta.cross_kv."""
        if meta.cross_kv is None or len(meta.cross_kv) != meta.query_start_loc.numel() - 1:
            raise ValueError("every sequence of a Whisper step needs its audio's keys and values")
        return self.model.decoder(input_ids, meta, meta.cross_kv)

    def local_weight_name(self, name: str) -> str | None:
        """Checkpoint names as they are; proj_out is the tied embedding (some exports save it)."""
        return None if name.startswith("proj_out.") else name

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)


def build_model(args: ModelArgs, ctx: ParallelContext) -> nn.Module:
    return WhisperForConditionalGeneration(args, ctx)

"""Mixture-of-experts MLPs: a router picks top-k experts per token, the experts' gated MLPs run on
the tokens routed to them, and their outputs are summed by the routing weights.

The router is the one Hugging Face's families define (Qwen2/3-MoE, OLMoE, Mixtral): a linear layer
to one logit per expert, softmax in float32, the top k, renormalised to sum to 1 when the model
says so (`norm_topk_prob`; Mixtral always). Qwen2-MoE adds a shared expert, a dense MLP every
token takes, scaled by sigmoid(shared_expert_gate(x)). gpt-oss's router has a bias and takes the
top k logits first, then their softmax; its experts have biases and a clamped SwiGLU
(`OaiSwiGLU`), and its checkpoints store each expert's gate and up features interleaved and its
matrices transposed (`layout="gpt_oss"`, converted as they load).

The experts' weights are two stacked tensors under Hugging Face's (transformers 5) names:
`experts.gate_up_proj` (E, 2I, H), each expert's gate rows then its up rows, and
`experts.down_proj` (E, H, I). Released checkpoints store each expert's projections apart
(`experts.N.gate_proj.weight`, Mixtral's `experts.N.w1.weight` ...): the loaders take both.
Qwen3-VL-MoE's released checkpoints store them stacked but each matrix transposed, (E, H, 2I) and
(E, I, H) (`layout="transposed"`), while a live Hugging Face model of it, and the files transformers
5 saves, hold them as the others do.

Tokens are grouped by expert (one stable sort of the step's token-expert pairs), and each expert
that has tokens runs its two products on all of them at once: no per-token loop, and a decode step
reads only the routed experts' weights (few-row products go to tern's kernels, linear.dense_linear).
Tensor parallelism without expert parallelism shards every expert's intermediate features as a
dense MLP's: each rank computes partial sums over its features, all-reduced once per layer. With
expert parallelism (--enable-expert-parallel) each rank holds num_experts / tp whole experts and
computes the token-expert pairs routed to them (every rank routes every token: the router is
replicated and its input is too); the one all-reduce then combines the ranks' experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workers.distributed import ParallelContext, divide
from workers.kernels import elementwise_ops, linear_ops
from workers.layers.activation import GATED_ACTIVATIONS, SiluAndMul
from workers.layers.linear import (
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    copy_checked,
    dense_linear,
)


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int  # of each expert
    norm_topk_prob: bool
    shared_expert_size: int = 0  # Qwen2-MoE's shared expert (0: none)
    # gpt-oss: the router's bias, top k logits then softmax, expert biases, the clamped SwiGLU's
    # limit and alpha, and its checkpoints' layout.
    router_bias: bool = False
    topk_then_softmax: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    layout: str = "hf"  # or "gpt_oss", "transposed" (Qwen3-VL-MoE's checkpoints)


class OaiSwiGLU(nn.Module):
    """gpt-oss's gate: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate,
    limit), over [gate | up] halves."""

    def __init__(self, alpha: float, limit: float) -> None:
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


# Token-expert pairs up to which a step runs them one by one rather than grouped by expert (a
# decode step of one or two sequences): the grouping's sort and gathers cost more than it saves.
FEW_PAIRS = 8


def _read(loaded: torch.Tensor) -> torch.Tensor:
    """A lazy checkpoint slice read whole (layouts that transpose or interleave need it all)."""
    return loaded if isinstance(loaded, torch.Tensor) else loaded.materialize()


def num_experts_of(hf: dict) -> int:
    """config.json's expert count: `num_experts` as released (Qwen, OLMoE), `num_local_experts`
    as Mixtral and transformers 5 write it."""
    return int(hf.get("num_experts") or hf.get("num_local_experts") or 0)


class FusedExperts(nn.Module):
    """Every expert's gated MLP, this rank's share of each one's intermediate features."""

    def __init__(
        self,
        spec: MoESpec,
        hidden_size: int,
        activation: str,
        ctx: ParallelContext,
        expert_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.ctx = ctx
        self.num_experts = spec.num_experts
        self.full_inter = spec.intermediate_size
        self.hidden_size = hidden_size
        if expert_parallel:
            if spec.num_experts % ctx.tp_size:
                raise ValueError(
                    f"--enable-expert-parallel: {spec.num_experts} experts do not split over "
                    f"--tp {ctx.tp_size}"
                )
            self.local_experts = spec.num_experts // ctx.tp_size
            self.first_expert = ctx.tp_rank * self.local_experts
            self.inter, self.feature_start = spec.intermediate_size, 0
        else:
            self.local_experts, self.first_expert = spec.num_experts, 0
            self.inter = divide(spec.intermediate_size, ctx.tp_size)
            self.feature_start = ctx.tp_rank * self.inter
        e, i, h = self.local_experts, self.inter, hidden_size
        self.layout = spec.layout
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, h, i), requires_grad=False)
        self.gate_up_proj.weight_loader = self._load_gate_up
        self.down_proj.weight_loader = self._load_down
        for p in (self.gate_up_proj, self.down_proj):  # the checkpoint's, for the weight loader
            p.num_experts = spec.num_experts
        self.gate_up_proj_bias = self.down_proj_bias = None
        if spec.expert_bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i), requires_grad=False)
            self.down_proj_bias = nn.Parameter(torch.empty(e, h), requires_grad=False)
            self.gate_up_proj_bias.weight_loader = self._load_gate_up_bias
            self.down_proj_bias.weight_loader = self._load_down_bias
        # The down projection's bias joins the partial sums once: on every rank when each holds
        # whole experts, on rank 0 when the features are sharded.
        self.adds_down_bias = expert_parallel or ctx.tp_rank == 0
        if spec.swiglu_limit is not None:
            self.act_fn: nn.Module = OaiSwiGLU(spec.swiglu_alpha, spec.swiglu_limit)
        elif activation in GATED_ACTIVATIONS:
            self.act_fn = GATED_ACTIVATIONS[activation]()
        else:
            raise ValueError(
                f"activation {activation!r} is not supported (supported: {sorted(GATED_ACTIVATIONS)})"
            )

    # ------------------------------------------------------------------ loading

    def _features(self, loaded: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's intermediate features of a full tensor along `dim`."""
        if loaded.size(dim) != self.full_inter:
            raise ValueError(
                f"expert weight of {tuple(loaded.shape)}: expected {self.full_inter} "
                f"intermediate features along dim {dim}"
            )
        return loaded.narrow(dim, self.feature_start, self.inter)

    def _stacked(self, loaded: torch.Tensor, name: str) -> torch.Tensor:
        """This rank's experts of a stacked (E, ...) tensor."""
        if loaded.dim() != 3 or loaded.size(0) != self.num_experts:
            raise ValueError(f"stacked {name} of {tuple(loaded.shape)}")
        return loaded.narrow(0, self.first_expert, self.local_experts)

    def _gate_and_up(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(E, 2I, ...) this rank's experts' gate and up rows, each (E, I, ...) of this rank's
        features: halves (Hugging Face's layout), or interleaved (gpt-oss's)."""
        full = self.full_inter
        if self.layout == "gpt_oss":
            gate, up = rows[:, 0::2], rows[:, 1::2]
        else:
            gate, up = rows.narrow(1, 0, full), rows.narrow(1, full, full)
        return self._features(gate, 1), self._features(up, 1)

    def _oriented(self, loaded: torch.Tensor, hf_shape: tuple[int, int]) -> torch.Tensor:
        """A stacked tensor in Hugging Face's (E, *hf_shape) orientation. Under the "transposed"
        layout a tensor of another shape is the released checkpoint's (E, *reversed(hf_shape))
        and is transposed; one of Hugging Face's shape (a live model's, a file transformers 5
        saved, and any square one, as Hugging Face's loader decides) is taken as it is."""
        if self.layout != "transposed" or loaded.dim() != 3 or tuple(loaded.shape[1:]) == hf_shape:
            return loaded
        return _read(loaded).transpose(1, 2)

    def _load_gate_up(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None):
        """shard_id None: the stacked (E, 2I, H) tensor (gpt-oss's and Qwen3-VL-MoE's
        checkpoints: (E, H, 2I)); ("gate" | "up", expert): one (I, H)."""
        if shard_id is None and self.layout == "gpt_oss":
            mine = self._stacked(_read(loaded), "gate_up_proj").transpose(1, 2)
            gate, up = self._gate_and_up(mine)
            copy_checked(param.data[:, : self.inter], gate)
            copy_checked(param.data[:, self.inter :], up)
            return
        if shard_id is None:
            loaded = self._oriented(loaded, (2 * self.full_inter, self.hidden_size))
            mine, full = self._stacked(loaded, "gate_up_proj"), self.full_inter
            copy_checked(param.data[:, : self.inter], self._features(mine.narrow(1, 0, full), 1))
            copy_checked(param.data[:, self.inter :], self._features(mine.narrow(1, full, full), 1))
            return
        which, expert = self._expert_shard(shard_id, ("gate", "up"))
        if expert is not None:
            offset = 0 if which == "gate" else self.inter
            dst = param.data[expert, offset : offset + self.inter]
            copy_checked(dst, self._features(loaded, 0))

    def _load_down(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None):
        """shard_id None: the stacked (E, H, I) tensor (gpt-oss's and Qwen3-VL-MoE's
        checkpoints: (E, I, H)); ("down", expert): one (H, I)."""
        if shard_id is None and self.layout == "gpt_oss":
            mine = self._stacked(_read(loaded), "down_proj").transpose(1, 2)
            copy_checked(param.data, self._features(mine, 2))
            return
        if shard_id is None:
            loaded = self._oriented(loaded, (self.hidden_size, self.full_inter))
            copy_checked(param.data, self._features(self._stacked(loaded, "down_proj"), 2))
            return
        _, expert = self._expert_shard(shard_id, ("down",))
        if expert is not None:
            copy_checked(param.data[expert], self._features(loaded, 1))

    def _load_gate_up_bias(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ):
        """The stacked (E, 2I) biases of the gate and up features."""
        if shard_id is not None or loaded.dim() != 2 or loaded.size(0) != self.num_experts:
            raise ValueError(f"gate_up_proj_bias of {tuple(loaded.shape)}, shard {shard_id!r}")
        mine = _read(loaded).narrow(0, self.first_expert, self.local_experts).unsqueeze(-1)
        gate, up = self._gate_and_up(mine)
        copy_checked(param.data[:, : self.inter], gate.squeeze(-1))
        copy_checked(param.data[:, self.inter :], up.squeeze(-1))

    def _load_down_bias(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None):
        if shard_id is not None or loaded.dim() != 2 or loaded.size(0) != self.num_experts:
            raise ValueError(f"down_proj_bias of {tuple(loaded.shape)}, shard {shard_id!r}")
        copy_checked(param.data, loaded.narrow(0, self.first_expert, self.local_experts))

    def _expert_shard(self, shard_id: object, kinds: tuple[str, ...]) -> tuple[str, int | None]:
        """(projection, this rank's index of the expert, or None when another rank holds it)."""
        if not (isinstance(shard_id, tuple) and shard_id[0] in kinds):
            raise ValueError(f"unexpected shard {shard_id!r}")
        which, expert = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} outside the model's {self.num_experts}")
        local = expert - self.first_expert
        return which, local if 0 <= local < self.local_experts else None

    # ------------------------------------------------------------------ forward

    def forward(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x (T, H), experts and weights (T, k) -> this rank's partial sums (T, H)."""
        if experts.numel() <= FEW_PAIRS:
            return self._forward_few(x, experts, weights)
        k = experts.size(1)
        flat, pair_weights = experts.flatten(), weights.flatten()
        pairs = None  # all token-expert pairs are this rank's
        if self.local_experts != self.num_experts:  # expert parallel: those of its experts
            lo = self.first_expert
            pairs = ((flat >= lo) & (flat < lo + self.local_experts)).nonzero().squeeze(1)
            flat, pair_weights = flat[pairs] - lo, pair_weights[pairs]
        order = flat.argsort(stable=True)  # the pairs grouped by expert
        token_of = (order if pairs is None else pairs[order]) // k
        counts = torch.bincount(flat, minlength=self.local_experts).tolist()
        rows = x[token_of]
        out = torch.empty_like(rows)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            span = slice(start, start + n)
            out[span] = self._expert(expert, rows[span])
            start += n
        out.mul_(pair_weights[order].unsqueeze(1))
        return torch.zeros_like(x).index_add_(0, token_of, out)

    def _forward_few(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """A decode step of a few tokens: each token through its experts in turn, in ascending
        expert order (the order the grouped path adds them in), skipping the grouping's ops; on
        the CPU in float32 with SiLU experts, in one native call (the same arithmetic)."""
        k = experts.size(1)
        pairs = [
            (t, row[j] - self.first_expert, t * k + j)
            for t, row in enumerate(experts.tolist())
            for j in sorted(range(k), key=row.__getitem__)
            if 0 <= row[j] - self.first_expert < self.local_experts
        ]
        if self._native_few(x, weights):
            tokens, local, flat = (
                torch.tensor([pair[i] for pair in pairs], dtype=torch.int64) for i in range(3)
            )
            b2 = self.down_proj_bias if self.adds_down_bias else None
            return linear_ops.f32_moe_experts(
                x, tokens, local, weights.flatten()[flat], self.gate_up_proj,
                self.gate_up_proj_bias, self.down_proj, b2,
            )  # fmt: skip
        out = torch.zeros_like(x)
        flat_weights = weights.flatten()
        for t, local, i in pairs:
            out[t : t + 1].add_(self._expert(local, x[t : t + 1]).mul_(flat_weights[i]))
        return out

    def _native_few(self, x: torch.Tensor, weights: torch.Tensor) -> bool:
        return (
            x.dtype == weights.dtype == self.gate_up_proj.dtype == torch.float32
            and isinstance(self.act_fn, SiluAndMul)
            and x.is_contiguous()
            and elementwise_ops.usable(x)
        )

    def _expert(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        """Expert `expert` (this rank's index) on rows (N, H) -> (N, H), its bias added where
        this rank adds it."""
        b13 = None if self.gate_up_proj_bias is None else self.gate_up_proj_bias[expert]
        b2 = None
        if self.down_proj_bias is not None and self.adds_down_bias:
            b2 = self.down_proj_bias[expert]
        h = self.act_fn(dense_linear(rows, self.gate_up_proj[expert], b13))
        return dense_linear(h, self.down_proj[expert], b2)


class SparseMoE(nn.Module):
    """The MLP of a mixture-of-experts layer: router, experts and (Qwen2-MoE) shared expert."""

    def __init__(
        self,
        spec: MoESpec,
        hidden_size: int,
        activation: str,
        ctx: ParallelContext,
        expert_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.ctx = ctx
        self.top_k = spec.top_k
        self.norm_topk_prob = spec.norm_topk_prob
        self.topk_then_softmax = spec.topk_then_softmax
        self.gate = ReplicatedLinear(hidden_size, spec.num_experts, bias=spec.router_bias, ctx=ctx)
        # Set by the model runner to record each step's routing (--enable-return-routed-experts).
        self.captured: list[torch.Tensor] | None = None
        self.experts = FusedExperts(spec, hidden_size, activation, ctx, expert_parallel)
        self.shared_expert = None
        if spec.shared_expert_size:
            size = spec.shared_expert_size
            self.shared_expert = nn.Module()
            self.shared_expert.gate_up_proj = MergedColumnParallelLinear(
                hidden_size, [size, size], ctx=ctx
            )
            self.shared_expert.down_proj = RowParallelLinear(size, hidden_size, ctx=ctx)
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, ctx=ctx)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, H) -> (experts (T, k) int64, weights (T, k) in x's dtype)."""
        if self.topk_then_softmax:  # gpt-oss
            logits, experts = torch.topk(self.gate(x), self.top_k, dim=-1)
            return experts, F.softmax(logits, dim=-1)
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        if self.captured is not None:
            self.captured.append(experts)
        out = self.experts(x, experts, weights)
        if self.shared_expert is not None:
            shared = self.shared_expert
            # NOTE: its down projection all-reduces; so its partial sums join after it.
            h = shared.down_proj(self.experts.act_fn(shared.gate_up_proj(x)))
            out = self.ctx.all_reduce(out)
            return out + torch.sigmoid(self.shared_expert_gate(x)) * h
        return self.ctx.all_reduce(out)

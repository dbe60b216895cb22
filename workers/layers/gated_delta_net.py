"""Gated DeltaNet, the linear-attention layer of Qwen3.5 and Qwen3-Next, over per-sequence states.

Each sequence carries two states from one engine step to the next (chunked prefill continues them):
the last `conv_kernel - 1` inputs of its causal depthwise convolution and its recurrent state, one
(key_dim, value_dim) matrix per value head, in float32. The model runner owns them as pools of
`num_slots` rows per layer (`conv_states`, `recurrent_states`) and tells the layer each scheduled
sequence's slot (AttentionMetadata.state_slots); a sequence computed from its first token starts
from zeros. For the prefix cache, the layer also copies a sequence's states as they stand a given
number of tokens into its chunk into checkpoint rows of the same pools (AttentionMetadata.
state_saves, enginecore/state_checkpoints.py): a prompt chunk is computed in pieces split there.
A sequence verifying speculative drafts (AttentionMetadata.draft_seqs) steps through its tokens
one at a time and keeps the states after each, which the model runner puts back once it knows
how many were accepted.

The maths is Hugging Face's (the oracle): in_proj_qkv -> causal conv1d -> SiLU -> q, k, v; q and k
L2-normalised, q scaled by key_dim ** -0.5; beta = sigmoid(in_proj_b); the decay g = -exp(A_log) *
softplus(in_proj_a + dt_bias); per token S = exp(g) S + k (beta (v - S^T k))^T, out = S^T q; then a
per-head RMSNorm gated by SiLU(in_proj_z) and out_proj. A prompt (or a chunk of one) runs the delta
rule chunk by chunk in the WY form (one triangular solve per 64 tokens), a decode step the
recurrence for every decoding sequence at once: on the CPU, from the input projection to the gated
norm, in one native kernel (csrc/gated_delta_net.c).

Tensor parallelism shards the key heads and their value heads evenly (each rank's value heads are
those of its key heads); out_proj is row-parallel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.distributed import ParallelContext, divide
from workers.kernels import gated_delta_ops, kernel_library
from workers.layers.attention import AttentionMetadata
from workers.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
    copy_checked,
)

CHUNK = 64


class GatedDeltaNet(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int,
        eps: float,
        ctx: ParallelContext,
        quant: str | None = None,
    ) -> None:
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"{num_v_heads} value heads do not group over {num_k_heads} key heads")
        self.ctx = ctx
        self.k_heads = divide(num_k_heads, ctx.tp_size)
        self.v_heads = divide(num_v_heads, ctx.tp_size)
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.full_sizes = (key_dim, key_dim, value_dim)
        self.local_sizes = tuple(n // ctx.tp_size for n in self.full_sizes)
        self.conv_kernel = conv_kernel
        self.in_proj_qkv = MergedColumnParallelLinear(
            hidden_size, list(self.full_sizes), ctx=ctx, quant=quant
        )
        self.in_proj_z = ColumnParallelLinear(hidden_size, value_dim, ctx=ctx, quant=quant)
        self.in_proj_b = ColumnParallelLinear(hidden_size, num_v_heads, ctx=ctx)
        self.in_proj_a = ColumnParallelLinear(hidden_size, num_v_heads, ctx=ctx)
        self.out_proj = RowParallelLinear(value_dim, hidden_size, ctx=ctx, quant=quant)
        conv_dim = sum(self.local_sizes)
        self.conv1d = nn.Module()
        self.conv1d.weight = _param((conv_dim, 1, conv_kernel), self._load_conv)
        self.dt_bias = _param((self.v_heads,), self._load_by_v_head)
        self.A_log = _param((self.v_heads,), self._load_by_v_head)
        self.norm = nn.Module()
        self.norm.weight = _param((head_v_dim,), None)
        self.eps = eps
        # Allocated with the KV cache (allocate_states): (num_slots, conv_dim, conv_kernel - 1) in
        # the activations' dtype (the model's default dtype) and (num_slots, v_heads, head_k_dim,
        # head_v_dim) float32.
        self.state_dtype = torch.get_default_dtype()
        self.conv_states = torch.empty(0)
        self.recurrent_states = torch.empty(0)
        # The last step's verifying sequences: pool row -> the states after each of its tokens.
        self.drafted_states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per-sequence shapes of (conv state, recurrent state)."""
        conv = (sum(self.local_sizes), self.conv_kernel - 1)
        return conv, (self.v_heads, self.head_k_dim, self.head_v_dim)

    def allocate_states(self, num_rows: int, num_blocks: int) -> None:
        """The state pools: `num_rows` rows, zeroed (request_state.RequestStateHolder)."""
        conv, recurrent = self.state_shapes()
        device = self.A_log.device
        self.conv_states = torch.zeros((num_rows, *conv), dtype=self.state_dtype, device=device)
        self.recurrent_states = torch.zeros(
            (num_rows, *recurrent), dtype=torch.float32, device=device
        )

    def free_states(self) -> None:
        self.conv_states = self.recurrent_states = torch.empty(0)

    def drafted(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.drafted_states.pop(row)

    def row_states(self, row: int) -> list[torch.Tensor]:
        return [self.conv_states[row], self.recurrent_states[row]]

    def copy_states(self, src: list[int], dst: list[int]) -> None:
        """States of pool rows `src` into rows `dst` (checkpoints taken and restored)."""
        to = torch.tensor(dst, device=self.recurrent_states.device)
        rows = torch.tensor(src, device=self.recurrent_states.device)
        self.conv_states[to] = self.conv_states[rows]
        self.recurrent_states[to] = self.recurrent_states[rows]

    # ------------------------------------------------------------------ loading

    def _load_conv(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        if shard_id is not None or loaded.shape[0] != sum(self.full_sizes):
            raise ValueError(
                f"conv1d weight of {tuple(loaded.shape)}, expected {sum(self.full_sizes)} rows"
            )
        rank, offset, start = self.ctx.tp_rank, 0, 0
        for full, local in zip(self.full_sizes, self.local_sizes):
            copy_checked(
                param.data[offset : offset + local], loaded.narrow(0, start + rank * local, local)
            )
            offset, start = offset + local, start + full

    def _load_by_v_head(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        if shard_id is not None:
            raise ValueError(f"unexpected shard {shard_id!r}")
        copy_checked(param.data, loaded.narrow(0, self.ctx.tp_rank * self.v_heads, self.v_heads))

    # ------------------------------------------------------------------ forward

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x (T, hidden) of the step's sequences -> (T, hidden); updates their states."""
        if self.recurrent_states.numel() == 0:
            raise RuntimeError("the recurrent states are not allocated: call allocate_states first")
        mixed = self.in_proj_qkv(x)  # (T, conv_dim)
        z = self.in_proj_z(x)
        b, a = self.in_proj_b(x), self.in_proj_a(x)  # (T, Hv)
        slots, starts, lens = meta.state_slots, meta.start_pos_list, meta.query_len_list
        self.drafted_states = {}
        drafting = set(meta.draft_seqs)
        decode_only = meta.decode is not None and meta.decode.is_whole_batch and not drafting
        if decode_only and self._uses_kernel(mixed):
            heads = (self.k_heads, self.v_heads, self.head_k_dim, self.head_v_dim)
            o = gated_delta_ops.gated_delta_decode(
                mixed, z, b, a, self.A_log, self.dt_bias, self.conv1d.weight, self.conv_states,
                self.recurrent_states, slots, meta.fresh_seqs, self.norm.weight, self.eps, heads,
            )  # fmt: skip
            self._save_chunk_ends(meta, slots)
            return self.out_proj(o)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out = torch.empty(x.size(0), self.v_heads, self.head_v_dim, dtype=x.dtype, device=x.device)
        decodes = [i for i, n in enumerate(lens) if n == 1]
        fresh = [starts[i] == 0 for i in decodes]
        if decode_only:  # every row, in order
            self._decode(mixed, beta, g, slots, fresh, out, slice(None))
        elif decodes:
            first = meta.query_start_list
            rows = torch.tensor([first[i] for i in decodes], device=x.device)
            self._decode(mixed[rows], beta[rows], g[rows], slots[decodes], fresh, out, rows)
        verified = None
        if drafting:
            verified = self._verify(sorted(drafting), (mixed, z, b, a, beta, g), meta, out)
        for i, n in enumerate(lens):
            if n != 1 and i not in drafting:
                # Checkpoints inside the chunk split it: the states are taken there.
                cuts = sorted((at, row) for seq, at, row in meta.state_saves if seq == i and at < n)
                first, slot = meta.query_start_list[i], int(slots[i])
                begin = 0
                for end, row in [*cuts, (n, -1)]:
                    span = slice(first + begin, first + end)
                    fresh = starts[i] == 0 and begin == 0
                    self._prefill(mixed[span], beta[span], g[span], slot, fresh, out, span)
                    if row >= 0:
                        self.copy_states([slot], [row])
                    begin = end
        self._save_chunk_ends(meta, slots)
        o = self._gated_norm(out, z.view(-1, self.v_heads, self.head_v_dim)).flatten(1)
        if verified is not None:  # the kernel's rows, gated and normed already
            rows, normed = verified
            o[rows] = normed
        return self.out_proj(o)

    def _save_chunk_ends(self, meta: AttentionMetadata, slots: torch.Tensor) -> None:
        """Checkpoints of the states at the end of sequences' chunks."""
        lens, drafting = meta.query_len_list, meta.draft_seqs
        ends = [
            (int(slots[seq]), row)
            for seq, at, row in meta.state_saves
            if at == lens[seq] and seq not in drafting
        ]
        if ends:
            self.copy_states([slot for slot, _ in ends], [row for _, row in ends])

    def _uses_kernel(self, mixed: torch.Tensor) -> bool:
        """Whether decode steps run tern's native kernel (a CPU with the kernels, the layer's
        tensors all in the activations' dtype)."""
        return (
            mixed.is_cpu
            and kernel_library.load() is not None
            and self.conv1d.weight.dtype == self.conv_states.dtype == mixed.dtype
            and self.norm.weight.dtype == self.A_log.dtype == self.dt_bias.dtype == mixed.dtype
        )

    def _split_heads(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(N, conv_dim) after the convolution -> q, k (N, Hv, dk) L2-normalised, float32; v. Each
        path scales q as Hugging Face's does there (a division at decode, a product in chunks)."""
        q, k, v = conv_out.split(list(self.local_sizes), dim=-1)
        group = self.v_heads // self.k_heads
        q = q.reshape(-1, self.k_heads, self.head_k_dim).repeat_interleave(group, dim=1).float()
        k = k.reshape(-1, self.k_heads, self.head_k_dim).repeat_interleave(group, dim=1).float()
        v = v.reshape(-1, self.v_heads, self.head_v_dim).float()
        return _l2norm(q), _l2norm(k), v

    def _decode(self, mixed, beta, g, slots, fresh, out, rows) -> None:
        """One token for each of G sequences: the convolution's and the recurrence's single step.
        `fresh`: Python bools, the sequences whose states start here (one-token prompts)."""
        conv_state = self.conv_states[slots]  # (G, C, K - 1)
        recurrent = self.recurrent_states[slots]  # (G, Hv, dk, dv), a copy: updated in place
        if any(fresh):
            starts = torch.tensor(fresh, device=mixed.device)
            conv_state = conv_state.masked_fill(starts[:, None, None], 0)
            recurrent.masked_fill_(starts[:, None, None, None], 0)
        window = torch.cat((conv_state, mixed.unsqueeze(-1).to(conv_state.dtype)), dim=-1)
        self.conv_states[slots] = window[..., 1:]
        # A depthwise convolution's one output per channel: its K taps times the window.
        weight = self.conv1d.weight.squeeze(1)  # (C, K)
        conv_out = (window.float() * weight.float()).sum(-1).to(window.dtype)  # (G, C)
        q, k, v = self._split_heads(F.silu(conv_out).to(mixed.dtype))
        q = q / self.head_k_dim**0.5
        recurrent.mul_(g.exp()[..., None, None])
        memory = (k.unsqueeze(-2) @ recurrent).squeeze(-2)  # (G, Hv, dv)
        delta = (v - memory) * beta.float().unsqueeze(-1)
        recurrent.add_(k.unsqueeze(-1) * delta.unsqueeze(-2))
        self.recurrent_states[slots] = recurrent
        out[rows] = (q.unsqueeze(-2) @ recurrent).squeeze(-2).to(out.dtype)

    def _verify(
        self, seqs, inputs, meta: AttentionMetadata, out
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The sequences verifying drafts (`seqs`): their tokens one recurrence step at a time, as
        decode steps are (by the native kernel where it runs: then returns (rows, their gated
        norm's output), else into `out`), keeping the states after each (`drafted_states`, by pool row) so that
        the model runner can take back the rejected drafts' (ModelRunner._take_back_drafts);
        checkpoints inside the known tokens are taken where they fall."""
        first, lens = meta.query_start_list, meta.query_len_list
        slots = meta.state_slots
        mixed, z, b, a, beta, g = inputs  # the input projections; beta and g derived from b, a
        kernel = self._uses_kernel(mixed)
        heads = (self.k_heads, self.v_heads, self.head_k_dim, self.head_v_dim)
        all_rows, normed = [], []
        kept: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {i: ([], []) for i in seqs}
        for j in range(max(lens[i] for i in seqs)):
            now = [i for i in seqs if lens[i] > j]
            rows = torch.tensor([first[i] + j for i in now], device=mixed.device)
            rows_slots = slots[now]
            fresh = [False] * len(now)  # a verifying sequence has computed its prompt
            if kernel:
                fresh_u8 = torch.zeros(len(now), dtype=torch.uint8)
                normed.append(gated_delta_ops.gated_delta_decode(
                    mixed[rows], z[rows], b[rows], a[rows], self.A_log, self.dt_bias,
                    self.conv1d.weight, self.conv_states, self.recurrent_states, rows_slots,
                    fresh_u8, self.norm.weight, self.eps, heads,
                ))  # fmt: skip
                all_rows.append(rows)
            else:
                self._decode(mixed[rows], beta[rows], g[rows], rows_slots, fresh, out, rows)
            conv, recurrent = self.conv_states[rows_slots], self.recurrent_states[rows_slots]
            for n, i in enumerate(now):
                kept[i][0].append(conv[n])
                kept[i][1].append(recurrent[n])
            for seq, at, row in meta.state_saves:
                if at == j + 1 and seq in now:
                    self.copy_states([int(slots[seq])], [row])
        self.drafted_states = {
            int(slots[i]): (torch.stack(convs), torch.stack(recurrents))
            for i, (convs, recurrents) in kept.items()
        }
        return (torch.cat(all_rows), torch.cat(normed)) if kernel else None

    def take_back(self, slot: int, states: tuple[torch.Tensor, torch.Tensor], kept: int) -> None:
        """Pool row `slot` back to its states after the first `kept` tokens of a verification
        step (`states`: that step's drafted_states[slot])."""
        self.conv_states[slot] = states[0][kept - 1]
        self.recurrent_states[slot] = states[1][kept - 1]

    def _prefill(self, mixed, beta, g, slot, fresh, out, span) -> None:
        """Several tokens of one sequence, continuing its states."""
        n = mixed.size(0)
        conv_state = self.conv_states[slot]
        if fresh:
            conv_state = torch.zeros_like(conv_state)
        window = torch.cat((conv_state, mixed.t().to(conv_state.dtype)), dim=-1)  # (C, K - 1 + n)
        self.conv_states[slot] = window[:, -(self.conv_kernel - 1) :]
        conv_out = F.conv1d(window.unsqueeze(0), self.conv1d.weight, groups=window.size(0))[0]
        q, k, v = self._split_heads(F.silu(conv_out[:, -n:]).t().to(mixed.dtype))
        state = (
            torch.zeros_like(self.recurrent_states[slot]) if fresh else self.recurrent_states[slot]
        )
        o, state = chunk_delta_rule(q * self.head_k_dim**-0.5, k, v, g, beta.float(), state)
        self.recurrent_states[slot] = state
        out[span] = o.to(out.dtype)

    def _gated_norm(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """RMSNorm per value head (Llama's form), then times SiLU(gate) in float32."""
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.norm.weight * h.to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over n tokens of one sequence in chunks of CHUNK, in float32.

    q, k (n, H, dk), v (n, H, dv), g and beta (n, H), state (H, dk, dv) -> (out (n, H, dv), state).
    Within a chunk the updates' mutual dependence is one unit lower-triangular system (the WY form);
    across chunks the state carries the rest.
    """
    n = q.size(0)
    pad = (-n) % CHUNK
    # (H, chunks, CHUNK, d): padding has beta 0 and decay 0 (factor 1), so it changes nothing.
    q, k, v = (
        F.pad(t.transpose(0, 1), (0, 0, 0, pad)).unflatten(1, (-1, CHUNK)) for t in (q, k, v)
    )
    g, beta = (F.pad(t.t(), (0, pad)).unflatten(1, (-1, CHUNK)) for t in (g, beta))
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    cum = g.cumsum(-1)  # (H, chunks, CHUNK)
    later = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(later, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(
        system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True
    )
    intra = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp().unsqueeze(-1)
    k_to_end = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty_like(values)
    for c in range(values.size(1)):
        v_new = values[:, c] - k_decayed[:, c] @ state
        out[:, c] = q_decayed[:, c] @ state + intra[:, c] @ v_new
        state = state * chunk_decay[:, c] + k_to_end[:, c].transpose(-1, -2) @ v_new
    return out.flatten(1, 2)[:, :n].transpose(0, 1), state


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _param(shape: tuple[int, ...], loader) -> nn.Parameter:
    from workers.layers.linear import default_weight_loader

    p = nn.Parameter(torch.zeros(shape), requires_grad=False)
    p.weight_loader = loader or default_weight_loader
    return p

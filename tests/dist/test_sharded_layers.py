"""Tensor-parallel layers in a real gloo world of 2 spawned processes, against unsharded torch.

Each rank builds the sharded layer, loads the *full* weights through the layer's weight loader from a
safetensors file (lazily: each rank reads its slice), runs the same input and compares with the
unsharded result computed in the rank itself: column-parallel outputs by slice (and all-gathered),
row-parallel and vocab-parallel outputs after their all-reduce / all-gather. One spawn covers every
layer, because starting a process that imports torch costs seconds here.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from gloo_world import run_world
from safetensors import safe_open
from safetensors.torch import save_file

from workers.distributed import ParallelContext, shard_heads
from workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from workers.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from workers.weight_loader import LazyWeight

WORLD = 2
HIDDEN, HEAD_DIM, TOKENS = 16, 4, 5


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    return {
        "x": rand(TOKENS, HIDDEN),
        "col.w": rand(12, HIDDEN),
        "col.b": rand(12),
        "row.w": rand(HIDDEN, 12),
        "row.b": rand(HIDDEN),
        "gate.w": rand(10, HIDDEN),
        "up.w": rand(10, HIDDEN),
        # 9 heads / 3 KV heads (uneven at tp 2), 4 / 2 (even) and 2 / 1 (KV head replicated).
        **{f"q{h}.w": rand(h * HEAD_DIM, HIDDEN) for h in (9, 4, 2)},
        **{f"q{h}.b": rand(h * HEAD_DIM) for h in (9, 4, 2)},
        **{f"kv{h}.{n}": rand(h * HEAD_DIM, HIDDEN) for h in (3, 2, 1) for n in "kv"},
        **{f"kv{h}.{n}b": rand(h * HEAD_DIM) for h in (3, 2, 1) for n in "kv"},
        "o9.w": rand(HIDDEN, 9 * HEAD_DIM),
        "embed": rand(11, HIDDEN),  # 11 rows: 6 per rank, the last one padding
        "ids": torch.tensor([0, 5, 6, 10, 3, 7]),
    }


def _gather(ctx: ParallelContext, x: torch.Tensor) -> torch.Tensor:
    return ctx.all_gather(x, dim=-1)


def _load(
    layer: torch.nn.Module, tensors: dict[str, LazyWeight], names: dict[str, tuple[str, object]]
) -> None:
    """names: checkpoint name -> (parameter name, shard id)."""
    params = dict(layer.named_parameters())
    for name, (param_name, shard_id) in names.items():
        param = params[param_name]
        param.weight_loader(param, tensors[name], shard_id)


def _check_linears(ctx: ParallelContext, w: dict[str, torch.Tensor], lazy: dict) -> None:
    x = w["x"]
    col = ColumnParallelLinear(HIDDEN, 12, bias=True, ctx=ctx)
    _load(col, lazy, {"col.w": ("weight", None), "col.b": ("bias", None)})
    full = F.linear(x, w["col.w"], w["col.b"])
    torch.testing.assert_close(col(x), full[:, ctx.tp_rank * 6 : (ctx.tp_rank + 1) * 6])
    torch.testing.assert_close(_gather(ctx, col(x)), full)

    row = RowParallelLinear(12, HIDDEN, bias=True, ctx=ctx)
    _load(row, lazy, {"row.w": ("weight", None), "row.b": ("bias", None)})
    # The row-parallel input arrives sharded, as the column-parallel output.
    torch.testing.assert_close(row(col(x)), F.linear(full, w["row.w"], w["row.b"]))

    gate_up = MergedColumnParallelLinear(HIDDEN, [10, 10], ctx=ctx)
    _load(gate_up, lazy, {"gate.w": ("weight", 0), "up.w": ("weight", 1)})
    gate, up = gate_up(x).chunk(2, dim=-1)  # this rank's slice of each projection
    part = slice(ctx.tp_rank * 5, (ctx.tp_rank + 1) * 5)
    torch.testing.assert_close(gate, F.linear(x, w["gate.w"])[:, part])
    torch.testing.assert_close(up, F.linear(x, w["up.w"])[:, part])


def _check_qkv(ctx: ParallelContext, w: dict[str, torch.Tensor], lazy: dict) -> None:
    x = w["x"]
    for heads, kv_heads in ((9, 3), (4, 2), (2, 1)):
        qkv = QKVParallelLinear(HIDDEN, HEAD_DIM, heads, kv_heads, bias=True, ctx=ctx)
        names = {f"q{heads}.w": ("weight", "q"), f"q{heads}.b": ("bias", "q")}
        for n in "kv":
            names[f"kv{kv_heads}.{n}"] = ("weight", n)
            names[f"kv{kv_heads}.{n}b"] = ("bias", n)
        _load(qkv, lazy, names)
        q, k, v = qkv(x).split([qkv.q_size, qkv.kv_size, qkv.kv_size], dim=-1)
        shard = shard_heads(heads, kv_heads, WORLD, ctx.tp_rank)
        q_rows = slice(shard.head_start * HEAD_DIM, (shard.head_start + shard.num_heads) * HEAD_DIM)
        kv_end = shard.kv_head_start + shard.num_kv_heads
        kv_rows = slice(shard.kv_head_start * HEAD_DIM, kv_end * HEAD_DIM)
        full_q = F.linear(x, w[f"q{heads}.w"], w[f"q{heads}.b"])
        torch.testing.assert_close(q, full_q[:, q_rows])
        for name, got in (("k", k), ("v", v)):
            full = F.linear(x, w[f"kv{kv_heads}.{name}"], w[f"kv{kv_heads}.{name}b"])
            torch.testing.assert_close(got, full[:, kv_rows])
        # Each query head still sees the KV head it is grouped with.
        group = heads // kv_heads
        assert all(
            (shard.head_start + h) // group
            == shard.kv_head_start + h // (shard.num_heads // shard.num_kv_heads)
            for h in range(shard.num_heads)
        )
        if heads == 9:
            assert (shard.num_heads, shard.num_kv_heads) == ((6, 2), (3, 1))[ctx.tp_rank]
            # o_proj after uneven heads: the ranks' partial products still sum to the full one.
            o = RowParallelLinear(
                9 * HEAD_DIM,
                HIDDEN,
                ctx=ctx,
                input_shard=(shard.head_start * HEAD_DIM, shard.num_heads * HEAD_DIM),
            )
            _load(o, lazy, {"o9.w": ("weight", None)})
            torch.testing.assert_close(o(q), F.linear(full_q, w["o9.w"]))


def _check_vocab(ctx: ParallelContext, w: dict[str, torch.Tensor], lazy: dict) -> None:
    embed = VocabParallelEmbedding(11, HIDDEN, ctx=ctx)
    _load(embed, lazy, {"embed": ("weight", None)})
    torch.testing.assert_close(embed(w["ids"]), F.embedding(w["ids"], w["embed"]))
    head = ParallelLMHead(11, HIDDEN, ctx=ctx)
    _load(head, lazy, {"embed": ("weight", None)})
    torch.testing.assert_close(head(w["x"]), F.linear(w["x"], w["embed"]))


def _rank_main(rank: int, path: str) -> None:
    ctx = ParallelContext(tp_rank=rank, tp_size=WORLD, tp_group=dist.group.WORLD)
    w = _weights()
    with safe_open(path, framework="pt") as f:
        lazy = {name: LazyWeight(f.get_slice(name)) for name in f.keys()}  # noqa: SIM118
        with torch.no_grad():
            _check_linears(ctx, w, lazy)
            _check_qkv(ctx, w, lazy)
            _check_vocab(ctx, w, lazy)


def test_sharded_layers_match_unsharded_in_a_gloo_world_of_2(tmp_path: Path) -> None:
    path = tmp_path / "weights.safetensors"
    save_file(_weights(), str(path))
    # A failed assertion in a rank re-raises here with its traceback.
    run_world(_rank_main, str(path), world_size=WORLD)


class _SpySlice:
    """A safetensors slice that records which part of the tensor was read."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.reads = tensor, []

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: object) -> torch.Tensor:
        self.reads.append(index)
        return self.tensor[index]


def test_a_rank_reads_only_its_shard_from_the_checkpoint() -> None:
    ctx = ParallelContext(tp_rank=1, tp_size=2, tp_group=object())  # loading needs no collective
    row = RowParallelLinear(12, HIDDEN, ctx=ctx)
    spy = _SpySlice(torch.randn(HIDDEN, 12))
    row.weight.weight_loader(row.weight, LazyWeight(spy), None)
    assert spy.reads == [(slice(None), slice(6, 12))]
    assert torch.equal(row.weight, spy.tensor[:, 6:])
    embed = VocabParallelEmbedding(11, HIDDEN, ctx=ctx)
    spy = _SpySlice(torch.randn(11, HIDDEN))
    embed.weight.weight_loader(embed.weight, LazyWeight(spy), None)
    assert spy.reads == [(slice(6, 11),)]

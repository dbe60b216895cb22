"""Int8 tensor-parallel layers in a gloo world of 2 against the float32 product of the full weights.

Each rank loads the full float32 weights through the layers' loaders (each keeps and quantizes its
shard: row-parallel shards get their own per-row scales), runs the same input, and after the layers'
collectives the result must be within int8 rounding of the unsharded float32 one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from gloo_world import run_world

from workers.distributed import ParallelContext
from workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from workers.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)

WORLD = 2
HIDDEN = 32


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _check(ctx: ParallelContext) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, HIDDEN, generator=g)
    w = {
        n: torch.randn(*shape, generator=g)
        for n, shape in [
            ("gate", (24, HIDDEN)),
            ("up", (24, HIDDEN)),
            ("down", (HIDDEN, 24)),
            ("q", (36, HIDDEN)),  # 9 heads of 4 / 3 KV heads: 6 + 3 heads at tp 2
            ("k", (12, HIDDEN)),
            ("v", (12, HIDDEN)),
            ("o", (HIDDEN, 36)),
            ("embed", (11, HIDDEN)),
        ]
    }
    gate_up = MergedColumnParallelLinear(HIDDEN, [24, 24], ctx=ctx, quant="int8")
    gate_up.weight.weight_loader(gate_up.weight, w["gate"], 0)
    gate_up.weight.weight_loader(gate_up.weight, w["up"], 1)
    gate, up = gate_up(x).chunk(2, dim=-1)
    h = F.silu(gate) * up  # this rank's slice of the intermediate features
    down = RowParallelLinear(24, HIDDEN, ctx=ctx, quant="int8")
    down.weight.weight_loader(down.weight, w["down"])
    full_h = F.silu(F.linear(x, w["gate"])) * F.linear(x, w["up"])
    assert _rel_err(down(h), F.linear(full_h, w["down"])) < 0.03

    qkv = QKVParallelLinear(HIDDEN, 4, 9, 3, ctx=ctx, quant="int8")
    for shard in "qkv":
        qkv.weight.weight_loader(qkv.weight, w[shard], shard)
    q, _, _ = qkv(x).split([qkv.q_size, qkv.kv_size, qkv.kv_size], dim=-1)
    o = RowParallelLinear(
        36, HIDDEN, ctx=ctx, quant="int8", input_shard=(qkv.head_start * 4, qkv.num_heads * 4)
    )
    o.weight.weight_loader(o.weight, w["o"])
    assert _rel_err(o(q), F.linear(F.linear(x, w["q"]), w["o"])) < 0.03

    col = ColumnParallelLinear(HIDDEN, 24, ctx=ctx, quant="int8")
    col.weight.weight_loader(col.weight, w["gate"])
    assert _rel_err(ctx.all_gather(col(x), dim=-1), F.linear(x, w["gate"])) < 0.02

    embed = VocabParallelEmbedding(11, HIDDEN, ctx=ctx, quant="int8")
    embed.weight.weight_loader(embed.weight, w["embed"])
    ids = torch.tensor([0, 5, 6, 10])
    assert _rel_err(embed(ids), w["embed"][ids]) < 0.02
    head = ParallelLMHead(11, HIDDEN, ctx=ctx, quant="int8")
    head.tie_to(embed)
    assert _rel_err(head(x), F.linear(x, w["embed"])) < 0.02


def _rank_main(rank: int) -> None:
    ctx = ParallelContext(tp_rank=rank, tp_size=WORLD, tp_group=dist.group.WORLD)
    with torch.no_grad():
        _check(ctx)


def test_int8_layers_match_float32_in_a_gloo_world_of_2() -> None:
    run_world(_rank_main, world_size=WORLD)

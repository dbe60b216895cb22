"""Weight loading: name mapping, tensor-parallel shards taken by construction, and clear errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from workers.distributed import ParallelContext
from workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from workers.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from workers.models.args import load_model_args
from workers.models.registry import build_model
from workers.weight_loader import iter_safetensors, load_checkpoint, load_weights


def _model(model_dir: Path) -> torch.nn.Module:
    return build_model(load_model_args(model_dir), ParallelContext.single())


def _copy_with(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_full_load_matches_checkpoint(tiny_qwen2: Path) -> None:
    model = _model(tiny_qwen2)
    load_checkpoint(model, tiny_qwen2)
    hf = dict(iter_safetensors(tiny_qwen2))
    attn = model.model.layers[1].self_attn
    q, k, v = (hf[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    assert torch.equal(attn.qkv_proj.weight, torch.cat([q, k, v]))
    qb, kb, vb = (hf[f"model.layers.1.self_attn.{n}_proj.bias"] for n in "qkv")
    assert torch.equal(attn.qkv_proj.bias, torch.cat([qb, kb, vb]))
    mlp = model.model.layers[0].mlp
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([gate, up]))
    assert torch.equal(model.lm_head.weight, hf["lm_head.weight"])  # untied


def test_tied_embeddings_share_one_tensor(tiny_llama: Path) -> None:
    model = _model(tiny_llama)
    load_checkpoint(model, tiny_llama)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # An explicit lm_head in a tied checkpoint is ignored rather than overwriting the embedding.
    before = model.model.embed_tokens.weight.clone()
    load_weights(model, [("lm_head.weight", torch.zeros_like(before))])
    assert torch.equal(model.model.embed_tokens.weight, before)


def test_weight_update_through_the_same_loop(tiny_qwen3: Path) -> None:
    model = _model(tiny_qwen3)
    load_checkpoint(model, tiny_qwen3)
    new_k = torch.randn_like(
        dict(iter_safetensors(tiny_qwen3))["model.layers.2.self_attn.k_proj.weight"]
    )
    loaded = load_weights(model, [("model.layers.2.self_attn.k_proj.weight", new_k)])
    assert loaded == {"model.layers.2.self_attn.k_proj.weight"}
    qkv = model.model.layers[2].self_attn.qkv_proj
    assert torch.equal(qkv.weight[qkv.q_size : qkv.q_size + qkv.kv_size], new_k)


def test_errors_are_clear(tiny_qwen2: Path, tmp_path: Path) -> None:
    model = _model(tiny_qwen2)
    with pytest.raises(ValueError, match="matches no parameter"):
        load_weights(model, [("model.layers.0.self_attn.w_proj.weight", torch.zeros(4, 4))])
    with pytest.raises(ValueError, match="shape mismatch"):
        load_weights(model, [("model.norm.weight", torch.zeros(65))])
    with pytest.raises(ValueError, match="shape mismatch"):
        load_weights(model, [("model.layers.0.mlp.up_proj.weight", torch.zeros(128, 63))])
    missing = _copy_with(
        tiny_qwen2, tmp_path / "missing", lambda t: t.pop("model.layers.1.mlp.up_proj.weight")
    )
    with pytest.raises(ValueError, match="lacks weights.*layers.1.mlp.up_proj"):
        load_checkpoint(_model(missing), missing)
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_checkpoint(model, tmp_path)


def test_tensor_parallel_shards_by_construction() -> None:
    """Rank 1 of 2 takes its rows (column-parallel) or columns (row-parallel) of each tensor."""
    ctx = ParallelContext(tp_rank=1, tp_size=2, tp_group=object())  # loading needs no collective
    hidden, head_dim, heads, kv_heads = 8, 2, 4, 2
    qkv = QKVParallelLinear(hidden, head_dim, heads, kv_heads, bias=True, ctx=ctx)
    q = torch.randn(heads * head_dim, hidden)
    k, v = torch.randn(kv_heads * head_dim, hidden), torch.randn(kv_heads * head_dim, hidden)
    for shard, w in zip("qkv", (q, k, v)):
        qkv.weight.weight_loader(qkv.weight, w, shard)
    assert torch.equal(qkv.weight, torch.cat([q[4:], k[2:], v[2:]]))

    # Fewer KV heads than ranks: each rank keeps the KV head its query heads use.
    ctx4 = ParallelContext(tp_rank=3, tp_size=4, tp_group=object())
    qkv4 = QKVParallelLinear(hidden, head_dim, heads, kv_heads, ctx=ctx4)
    for shard, w in zip("qkv", (q, k, v)):
        qkv4.weight.weight_loader(qkv4.weight, w, shard)
    assert torch.equal(qkv4.weight, torch.cat([q[6:], k[2:], v[2:]]))

    gate_up = MergedColumnParallelLinear(hidden, [6, 6], ctx=ctx)
    gate, up = torch.randn(6, hidden), torch.randn(6, hidden)
    gate_up.weight.weight_loader(gate_up.weight, gate, 0)
    gate_up.weight.weight_loader(gate_up.weight, up, 1)
    assert torch.equal(gate_up.weight, torch.cat([gate[3:], up[3:]]))

    down = RowParallelLinear(6, hidden, bias=True, ctx=ctx)
    w, b = torch.randn(hidden, 6), torch.randn(hidden)
    down.weight.weight_loader(down.weight, w)
    down.bias.weight_loader(down.bias, b)
    assert torch.equal(down.weight, w[:, 3:]) and torch.equal(down.bias, b)

    emb = VocabParallelEmbedding(11, 4, ctx=ctx)  # 6 rows per rank, the last one padding
    table = torch.randn(11, 4)
    emb.weight.weight_loader(emb.weight, table)
    assert torch.equal(emb.weight[:5], table[6:]) and not emb.weight[5].any()
    head = ParallelLMHead(11, 4, ctx=ctx)
    with pytest.raises(ValueError, match="shape mismatch"):
        head.weight.weight_loader(head.weight, torch.randn(12, 4))

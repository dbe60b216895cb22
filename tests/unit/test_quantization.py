"""Weight-only int8: quantization, the matmul backends, the layers' loaders, and a whole tiny model.

Layers load full-precision weights through the same weight loaders as unquantized ones; their outputs
must be close to float32's (int8 with per-row scales: about 1% relative error). The packed storage
must survive what the worker does to parameters generically (snapshot and rollback, sleep and wake
followed by a reload). The tiny model's greedy tokens are compared with float32 by teacher-forced
top-1 agreement.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from enginecore.config import CacheConfig, Config, ModelConfig
from workers.distributed import ParallelContext
from workers.kernels import kernel_library, linear_ops
from workers.kernels.kernel_library import runnable_tiers, use_tier
from workers.layers.attention import build_attention_metadata
from workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from workers.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from workers.quant import quantization
from workers.runner.model_runner import ModelRunner

CTX = ParallelContext.single()
# The native backend once per kernel tier this CPU runs ("native-avx2", ...).
BACKENDS = ["dequant", "torch"] + (
    [f"native-{t.name}" for t in runnable_tiers()] if kernel_library.load() is not None else []
)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_quantize_rows_round_trip() -> None:
    w = torch.randn(37, 50)
    w[3] = 0.0  # an all-zero row stays zero
    q, scale = quantization.quantize_rows(w)
    assert q.dtype == torch.int8 and scale.shape == (37,)
    assert int(q.abs().max()) == 127
    deq = q.float() * scale[:, None]
    assert torch.equal(deq[3], torch.zeros(50))
    # Rounding error is at most half a step of each row's scale.
    assert bool(((deq - w).abs() <= scale[:, None] / 2 + 1e-7).all())


def test_packed_storage_holds_weight_and_scales() -> None:
    rows, cols = 10, 7  # 40 bytes of scales need 6 rows of 7
    packed = torch.zeros(quantization.packed_shape(rows, cols), dtype=torch.int8)
    assert packed.shape == (16, 7)
    src = torch.randn(rows, cols)
    quantization.store_rows(packed, rows, 0, src[:4])
    quantization.store_rows(packed, rows, 4, src[4:])
    weight, scale = quantization.unpack(packed, rows)
    q, s = quantization.quantize_rows(src)
    assert torch.equal(weight, q) and torch.equal(scale, s)
    with pytest.raises(ValueError, match="mismatch"):
        quantization.store_rows(packed, rows, 8, src[:4])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_rows", [1, 3, 5, 33, 70, 300])  # 300: dequantize + GEMM
def test_int8_matmul_backends(backend: str, num_rows: int) -> None:
    g = torch.Generator().manual_seed(num_rows)
    w = torch.randn(45, 72, generator=g)
    bias = torch.randn(45, generator=g)
    x = torch.randn(num_rows, 72, generator=g)
    q, scale = quantization.quantize_rows(w)
    expected = F.linear(x, q.float() * scale[:, None], bias)  # exact product with the int8 weight
    backend, _, tier = backend.partition("-")
    with use_tier(tier or "off"):
        y = quantization.int8_matmul(x, q, scale, bias, backend)
        y3 = quantization.int8_matmul(x.view(1, num_rows, 72), q, scale, None, backend)
    if backend == "native" and num_rows < 4:
        # few rows: x quantized to int16 per row (csrc/linear_int8.c), within half a step of
        # max|x| / 32767 per value, exact integer products after that
        step = x.abs().amax(1, keepdim=True) / 32767
        bound = 0.5 * step * (q.float().abs() * scale[:, None]).sum(1) + 1e-5 * expected.abs()
        assert ((y - expected).abs() <= bound + 1e-6).all()
        assert ((y3.view(num_rows, 45) - (expected - bias)).abs() <= bound + 1e-6).all()
    else:
        torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(y3.view(num_rows, 45), expected - bias, atol=1e-4, rtol=1e-4)
    assert _rel_err(y, F.linear(x, w, bias)) < 0.02


@pytest.mark.parametrize("num_rows", [1, 3, 9])
def test_int8_matmul_in_bfloat16(num_rows: int) -> None:
    w, x = torch.randn(16, 40), torch.randn(num_rows, 40).bfloat16()
    bias = torch.randn(16).bfloat16()
    q, scale = quantization.quantize_rows(w)
    for backend in ["dequant", "torch"] + (["native"] if kernel_library.load() is not None else []):
        for b in (None, bias):
            y = quantization.int8_matmul(x, q, scale, b, backend)
            assert y.dtype == torch.bfloat16
            ref = F.linear(x.float(), w, None if b is None else b.float())
            assert _rel_err(y.float(), ref) < 0.03


@pytest.mark.skipif(linear_ops.bf16_amx_max_rows() == 0, reason="no AMX")
@pytest.mark.parametrize("num_rows", [3, 17, 32])
def test_int8_bfloat16_rows_on_amx(num_rows: int) -> None:
    """3-32 bfloat16 rows against shapes AMX takes (K % 32, N % 16): the int8 tiles are widened
    on the way in and the scales applied to the sums."""
    g = torch.Generator().manual_seed(num_rows)
    w, x = torch.randn(48, 96, generator=g), torch.randn(num_rows, 96, generator=g).bfloat16()
    bias = torch.randn(48, generator=g).bfloat16()
    q, scale = quantization.quantize_rows(w)
    y = linear_ops.int8_linear(x, q, scale, bias)
    ref = F.linear(x.float(), q.float() * scale[:, None], bias.float())  # the int8 weight, exactly
    torch.testing.assert_close(y.float(), ref, atol=0.05, rtol=0.01)  # bfloat16 output rounding


def test_quantized_layers_load_through_their_weight_loaders() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, generator=g)
    w = {n: torch.randn(*s, generator=g) for n, s in [("col", (24, 32)), ("gate", (20, 32)),
         ("up", (20, 32)), ("q", (32, 32)), ("k", (16, 32)), ("v", (16, 32)), ("row", (32, 24))]}  # fmt: skip
    col = ColumnParallelLinear(32, 24, bias=True, ctx=CTX, quant="int8")
    col.weight.weight_loader(col.weight, w["col"])
    col.bias.weight_loader(col.bias, torch.ones(24))
    assert col.weight.dtype == torch.int8
    assert _rel_err(col(x), F.linear(x, w["col"], torch.ones(24))) < 0.02

    merged = MergedColumnParallelLinear(32, [20, 20], ctx=CTX, quant="int8")
    merged.weight.weight_loader(merged.weight, w["up"], 1)  # shards may come in any order
    merged.weight.weight_loader(merged.weight, w["gate"], 0)
    expected = F.linear(x, torch.cat((w["gate"], w["up"])))
    assert _rel_err(merged(x), expected) < 0.02

    qkv = QKVParallelLinear(32, 8, 4, 2, ctx=CTX, quant="int8")
    for shard in "qkv":
        qkv.weight.weight_loader(qkv.weight, w[shard], shard)
    expected = F.linear(x, torch.cat((w["q"], w["k"], w["v"])))
    assert _rel_err(qkv(x), expected) < 0.02

    row = RowParallelLinear(24, 32, ctx=CTX, quant="int8")
    row.weight.weight_loader(row.weight, w["row"])
    assert _rel_err(row(x[:, :24]), F.linear(x[:, :24], w["row"])) < 0.02
    with pytest.raises(ValueError, match="mismatch"):
        row.weight.weight_loader(row.weight, w["col"])


def test_quantized_embedding_and_tied_lm_head() -> None:
    table = torch.randn(50, 16)
    embed = VocabParallelEmbedding(50, 16, ctx=CTX, quant="int8")
    embed.weight.weight_loader(embed.weight, table)
    ids = torch.tensor([0, 7, 49, 7])
    assert _rel_err(embed(ids), table[ids]) < 0.02
    head = ParallelLMHead(50, 16, ctx=CTX, quant="int8")
    head.tie_to(embed)
    h = torch.randn(3, 16)
    logits = head(h)
    assert logits.shape == (3, 50)
    assert _rel_err(logits, h @ table.T) < 0.02


def test_snapshot_rollback_and_sleep_keep_weight_and_scales_together() -> None:
    """What worker_control does to every parameter: copy out and back, and empty then refill."""
    w1, w2, x = torch.randn(12, 16), 3 * torch.randn(12, 16), torch.randn(2, 16)
    layer = ColumnParallelLinear(16, 12, ctx=CTX, quant="int8")
    layer.weight.weight_loader(layer.weight, w1)
    before = layer(x)
    snapshot = {n: p.detach().clone() for n, p in layer.named_parameters()}
    layer.weight.weight_loader(layer.weight, w2)  # an update ...
    assert _rel_err(layer(x), F.linear(x, w2)) < 0.02
    with torch.no_grad():  # ... rolled back
        for n, p in layer.named_parameters():
            p.copy_(snapshot[n])
    assert torch.equal(layer(x), before)
    shape = layer.weight.shape  # sleep level 2, wake up, then the weights come again
    layer.weight.data = torch.empty(0, dtype=torch.int8)
    layer.weight.data = torch.zeros(shape, dtype=torch.int8)
    layer.weight.weight_loader(layer.weight, w2)
    assert _rel_err(layer(x), F.linear(x, w2)) < 0.02


def _runner(model_dir, quantization_name: str | None) -> ModelRunner:
    config = Config(
        model=ModelConfig(path=str(model_dir), dtype="float32", quantization=quantization_name),
        cache=CacheConfig(block_size=8, num_gpu_blocks_override=64),
    )
    runner = ModelRunner(config)
    runner.load_model()
    runner.init_kv_cache(runner.num_kv_blocks_for_memory())
    return runner


@torch.inference_mode()
def _argmax_per_position(runner: ModelRunner, seq: list[int]) -> torch.Tensor:
    meta = build_attention_metadata([0], [len(seq)], [list(range(-(-len(seq) // 8)))], 8,
                                    runner.device)  # fmt: skip
    hidden = runner.model(torch.tensor(seq), meta)
    return runner.model.compute_logits(hidden).argmax(dim=-1)


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
def test_tiny_model_top1_agreement_with_float32(arch: str, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(arch)
    fp32, int8 = _runner(model_dir, None), _runner(model_dir, "int8")
    params = {n: p for n, p in int8.model.named_parameters()}
    assert params["model.layers.0.mlp.down_proj.weight"].dtype == torch.int8
    assert params["model.embed_tokens.weight"].dtype == torch.int8
    g = torch.Generator().manual_seed(0)
    agree = total = 0
    for _ in range(4):
        seq = torch.randint(3, fp32.vocab_size, (48,), generator=g).tolist()
        ref = _argmax_per_position(fp32, seq)
        agree += int((_argmax_per_position(int8, seq) == ref).sum())
        total += ref.numel()
    print(f"{arch}: int8 top-1 agreement with float32 {agree / total:.3f}")
    assert agree / total >= 0.75  # about 0.87 here: random weights make near-ties common


def test_every_weight_update_path_on_an_int8_engine(tiny_llama, tiny_llama_perturbed) -> None:
    """Updates from disk and from tensors, a failed update rolled back, and sleep level 2 then a
    reload: each leaves the engine generating what an int8 engine started on those weights does."""
    from safetensors.torch import load_file, save

    from enginecore.config import SchedulerConfig
    from enginecore.control import EngineControl
    from enginecore.core import EngineCore
    from enginecore.executor import InProcExecutor
    from enginecore.messages import (
        ReleaseMemory,
        ResumeMemory,
        UpdateWeights,
        UpdateWeightsFromDisk,
        UpdateWeightsFromTensors,
    )
    from tests.unit.test_engine_inproc import make_prompts, vocab_of
    from tests.unit.test_weight_control import call, greedy

    def control_on(model_dir) -> EngineControl:
        config = Config(
            model=ModelConfig(path=str(model_dir), dtype="float32", quantization="int8"),
            cache=CacheConfig(block_size=8, num_gpu_blocks_override=128),
            scheduler=SchedulerConfig(),
        )
        return EngineControl(EngineCore(config, InProcExecutor(config)))

    prompts = make_prompts(vocab_of(tiny_llama), n=3)
    original = greedy(control_on(tiny_llama), prompts, "x")[0]
    perturbed = greedy(control_on(tiny_llama_perturbed), prompts, "y")[0]
    assert original != perturbed

    control = control_on(tiny_llama)
    call(control, UpdateWeights(UpdateWeightsFromDisk(str(tiny_llama_perturbed))))
    assert greedy(control, prompts, "a")[0] == perturbed
    original_blob = save(load_file(next(tiny_llama.glob("*.safetensors"))))
    call(control, UpdateWeights(UpdateWeightsFromTensors(blobs=[original_blob])))
    assert greedy(control, prompts, "b")[0] == original

    tensors = load_file(next(tiny_llama_perturbed.glob("*.safetensors")))
    tensors["model.layers.0.mlp.down_proj.weight"] = tensors["model.layers.0.mlp.down_proj.weight"][
        :, :-1
    ].contiguous()  # wrong shape: the tensors sorted before it (the int8 embedding) roll back
    with pytest.raises(ValueError):
        call(
            control,
            UpdateWeights(UpdateWeightsFromTensors(blobs=[save(dict(sorted(tensors.items())))])),
        )
    assert greedy(control, prompts, "c")[0] == original

    call(control, ReleaseMemory(level=2))
    call(control, ResumeMemory(tags=["weights"]))
    call(control, UpdateWeights(UpdateWeightsFromDisk(str(tiny_llama))))
    call(control, ResumeMemory(tags=["kv_cache"]))
    assert greedy(control, prompts, "d")[0] == original

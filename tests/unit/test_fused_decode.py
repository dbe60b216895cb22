"""The fused decoder layer of small decode steps (csrc/decode_layer.c) against the module-by-module
path: the same logprobs bit for bit, on every kernel tier this CPU runs, for `--dtype bfloat16`
(bfloat16 activations on AVX512-BF16 tiers; float32 activations with bfloat16-stored weights on the
others) and `--dtype float32`, unquantized and int8, with an int8 KV cache too, Llama, Qwen2 (q/k/v bias), Qwen3 (per-head q/k
norms), Mistral (a sliding window shorter than the prompts), GLM-4 (sandwich norms, interleaved
partial rotation), Phi-3 (partial rotation), SmolLM3 (NoPE layers), OLMo 2 (post norms only, q/k norms over the projection)
Gemma 2 / 3 (GELU, softcapping, 1 + weight norms; these norms multiply in float32: fused under
float32 activations), Granite (residual multipliers) and Qwen3.5's attention (output gates, beside
its Gated DeltaNet layers), Qwen3-MoE (attention fused before the experts, beside a dense
layer), gpt-oss (attention sinks), decode steps of
one to five sequences (the few-row kernels, and AMX where the CPU has it), after prompts and
chunked prefills; and with LoRA adapters on every linear (tokens on different adapters or none),
unquantized, int8 and GGUF row segments; and GGUF blocks on the fast path (legacy types and
K-quants in row segments, read from their repacked rows; on the best tier)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from enginecore.config import CacheConfig, Config, ModelConfig
from enginecore.messages import SamplingParams
from tests.unit.test_gguf import gguf_case_files
from tests.unit.test_model_runner import make_prompts, run
from workers.kernels import kernel_library, linear_ops
from workers.kernels.fused_decode import FusedDecodeLayer, FusedDecodeStack
from workers.kernels.kernel_library import runnable_tiers
from workers.layers.linear import LinearBase
from workers.layers.lora import LoraBatch, LoraStack
from workers.runner.model_runner import ModelRunner

# Every test runs once per kernel tier this CPU runs.
pytestmark = [
    pytest.mark.skipif(kernel_library.load() is None, reason="no C compiler"),
    pytest.mark.usefixtures("kernel_tier"),
]


def _runner(
    model_dir: Path, quantization: str | None, dtype: str, kv_cache_dtype: str = "auto"
) -> ModelRunner:
    config = Config(
        model=ModelConfig(path=str(model_dir), dtype=dtype, quantization=quantization),
        cache=CacheConfig(block_size=4, num_gpu_blocks_override=256, kv_cache_dtype=kv_cache_dtype),
    )
    runner = ModelRunner(config)
    runner.load_model()
    runner.init_kv_cache(256)
    return runner


FAMILIES = ("tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_mistral", "tiny_glm4", "tiny_phi3",
            "tiny_smollm3", "tiny_olmo2", "tiny_gemma2", "tiny_gemma3", "tiny_granite",
            "tiny_qwen3_5", "tiny_qwen3_moe", "tiny_gpt_oss")  # fmt: skip
# int8 linears and bfloat16 storage are the same kernels in every family: the first families
# cover them, the others (their norms, rotations, gates) run in float32.
CASES = (
    [
        (arch, quantization, dtype, "auto")
        for i, arch in enumerate(FAMILIES)
        for quantization in ((None, "int8") if i < 3 else (None,))
        for dtype in (("bfloat16", "float32") if i < 4 else ("float32",))
    ]
    + [  # the int8 KV cache: the new rows quantized in the native call as kv_int8.py rounds them
        ("tiny_llama", None, "float32", "int8"),
        ("tiny_qwen3", None, "bfloat16", "int8"),
        ("tiny_gpt_oss", None, "float32", "int8"),
    ]
    + [  # GGUF blocks on the fast path: the rows repacked for decode products (legacy and K-quants)
        ("gguf_legacy", None, "auto", "auto"),
        ("gguf_segmented", None, "auto", "auto"),
    ]
)


class FusedCalls(list):
    """Rows of each fused call (None: declined); `stacked`: those of whole stacks of layers."""

    stacked: list[int | None]


def count_fused_calls(monkeypatch: pytest.MonkeyPatch) -> FusedCalls:
    """Each fused layer (or stack of layers) call from now on: its rows when it ran fused, None
    when it declined."""
    calls = FusedCalls()
    calls.stacked = []
    for cls in (FusedDecodeLayer, FusedDecodeStack):
        original = cls.__call__

        def counting(self, x, residual, meta, original=original, cls=cls):
            out = original(self, x, residual, meta)
            calls.append(None if out is None else x.size(0))
            if cls is FusedDecodeStack:
                calls.stacked.append(calls[-1])
            return out

        monkeypatch.setattr(cls, "__call__", counting)
    return calls


def unfuse(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer from now on runs module by module."""
    monkeypatch.setattr(FusedDecodeLayer, "prepare", lambda self, x, meta, residual: None)


@pytest.mark.parametrize(("arch", "quantization", "dtype", "kv_cache_dtype"), CASES)
def test_fused_layer_is_bit_identical_to_the_modules(
    arch: str,
    quantization: str | None,
    dtype: str,
    kv_cache_dtype: str,
    request: pytest.FixtureRequest,
    monkeypatch,
) -> None:
    tier = request.getfixturevalue("kernel_tier")
    if arch.startswith("gguf") and tier != runnable_tiers()[-1].name:
        pytest.skip("GGUF fast path: this CPU's best tier (every tier's products: test_gguf.py)")
    model_dir = request.getfixturevalue(arch)

    def make_runner() -> ModelRunner:
        return _runner(model_dir, quantization, dtype, kv_cache_dtype)

    runner = make_runner()  # loads take most of a case's time: this one also runs fused
    report = runner.kernel_report()
    if "float32 under torch.bfloat16 activations" in report:  # OLMo 2, Gemma, Qwen3.5
        pytest.skip("norms that multiply in float32 are fused under float32 activations only")
    prompts = make_prompts(1000)[:5]
    params = SamplingParams(temperature=0.0, seed=1, max_tokens=16)
    # Staggered arrivals, later prompts prefilled in chunks beside the running decodes: decode-only
    # steps of one to five sequences as requests join and finish.
    arrivals = (0, 0, 2, 9, 20)

    fused_calls = count_fused_calls(monkeypatch)
    fused = run(runner, prompts, params, arrival_steps=arrivals, chunk_size=5)
    sizes = set(fused_calls) - {None}
    assert {1, 2} <= sizes, "decode steps of one and two sequences took the fused path"
    if runner.dtype != torch.bfloat16 or linear_ops.bf16_amx_max_rows() >= 3:
        assert max(sizes) >= 3, "and larger ones (float32, or AMX)"
    assert None in fused_calls  # prefill steps did not
    assert "fused decode layer: on" in report

    if arch == "tiny_llama" and kv_cache_dtype == "auto":  # and layer by layer, not stacked
        assert {1, 2} <= set(fused_calls.stacked), "a dense model's layers ran as one stack"
        monkeypatch.setattr(FusedDecodeStack, "__call__", lambda self, x, residual, meta: None)
        start = len(fused_calls)
        by_layer = run(make_runner(), prompts, params, arrival_steps=arrivals, chunk_size=5)
        assert {1, 2} <= set(fused_calls[start:])
        for req_id, r in by_layer.items():
            assert fused[req_id].output == r.output
            for a, b in zip(fused[req_id].logprobs, r.logprobs):
                assert torch.equal(a, b)
    unfuse(monkeypatch)
    unfused = run(make_runner(), prompts, params, arrival_steps=arrivals, chunk_size=5)
    for req_id, r in unfused.items():
        assert fused[req_id].output == r.output
        for a, b in zip(fused[req_id].logprobs, r.logprobs):
            assert torch.equal(a, b)


def test_layers_outside_the_fused_path_say_so(tiny_gemma3) -> None:
    """Gemma's norms multiply in float32: under bfloat16 activations its layers keep the module
    path (under float32 ones they are fused), and the start-up report says why."""
    for dtype in ("bfloat16", "float32"):
        config = Config(
            model=ModelConfig(path=str(tiny_gemma3), dtype=dtype),
            cache=CacheConfig(block_size=4, num_gpu_blocks_override=64),
        )
        runner = ModelRunner(config)
        runner.load_model()
        runner.init_kv_cache(64)
        reason = runner.model.model.layers[0].fused_decode.off_reason()
        if runner.dtype == torch.float32:
            assert reason is None and "fused decode layer: on" in runner.kernel_report()
            continue
        assert reason is not None and "multiply in float32" in reason
        assert f"fused decode layer: off, reason: {reason}" in runner.kernel_report()


def _serve_lora(runner: ModelRunner, seed: int = 0) -> list[LinearBase]:
    """Every linear of every fused layer serves three random adapters of rank 8 (LoraStack),
    and each step's tokens take slots 0, -1 (none), 2, 1, 0, ... in batch order. Returns the
    linears."""
    batch = LoraBatch()
    linears = []
    g = torch.Generator().manual_seed(seed)
    for layer in runner.model.model.layers:
        if layer.fused_decode is None:
            continue
        spec = layer.fused_decode.spec
        for lin in (spec.qkv, spec.o, spec.gate_up, spec.down):
            if lin is None:
                continue
            linears.append(lin)
            lin.lora = LoraStack(batch, 3, 8, lin.input_size, lin.shard_rows())
            for slot in range(3):
                for i, rows in enumerate(lin.shard_rows()):
                    a = torch.randn(8, lin.input_size, generator=g) * 0.05
                    lin.lora.set_segment(slot, i, a, torch.randn(rows, 8, generator=g) * 0.05)
    pattern = torch.tensor([0, -1, 2, 1], dtype=torch.int32)

    def take_slots(model: torch.nn.Module, args: tuple) -> None:
        n = args[0].numel()  # the step's input ids
        batch.slots = pattern.repeat(-(-n // 4))[:n].contiguous()

    runner.model.register_forward_pre_hook(take_slots)
    runner.storage_moved()  # the adapters came outside a control call (LoadLora)
    return linears


def _gguf_model(case: str, factory: pytest.TempPathFactory, tokenizer_dir: Path | None) -> Path:
    """test_gguf.py's GGUF case `case`, prepared."""
    if tokenizer_dir is None:
        pytest.skip("needs the default model's tokenizer (python -m frontend.model_prep)")
    return gguf_case_files(case, factory, tokenizer_dir)[1]


@pytest.fixture(scope="module")
def gguf_legacy(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path | None) -> Path:
    """A GGUF model of Q8_0, Q5_1, Q4_1, Q5_0 and Q4_0 layers (test_gguf.py's llama)."""
    return _gguf_model("llama", tmp_path_factory, tokenizer_dir)


@pytest.fixture(scope="module")
def gguf_segmented(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path | None) -> Path:
    """A GGUF model whose qkv keeps row segments of two block types (test_gguf.py's qwen3_k)."""
    return _gguf_model("qwen3_k", tmp_path_factory, tokenizer_dir)


LORA_CASES = [
    ("tiny_llama", None, "float32"),
    ("tiny_llama", None, "bfloat16"),
    ("tiny_llama", "int8", "float32"),
    ("tiny_qwen2", "int8", "bfloat16"),  # q/k/v bias
    ("tiny_qwen3", None, "bfloat16"),
    ("gguf_segmented", None, "float32"),  # adapters added after every segment's product
]


@pytest.mark.parametrize(("arch", "quantization", "dtype"), LORA_CASES)
def test_fused_layer_with_lora_adapters_is_bit_identical_to_the_modules(
    arch: str, quantization: str | None, dtype: str, request: pytest.FixtureRequest, monkeypatch
) -> None:
    """Each linear adds its tokens' adapters in the native call with the kernel LinearBase runs
    (lora_ops.lora_add): the same logprobs bit for bit, and not those of the base model."""
    model_dir = request.getfixturevalue(arch)

    def serve(lora: bool) -> dict:
        runner = _runner(model_dir, quantization, dtype)
        if lora:
            linears = _serve_lora(runner)
            assert "fused decode layer: on" in runner.kernel_report()
            segmented = any(getattr(lin, "gguf_segments", None) for lin in linears)
            assert segmented == (arch == "gguf_segmented")
        prompts = make_prompts(1000)[:5]
        params = SamplingParams(temperature=0.0, seed=1, max_tokens=16)
        return run(runner, prompts, params, arrival_steps=(0, 0, 2, 9, 20), chunk_size=5)

    fused_calls = count_fused_calls(monkeypatch)
    fused = serve(lora=True)
    assert {1, 2} <= set(fused_calls), "decode steps with adapters took the fused path"
    base = serve(lora=False)
    unfuse(monkeypatch)
    unfused = serve(lora=True)
    for req_id, r in unfused.items():
        assert fused[req_id].output == r.output
        for a, b in zip(fused[req_id].logprobs, r.logprobs):
            assert torch.equal(a, b)
    assert any(
        not torch.equal(a, b)
        for req_id, r in unfused.items()
        for a, b in zip(base[req_id].logprobs, r.logprobs)
    ), "the adapters change the model"

"""GGUF files as models: tiny random checkpoints written as llama.cpp lays out a GGUF file
(scripts/make_tiny_gguf.py: its tensor names, Llama's permuted q/k rows, the default model's
tokenizer and chat template), each mixing block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
Q6_K, BF16) across its tensors, as a Q4_K_M file mixes its own. The reference is
Hugging Face's model loaded from the same file (`from_pretrained(..., gguf_file=...)`, which
dequantizes it): greedy tokens equal for 8 prompts in one batch, with prefix-cache hits;
logprobs within 1e-3 with prompts prefilled 7 tokens a step; and the tokenizer and chat
template equal Hugging Face's for 20 conversations.
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
import torch
import transformers

from frontend.gguf_model import prepare_gguf
from frontend.text.tokenizer import Tokenizer
from tests.conftest import ROOT, built_once, make_tiny_model
from tests.unit.test_engine_inproc import MAX_TOKENS, hf_greedy, make_prompts, run_greedy
from tests.unit.test_model_runner import GREEDY, make_runner, run
from tests.unit.test_model_runner import make_prompts as runner_prompts
from tests.unit.test_model_zoo import assert_logprobs_match_hf, rerun_from_the_prefix_cache
from workers.kernels import linear_ops
from workers.kernels.kernel_library import runnable_tiers, use_tier
from workers.kernels.linear_ops import BLOCK_TYPES
from workers.layers.embedding import ParallelLMHead
from workers.layers.linear import LinearBase
from workers.quant import gguf_blocks


def _write_gguf():
    spec = importlib.util.spec_from_file_location(
        "make_tiny_gguf", ROOT / "scripts/make_tiny_gguf.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.write_gguf


# Each file mixes block types across its tensors, as a Q4_K_M file does: case -> (architecture,
# config changes, GGUF name fragment -> block type). Layers whose tensors share a type the kernels
# take keep their blocks (llama: qkv Q8_0, o Q5_1, gate_up Q4_1, down Q5_0, the embedding and its
# tied LM head Q4_0; qwen3_k, wide enough for 256-value super-blocks: q Q6_K beside k and v Q4_K
# in one fused layer, gate_up Q5_K, down Q4_K, the embedding and LM head Q6_K); o stays BF16.
CASES = {
    "llama": ("llama", {}, {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q8_0",
                            "attn_output": "Q5_1", "ffn_gate": "Q4_1", "ffn_up": "Q4_1",
                            "ffn_down": "Q5_0", "*": "Q4_0"}),
    "qwen3_k": ("qwen3", {"hidden_size": 256, "intermediate_size": 512},
                {"attn_q": "Q6_K", "attn_output": "BF16", "attn": "Q4_K", "ffn_down": "Q4_K",
                 "ffn": "Q5_K", "*": "Q6_K"}),
}  # fmt: skip
KEPT = {"llama": {"Q8_0", "Q5_1", "Q4_1", "Q5_0", "Q4_0"}, "qwen3_k": {"Q5_K", "Q4_K", "Q6_K"}}


@pytest.fixture(scope="module", params=list(CASES))
def gguf_case(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    tokenizer_dir: Path | None,
) -> tuple[Path, Path, Path]:
    """(GGUF file, tern's prepared directory, Hugging Face's dequantized copy of the file)."""
    if tokenizer_dir is None:
        pytest.skip("needs the default model's tokenizer (python -m frontend.model_prep)")
    return gguf_case_files(request.param, tmp_path_factory, tokenizer_dir)


def gguf_case_files(
    case: str, factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> tuple[Path, Path, Path]:
    """make_gguf_case's files, made once per scripts/test run (test_fused_decode.py and
    test_parallel.py read the same cases; a case takes ~15 s to make)."""
    return built_once(  # type: ignore[return-value]
        f"gguf_{case}", factory,
        lambda work: make_gguf_case(case, work, tokenizer_dir, work / "tern_home"),
    )  # fmt: skip


def make_gguf_case(
    case: str, work: Path, tokenizer_dir: Path, tern_home: Path
) -> tuple[Path, Path, Path]:
    """CASES[case] written as a GGUF file in `work`, prepared under `tern_home`, and Hugging
    Face's model of the file (dequantized) saved as the reference."""
    arch, overrides, types = CASES[case]
    hf_dir = make_tiny_model(arch, work / "hf", tokenizer_dir, overrides=overrides)
    gguf = _write_gguf()(hf_dir, work / f"tiny-{case}.gguf", types)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TERN_HOME", str(tern_home))
        prepared = prepare_gguf(gguf)
    # transformers 5 keeps GGUF weights quantized unless asked to dequantize them at load; the
    # config is the prepared one (transformers reads no head_dim from a Qwen3 file).
    dequantize = transformers.GgufConfig(gguf_file=str(gguf), dequantize=True)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, quantization_config=dequantize,
        config=transformers.AutoConfig.from_pretrained(prepared),
    )  # fmt: skip
    reference.save_pretrained(work / "reference")
    return gguf, prepared, work / "reference"


def kept_types(model: torch.nn.Module) -> set[str]:
    """The block types the model's layers keep (a fused layer's per projection where they differ)."""
    kept = set()
    for m in model.modules():
        if getattr(m, "quant", None) == "gguf":
            segments = getattr(m, "gguf_segments", None)
            kept |= {s.block_type for s in segments} if segments else {m.block_type}
    return kept


def test_engine_matches_hf_on_the_files_weights(gguf_case: tuple[Path, Path, Path]) -> None:
    gguf, prepared, reference = gguf_case
    prompts = make_prompts(49152)
    ref = hf_greedy(reference, prompts, MAX_TOKENS)
    out, core = run_greedy(prepared, prompts, block_size=4)
    assert out == ref
    assert kept_types(core.executor.runner.model) == KEPT[gguf.stem.removeprefix("tiny-")]
    # The same prompts again on the same engine: their full blocks come from the prefix cache.
    again, cached = rerun_from_the_prefix_cache(core, prompts)
    assert cached > 0
    assert again == ref


def test_logprobs_match_hf(gguf_case: tuple[Path, Path, Path]) -> None:
    _, prepared, reference = gguf_case
    hf = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    reqs = run(make_runner(prepared, block_size=16), runner_prompts(49152), GREEDY, chunk_size=7)
    assert_logprobs_match_hf(hf, reqs.values())


def _conversations(n: int) -> list[list[dict]]:
    rng = random.Random(0)
    words = ["tern", "GGUF", "blocks", "hello", "2+2?", "über", "日本語", "emoji 🐦", "\n", "  "]
    out = []
    for i in range(n):
        turns = [{"role": "system", "content": "You are terse."}] if i % 3 == 0 else []
        for t in range(1 + i % 4):
            text = " ".join(rng.choice(words) for _ in range(rng.randrange(1, 12)))
            turns.append({"role": "user" if t % 2 == 0 else "assistant", "content": text})
        if turns[-1]["role"] != "user":
            turns.append({"role": "user", "content": "and?"})
        out.append(turns)
    return out


def test_the_workers_reader_sees_what_ggufs_reader_sees(gguf_case: tuple[Path, Path, Path]) -> None:
    """workers/quant/gguf_file.py against the gguf package's GGUFReader on the same file: every
    tensor's name, type, shape, dtype and bytes, and every scalar or string field (arrays, the
    vocabulary among them, are stepped over)."""
    import gguf as gguf_package
    import numpy as np

    from workers.quant.gguf_file import GGUFFile

    path = gguf_case[0]
    ours, theirs = GGUFFile(path), gguf_package.GGUFReader(path)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == reference.tensor_type
        assert list(mine.shape) == reference.shape.tolist()
        assert mine.data.dtype == reference.data.dtype and mine.data.shape == reference.data.shape
        assert np.array_equal(mine.data, reference.data)
    fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    arrays = {k for k, f in fields.items() if f.types[0] == gguf_package.GGUFValueType.ARRAY}
    assert "tokenizer.ggml.tokens" in arrays and not arrays & ours.metadata.keys()
    assert ours.metadata == pytest.approx(
        {k: f.contents() for k, f in fields.items() if k not in arrays}
    )


def test_tokenizer_and_chat_template_equal_hf(gguf_case: tuple[Path, Path, Path]) -> None:
    gguf, prepared, _ = gguf_case
    hf = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ours = Tokenizer(prepared)
    for messages in _conversations(20):
        expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert ours.render_chat(messages, add_generation_prompt=True) == expected
        assert ours.apply_chat_template(messages) == hf.encode(expected, add_special_tokens=False)


@pytest.mark.parametrize("block_type", sorted(BLOCK_TYPES))
def test_kept_blocks_multiply_as_the_dequantized_weight(block_type: str) -> None:
    """A linear layer keeping GGUF blocks: loaded from a file's rows, sharded by rows and by
    columns at block boundaries (tp 2), and from a float tensor (a weight update), quantized on
    arrival as the file's rows were; every product equals the dequantized weight's (the gguf
    package's dequantization)."""
    import gguf

    from workers.distributed import ParallelContext
    from workers.layers.linear import ColumnParallelLinear, RowParallelLinear
    from workers.quant import int4_blocks
    from workers.quant.gguf_blocks import GGUFBlocks, quantize

    torch.manual_seed(0)
    k = 512  # two K-quant super-blocks: a column shard holds one
    w = torch.randn(96, k)
    blocks = quantize(w, block_type)
    if block_type == "INT4_ZP":  # tern's own blocks (GPTQ / AWQ / --quantization int4)
        dequantized = torch.from_numpy(int4_blocks.dequantize(blocks.numpy(), k))
    else:
        qtype = gguf.GGMLQuantizationType[block_type]
        dequantized = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), qtype).copy())
    x = torch.randn(5, k)
    half = k // 2
    for rank in range(2):
        ctx = ParallelContext(tp_rank=rank, tp_size=2, tp_group=object())  # no collective used
        column = ColumnParallelLinear(k, 96, ctx=ctx)
        row = RowParallelLinear(k, 96, ctx=ctx)
        for layer in (column, row):
            layer.keep_gguf_blocks(block_type)
            layer.weight_loader(layer.weight, GGUFBlocks(blocks, block_type, k))
        rows = dequantized[rank * 48 : (rank + 1) * 48]
        cols = dequantized[:, rank * half : (rank + 1) * half]
        close = {"rtol": 1e-5, "atol": 1e-4}  # float32 sums of 512 products in another order
        for m in (1, 5):  # decode (the native kernel) and prefill-sized rows alike
            torch.testing.assert_close(column._linear(x[:m], None), x[:m] @ rows.T, **close)
            xs = x[:m, rank * half : (rank + 1) * half]
            torch.testing.assert_close(row._linear(xs.contiguous(), None), xs @ cols.T, **close)
    update = ColumnParallelLinear(k, 96, ctx=ParallelContext.single())
    update.keep_gguf_blocks(block_type)
    update.weight_loader(update.weight, w)  # full precision: quantized on arrival
    assert torch.equal(update.weight.data, blocks)


def _dequantized(blocks: torch.Tensor, block_type: str, k: int) -> torch.Tensor:
    """The gguf package's dequantization of `blocks` (tern's own for INT4_ZP)."""
    import gguf

    from workers.quant import int4_blocks

    if block_type == "INT4_ZP":
        return torch.from_numpy(int4_blocks.dequantize(blocks.numpy(), k))
    qtype = gguf.GGMLQuantizationType[block_type]
    return torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), qtype).copy())


def _quantized_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the fast path multiplies it: each 32-value block rounded to int8 steps of its own
    scale max|x| / 127."""
    groups = x.unflatten(-1, (-1, 32))
    dx = groups.abs().amax(-1, keepdim=True) / 127
    return (torch.round(groups * torch.where(dx > 0, 1 / dx, 0)) * dx).flatten(-2)


@pytest.mark.parametrize("tier", [t.name for t in runnable_tiers()])
@pytest.mark.parametrize("block_type", sorted(BLOCK_TYPES))
def test_the_fast_paths_products_are_its_quantized_rows_times_the_weight(
    block_type: str, tier: str
) -> None:
    """The fast path's product (activations quantized to int8 per 32 values, products in integers)
    on every tier equals the quantized rows, dequantized, times the dequantized weight: 1-3 rows
    one at a time, 4 and 9 in passes of 4 (not on the baseline tier: float32 products there), an
    odd number of 32-value chunks and two super-blocks for the K-quants; read from the rows
    repacked in groups of 8 (43 rows: the last group short), which take at most 3% more bytes
    than the blocks (the K-quants' headers of float16 d, dmin per super-block)."""
    from workers.quant.gguf_blocks import quantize, repack_x8

    torch.manual_seed(0)
    k = 512 if gguf_blocks.block_values(block_type) == 256 else 288
    w = torch.randn(43, k)
    blocks = quantize(w, block_type)
    dequantized = _dequantized(blocks, block_type, k).double()
    bias = torch.randn(43)
    with use_tier(tier):
        packed = repack_x8(blocks, block_type, k)
    assert packed is not None
    groups = -(-43 // 8)
    assert packed.numel() <= 1.03 * groups * 8 / 43 * blocks.numel()
    for m in (1, 2, 3) if tier == "baseline" else (1, 2, 3, 4, 9):
        x = torch.randn(m, k) * torch.logspace(-2, 1, k // 32).repeat_interleave(32)
        want = _quantized_rows(x).double() @ dequantized.T + bias.double()
        with use_tier(tier):
            got = linear_ops.gguf_linear(
                x, blocks, block_type, bias, quantize_x=True, packed=packed
            )
        close = {"rtol": 1e-4, "atol": 1e-4 * want.abs().max()}
        torch.testing.assert_close(got.double(), want, **close)


@pytest.mark.parametrize("rows", [32, 37, "BF16_MIN_ROWS"])
@pytest.mark.parametrize("block_type", ["Q8_0", "Q4_K"])
def test_the_fast_paths_many_row_products_are_bfloat16(block_type: str, rows: int | str) -> None:
    """From 32 rows on a tier with bfloat16 arithmetic, the fast path multiplies the dequantized
    weight and the activations in bfloat16 (below BF16_MIN_ROWS the kernels' bfloat16 tiles, from
    it torch's GEMM): within bfloat16's rounding of the exact product, and not equal to float32's.
    37 rows and 43 weight rows leave partial register blocks and a partial tile."""
    from workers.quant.gguf_blocks import BF16_MIN_ROWS, BF16_TIERS, linear, quantize, repack_x8

    tiers = [t.name for t in runnable_tiers() if t.name in BF16_TIERS]
    if not tiers:
        pytest.skip("no tier with bfloat16 arithmetic on this CPU")
    rows = BF16_MIN_ROWS if rows == "BF16_MIN_ROWS" else rows
    torch.manual_seed(0)
    k = 512
    blocks = quantize(torch.randn(43, k), block_type)
    x, bias = torch.randn(rows, k), torch.randn(43)
    want = x.double() @ _dequantized(blocks, block_type, k).double().T + bias.double()
    with use_tier(tiers[0]):
        packed = repack_x8(blocks, block_type, k)
        got = linear(x, blocks, block_type, k, bias, quantize_x=True, packed=packed)
        exact = linear(x, blocks, block_type, k, bias)
    torch.testing.assert_close(exact.double(), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2 * want.abs().max())
    assert not torch.equal(got, exact)


def test_without_bfloat16_the_fast_path_takes_integer_products_at_any_rows() -> None:
    """On AVX2 a prefill's many rows (past dequant_min_rows, where the exact path calls torch's
    GEMM) are the integer products too: equal to the quantized rows times the weight."""
    from workers.quant.gguf_blocks import dequant_min_rows, linear, quantize, repack_x8

    if "avx2" not in [t.name for t in runnable_tiers()]:
        pytest.skip("this CPU runs no AVX2 tier")
    torch.manual_seed(0)
    k = 256
    blocks = quantize(torch.randn(24, k), "Q4_K")
    with use_tier("avx2"):
        rows = dequant_min_rows() + 5
        packed = repack_x8(blocks, "Q4_K", k)
        x = torch.randn(rows, k)
        got = linear(x, blocks, "Q4_K", k, None, quantize_x=True, packed=packed)
    want = _quantized_rows(x).double() @ _dequantized(blocks, "Q4_K", k).double().T
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4 * want.abs().max())


def test_the_fast_path_agrees_with_the_exact_one(gguf_case: tuple[Path, Path, Path]) -> None:
    """Any --dtype but float32 quantizes the activations per block for the kept layers (the
    llama.cpp way): its tokens against Hugging Face's on the dequantized file, teacher-forced on
    Hugging Face's greedy output, so one early difference does not count twice."""
    _, prepared, reference = gguf_case
    hf = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    prompts = runner_prompts(49152)
    runner = make_runner(prepared, block_size=16, dtype="auto")
    assert any(getattr(m, "gguf_quantize_x", False) for m in runner.model.modules())
    assert all(  # and its decode steps read the rows repacked for them
        m.gguf_packed is not None
        for m in runner.model.modules()
        if isinstance(m, (LinearBase, ParallelLMHead)) and getattr(m, "gguf_quantize_x", False)
    )
    reqs = []
    for pair in range(0, len(prompts), 2):  # decode steps of 1-2 rows: the integer products
        reqs += run(runner, prompts[pair : pair + 2], GREEDY, arrival_steps=(0, 0)).values()
    agree = total = 0
    diffs = []
    with torch.no_grad():
        for r in reqs:
            ids = torch.tensor([r.prompt + r.output])
            logprobs = hf(ids).logits[0, len(r.prompt) - 1 : -1].float().log_softmax(-1)
            agree += sum(int(a == b) for a, b in zip(logprobs.argmax(-1).tolist(), r.output))
            total += len(r.output)
            chosen = torch.tensor(r.output)
            ours = torch.stack(r.logprobs).gather(1, chosen[:, None])
            diffs.append((ours - logprobs.gather(1, chosen[:, None])).abs().flatten())
    mean_diff = torch.cat(diffs).mean().item()
    print(
        f"fast path: top-1 agreement {agree}/{total}, chosen-token logprob mean |diff| {mean_diff:.4f}"
    )
    # A bound that catches a broken kernel (it agrees on almost nothing), not a quality target:
    # these random models' sharp logits amplify the activations' rounding through every layer.
    assert agree / total >= 0.85 and mean_diff < 0.1


def test_preempted_requests_resume_with_hf_logprobs(gguf_case: tuple[Path, Path, Path]) -> None:
    """Three requests preempted mid-decode (their blocks freed, prompt + output recomputed on
    resume, 7 tokens a step): tokens and logprobs still Hugging Face's on the file's weights."""
    _, prepared, reference = gguf_case
    hf = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    runner = make_runner(prepared, block_size=4)
    reqs = run(runner, runner_prompts(49152), GREEDY, chunk_size=7,
               preempt={6: "r2", 9: "r7", 12: "r0"})  # fmt: skip
    assert_logprobs_match_hf(hf, reqs.values())

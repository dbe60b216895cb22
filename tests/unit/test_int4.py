"""4-bit weights on the block kernels: GPTQ and AWQ checkpoints kept as their int4 groups, and
`--quantization int4` of a float checkpoint.

The GPTQ / AWQ checkpoints are written here from a tiny random model: each layer quantized per
group (asymmetric, float16 scales), packed as AutoGPTQ (v1: zero points stored minus one;
act-order: features grouped by a permutation, `g_idx`) and AutoAWQ's GEMM layout (the interleaved
nibble order) pack them. The reference is Hugging Face's model with each weight replaced by its
groups' float values scale * (q - zero), computed from the integers before packing: greedy
tokens equal for 8 prompts with prefix-cache hits, logprobs within 1e-3 with 7-token chunks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.conftest import make_tiny_model
from tests.unit.test_engine_inproc import MAX_TOKENS, hf_greedy, make_prompts, run_greedy
from tests.unit.test_model_runner import GREEDY, run
from tests.unit.test_model_runner import make_prompts as runner_prompts
from tests.unit.test_model_zoo import assert_logprobs_match_hf, rerun_from_the_prefix_cache
from workers.layers import int4_blocks

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's: nibble j of an int32 holds column order[j]


def _quantize_groups(w: np.ndarray, g_idx: np.ndarray, groups: int, min_zero: int = 0):
    """w (N, K) -> (q (N, K), scale (N, G) float16, zero (N, G)) over each group's features
    (zero points from `min_zero`: GPTQ v1 stores zero - 1 in a nibble)."""
    n = w.shape[0]
    scale = np.zeros((n, groups), np.float16)
    zero = np.zeros((n, groups), np.int64)
    q = np.zeros(w.shape, np.int64)
    for g in range(groups):
        cols = g_idx == g
        lo, hi = np.minimum(w[:, cols].min(1), 0), np.maximum(w[:, cols].max(1), 0)
        s = ((hi - lo) / 15).astype(np.float16)
        s32 = np.maximum(s.astype(np.float32), 1e-8)
        z = np.clip(np.rint(-lo / s32), min_zero, 15).astype(np.int64)
        q[:, cols] = np.clip(np.rint(w[:, cols] / s32[:, None]) + z[:, None], 0, 15)
        scale[:, g], zero[:, g] = s, z
    return q, scale, zero


def _pack(values: np.ndarray, order=tuple(range(8))) -> np.ndarray:
    """(R, 8C) integers 0-15 -> (R, C) int32, column 8c + order[j] in bits 4j..4j+3."""
    r, c = values.shape[0], values.shape[1] // 8
    out = np.zeros((r, c), np.uint32)
    for j in range(8):
        out |= values[:, np.arange(c) * 8 + order[j]].astype(np.uint32) << np.uint32(4 * j)
    return out.view(np.int32)


def write_int4_checkpoint(src: Path, out: Path, method: str, group: int, act_order: bool = False):
    """`src` (a float checkpoint) as a GPTQ or AWQ checkpoint at `out`, and its float reference
    (the dequantized weights) at `out`/reference."""
    shutil.copytree(src, out)
    tensors = load_file(out / "model.safetensors")
    reference = dict(tensors)
    rng = np.random.default_rng(0)
    for name in [n for n in tensors if n.rsplit(".", 2)[-2] in LINEARS]:
        w = tensors.pop(name).float().numpy()
        n, k = w.shape
        order = rng.permutation(k) if act_order else np.arange(k)
        g_idx = np.empty(k, np.int64)
        g_idx[order] = np.arange(k) // group  # act-order: groups of features in `order`
        q, scale, zero = _quantize_groups(w, g_idx, k // group, int(method == "gptq"))
        values = scale.astype(np.float32)[:, g_idx] * (q - zero[:, g_idx]).astype(np.float32)
        reference[name] = torch.from_numpy(values)
        prefix = name.removesuffix(".weight")
        if method == "gptq":
            tensors[f"{prefix}.qweight"] = torch.from_numpy(_pack(q).T.copy())  # (K / 8, N)
            tensors[f"{prefix}.qzeros"] = torch.from_numpy(_pack((zero - 1).T.copy()))
            tensors[f"{prefix}.g_idx"] = torch.from_numpy(g_idx.astype(np.int32))
        else:
            tensors[f"{prefix}.qweight"] = torch.from_numpy(_pack(q.T.copy(), AWQ_PACK_ORDER))
            tensors[f"{prefix}.qzeros"] = torch.from_numpy(_pack(zero.T.copy(), AWQ_PACK_ORDER))
        tensors[f"{prefix}.scales"] = torch.from_numpy(scale.T.copy())
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    if method == "gptq":
        qc = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order,
              "sym": False, "checkpoint_format": "gptq"}  # fmt: skip
    else:
        qc = {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm",
              "zero_point": True}  # fmt: skip
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    (out / "reference").mkdir()
    save_file(reference, out / "reference/model.safetensors", metadata={"format": "pt"})
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / "reference" / f.name)
    return out, out / "reference"


# case -> (method, group size, act-order, block type the layers keep or None: dequantized)
CASES = {
    "gptq": ("gptq", 32, False, "INT4_ZP"),
    "gptq_act_order": ("gptq", 32, True, None),
    "awq": ("awq", 64, False, "INT4_ZP"),
}


@pytest.fixture(scope="module", params=list(CASES))
def int4_case(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path, Path]:
    work = tmp_path_factory.mktemp(f"int4_{request.param}")
    src = make_tiny_model("llama", work / "float")
    method, group, act_order, _ = CASES[request.param]
    return (request.param, *write_int4_checkpoint(src, work / "q", method, group, act_order))


def _kept(core) -> set[str | None]:
    modules = core.executor.runner.model.modules()
    return {m.block_type for m in modules if getattr(m, "quant", None) == "gguf"}


def test_engine_matches_hf_on_the_dequantized_groups(int4_case: tuple[str, Path, Path]) -> None:
    case, checkpoint, reference = int4_case
    prompts = make_prompts(512)
    ref = hf_greedy(reference, prompts, MAX_TOKENS)
    out, core = run_greedy(checkpoint, prompts, block_size=4)
    assert out == ref
    kept = CASES[case][3]
    assert _kept(core) == ({kept} if kept else set())
    again, cached = rerun_from_the_prefix_cache(core, prompts)
    assert cached > 0 and again == ref


def test_logprobs_match_hf(int4_case: tuple[str, Path, Path]) -> None:
    from tests.unit.test_model_runner import make_runner

    _, checkpoint, reference = int4_case
    hf = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    reqs = run(make_runner(checkpoint, block_size=16), runner_prompts(512), GREEDY, chunk_size=7)
    assert_logprobs_match_hf(hf, reqs.values())


def test_quantization_int4_matches_hf_on_its_blocks(tmp_path: Path) -> None:
    """--quantization int4: each linear layer's weight quantized at load to INT4_ZP blocks (32
    values, a scale and a zero point each); the reference is Hugging Face's model on exactly
    those blocks' values."""
    src = make_tiny_model("qwen3", tmp_path / "float")
    tensors = load_file(src / "model.safetensors")
    for name in [n for n in tensors if n.rsplit(".", 2)[-2] in LINEARS]:
        w = tensors[name].float().numpy()
        tensors[name] = torch.from_numpy(
            int4_blocks.dequantize(int4_blocks.quantize(w), w.shape[1])
        )
    reference = tmp_path / "reference"
    shutil.copytree(src, reference)
    save_file(tensors, reference / "model.safetensors", metadata={"format": "pt"})
    prompts = make_prompts(512)
    out, core = run_greedy(src, prompts, block_size=4, quantization="int4")
    assert out == hf_greedy(reference, prompts, MAX_TOKENS)
    assert _kept(core) == {"INT4_ZP"}


def test_unsupported_quantized_checkpoints_are_refused(tmp_path: Path) -> None:
    from workers.int4_checkpoints import int4_format

    for qc, message in [
        ({"quant_method": "bitsandbytes"}, "not supported"),
        ({"quant_method": "gptq", "bits": 8}, "8 bits"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "gemv"),
    ]:
        (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qc}))
        with pytest.raises(ValueError, match=message):
            int4_format(tmp_path)

"""Hugging Face quantized checkpoints and `--quantization int4`: GPTQ, AWQ and compressed-tensors
W4A16 checkpoints kept as their int4 groups on the block kernels, compressed-tensors int8 as int8
layers, FP8 block checkpoints dequantized at load.

The checkpoints are written here from a tiny random model: each layer quantized per group
(float16 scales), packed as AutoGPTQ (v1: zero points stored minus one; act-order: features
grouped by a permutation, `g_idx`), AutoAWQ's GEMM layout (the interleaved nibble order) and
compressed-tensors' pack-quantized format (symmetric, stored q + 8) pack them; int8 per output
channel; FP8 e4m3 with a scale per 32 x 32 tile. The reference is Hugging Face's model with each weight replaced by its
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
from workers.quant import int4_blocks

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


def _int4_layer(
    method: str, w: np.ndarray, group: int, order: np.ndarray
) -> tuple[dict, np.ndarray]:
    """One layer's GPTQ / AWQ / compressed-tensors tensors (by leaf name) and its float values."""
    n, k = w.shape
    g_idx = np.empty(k, np.int64)
    g_idx[order] = np.arange(k) // group  # act-order: groups of features in `order`
    if method == "ct_int4":  # symmetric: stored q + 8, zero 8
        scale = (np.abs(w).reshape(n, k // group, group).max(-1) / 7).astype(np.float16)
        s32 = np.maximum(scale.astype(np.float32), 1e-8)[:, g_idx]
        q = np.clip(np.rint(w / s32), -8, 7).astype(np.int64) + 8
        zero = np.full(scale.shape, 8)
    else:
        q, scale, zero = _quantize_groups(w, g_idx, k // group, int(method == "gptq"))
    values = scale.astype(np.float32)[:, g_idx] * (q - zero[:, g_idx]).astype(np.float32)
    if method == "gptq":
        out = {"qweight": _pack(q).T.copy(), "qzeros": _pack((zero - 1).T.copy()),
               "g_idx": g_idx.astype(np.int32), "scales": scale.T.copy()}  # fmt: skip
    elif method == "awq":
        out = {"qweight": _pack(q.T.copy(), AWQ_PACK_ORDER), "scales": scale.T.copy(),
               "qzeros": _pack(zero.T.copy(), AWQ_PACK_ORDER)}  # fmt: skip
    else:
        out = {"weight_packed": _pack(q), "weight_scale": scale,
               "weight_shape": np.array([n, k], np.int64)}  # fmt: skip
    return out, values


def _int8_layer(w: np.ndarray) -> tuple[dict, np.ndarray]:
    """compressed-tensors per-channel int8: scale = the row's largest |w| / 127."""
    scale = (np.abs(w).max(1, keepdims=True) / 127).astype(np.float16)
    q = np.clip(np.rint(w / scale.astype(np.float32)), -127, 127).astype(np.int8)
    return {"weight": q, "weight_scale": scale}, q.astype(np.float32) * scale.astype(np.float32)


def _fp8_layer(w: torch.Tensor, block: int) -> tuple[dict, torch.Tensor]:
    """DeepSeek-style FP8: float8_e4m3fn values and a float32 scale per block x block tile."""
    n, k = w.shape
    tiles = w.reshape(n // block, block, k // block, block)
    scale = tiles.abs().amax(dim=(1, 3)) / 448
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
    w8 = (w / full).to(torch.float8_e4m3fn)
    return {"weight": w8, "weight_scale_inv": scale}, w8.float() * full


def write_quantized_checkpoint(
    src: Path, out: Path, method: str, group: int = 32, act_order: bool = False
) -> tuple[Path, Path]:
    """`src` (a float checkpoint) as a `method` checkpoint (gptq, awq, ct_int4, ct_int8, fp8;
    int4 in groups of `group`, fp8 in `group` x `group` tiles) at `out`, and its float reference
    (the dequantized weights) at `out`/reference."""
    shutil.copytree(src, out)
    tensors = load_file(out / "model.safetensors")
    reference = dict(tensors)
    rng = np.random.default_rng(0)
    for name in [n for n in tensors if n.rsplit(".", 2)[-2] in LINEARS]:
        w = tensors.pop(name).float()
        k = w.shape[1]
        if method == "fp8":
            layer, values = _fp8_layer(w, group)
        elif method == "ct_int8":
            layer, values = _int8_layer(w.numpy())
        else:
            order = rng.permutation(k) if act_order else np.arange(k)
            layer, values = _int4_layer(method, w.numpy(), group, order)
        reference[name] = torch.as_tensor(values)
        prefix = name.removesuffix(".weight")
        for leaf, t in layer.items():
            tensors[f"{prefix}.{leaf}"] = torch.as_tensor(t)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    weights = {"num_bits": 4 if method == "ct_int4" else 8, "type": "int", "symmetric": True,
               "strategy": "group" if method == "ct_int4" else "channel",
               "group_size": group if method == "ct_int4" else None}  # fmt: skip
    qc = {
        "gptq": {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order,
                 "sym": False, "checkpoint_format": "gptq"},
        "awq": {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm",
                "zero_point": True},
        "ct_int4": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
                    "ignore": ["lm_head"]},
        "ct_int8": {"quant_method": "compressed-tensors", "format": "int-quantized",
                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                        "input_activations": {"num_bits": 8, "type": "int", "dynamic": True,
                                              "strategy": "token"}}},
                    "ignore": ["lm_head"]},
        "fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [group, group]},
    }[method]  # fmt: skip
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    (out / "reference").mkdir()
    save_file(reference, out / "reference/model.safetensors", metadata={"format": "pt"})
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / "reference" / f.name)
    return out, out / "reference"


# case -> (method, group size, act-order, what the layers keep: INT4_ZP blocks, int8, or float)
CASES = {
    "gptq": ("gptq", 32, False, "INT4_ZP"),
    "gptq_act_order": ("gptq", 32, True, "INT4_ZP"),
    "awq": ("awq", 64, False, "INT4_ZP"),
    "ct_int4": ("ct_int4", 32, False, "INT4_ZP"),
    "ct_int8": ("ct_int8", 0, False, "int8"),
    "fp8": ("fp8", 32, False, None),
}


@pytest.fixture(scope="module", params=list(CASES))
def quantized_case(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path, Path]:
    work = tmp_path_factory.mktemp(f"int4_{request.param}")
    src = make_tiny_model("llama", work / "float")
    method, group, act_order, _ = CASES[request.param]
    return (request.param, *write_quantized_checkpoint(src, work / "q", method, group, act_order))


def _kept(core) -> set[str | None]:
    """What the quantized linear layers store: their block types, or "int8"."""
    modules = core.executor.runner.model.modules()
    quant = [
        m for m in modules if getattr(m, "quant", None) is not None and hasattr(m, "input_size")
    ]
    return {m.block_type if m.quant == "gguf" else m.quant for m in quant}


def test_engine_matches_hf_on_the_dequantized_groups(
    quantized_case: tuple[str, Path, Path],
) -> None:
    case, checkpoint, reference = quantized_case
    prompts = make_prompts(512)
    ref = hf_greedy(reference, prompts, MAX_TOKENS)
    out, core = run_greedy(checkpoint, prompts, block_size=4)
    assert out == ref
    kept = CASES[case][3]
    assert _kept(core) == ({kept} if kept else set())
    again, cached = rerun_from_the_prefix_cache(core, prompts)
    assert cached > 0 and again == ref


def test_logprobs_match_hf(quantized_case: tuple[str, Path, Path]) -> None:
    from tests.unit.test_model_runner import make_runner

    case, checkpoint, reference = quantized_case
    hf = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    reqs = run(make_runner(checkpoint, block_size=16), runner_prompts(512), GREEDY, chunk_size=7)
    # int8 layers: tern's int8 kernel rounds each decode row of activations to int16 (about 1e-5
    # of its largest value), the one difference from the dequantized weights' products.
    assert_logprobs_match_hf(hf, reqs.values(), atol=3e-3 if case == "ct_int8" else 1e-3)


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
    from workers.quant.quantized_checkpoints import checkpoint_quantization

    for qc, message in [
        ({"quant_method": "bitsandbytes"}, "not supported"),
        ({"quant_method": "gptq", "bits": 8}, "8 bits"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "gemv"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
            "g": {"weights": {"num_bits": 4, "type": "int", "symmetric": False}}}}, "symmetric"),
        ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
            "g": {"weights": {"num_bits": 8, "type": "int"}}}}, "float-quantized"),
        ({"quant_method": "fp8", "activation_scheme": "static"}, "static"),
    ]:  # fmt: skip
        (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qc}))
        with pytest.raises(ValueError, match=message):
            checkpoint_quantization(tmp_path)


def test_a_gptq_server_updates_from_a_gptq_checkpoint_on_disk(tmp_path: Path) -> None:
    """An update from disk reads a quantized checkpoint as loading does: its int4 groups go into
    the layers' INT4_ZP blocks as they are (the answers: Hugging Face's on its dequantized
    weights)."""
    from enginecore.control import EngineControl
    from enginecore.messages import UpdateWeights, UpdateWeightsFromDisk
    from tests.unit.test_engine_inproc import make_core
    from tests.unit.test_weight_control import call, greedy

    first, first_ref = write_quantized_checkpoint(
        make_tiny_model("llama", tmp_path / "a"), tmp_path / "qa", "gptq"
    )
    second, second_ref = write_quantized_checkpoint(
        make_tiny_model("llama", tmp_path / "b", seed=1), tmp_path / "qb", "gptq"
    )
    prompts = make_prompts(512, n=3)
    control = EngineControl(make_core(first))
    assert greedy(control, prompts, "a")[0] == hf_greedy(first_ref, prompts, 8)
    call(control, UpdateWeights(UpdateWeightsFromDisk(str(second))))
    assert greedy(control, prompts, "b")[0] == hf_greedy(second_ref, prompts, 8)
    assert _kept(control.core) == {"INT4_ZP"}


def test_preempted_requests_resume_with_hf_logprobs(
    quantized_case: tuple[str, Path, Path],
) -> None:
    """Three requests preempted mid-decode (blocks freed, prompt + output recomputed on resume,
    7 tokens a step) on each quantized checkpoint: Hugging Face's tokens and logprobs."""
    from tests.unit.test_model_runner import make_runner

    case, checkpoint, reference = quantized_case
    hf = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    reqs = run(make_runner(checkpoint, block_size=4), runner_prompts(512), GREEDY, chunk_size=7,
               preempt={6: "r2", 9: "r7", 12: "r0"})  # fmt: skip
    assert_logprobs_match_hf(hf, reqs.values(), atol=3e-3 if case == "ct_int8" else 1e-3)

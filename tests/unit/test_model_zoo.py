"""The model zoo against Hugging Face (fp32): a tiny random-weight checkpoint of each family, made from
transformers' own config class (scripts/make_tiny_model.py), serves 8 prompts of 3 to 64 tokens in one
batch with the greedy tokens of Hugging Face's model: through the engine core with prefix caching
(a second pass hits the cache), under preemption, with every prefill chunked (7 tokens a step), and
through the model runner with logprobs within 1e-3. The sliding windows of the tiny checkpoints (8
tokens) are shorter than most prompts; the layer kinds of each family repeat.

The families and what each tiny checkpoint exercises: Qwen3.5 (Gated DeltaNet layers around gated
full attention; prefix hits resume from state checkpoints), Mistral (every layer slides), Ministral
(sliding and full layers), Gemma 2 (attention and final softcapping, 1 + weight sandwich norms, GELU,
scaled embeddings), Gemma 3 (5:1-style local/global layers with two rope bases, q/k norms), Phi-3
(fused qkv / gate_up checkpoint, partial rotation, longrope), SmolLM3 (NoPE layers), OLMo 2 (post
norms, whole-projection q/k norms, yarn), Granite (multipliers, dynamic rope), GLM-4 (sandwich norms,
interleaved partial rotation, fused gate_up). The mixture-of-experts families run the same tests:
Qwen3-MoE (8 experts, top 2 renormalised, a dense middle layer), Qwen2-MoE (shared expert with its
sigmoid gate), OLMoE (whole-projection q/k norms), Mixtral (sliding window; w1/w2/w3 names),
Qwen3.5-MoE (the hybrid layers, experts and a shared expert), gpt-oss (attention sinks, router
bias, expert biases, clamped SwiGLU; MXFP4 experts in a second checkpoint).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import transformers

from enginecore.control import EngineControl
from enginecore.messages import (
    EngineCoreRequest,
    SamplingParams,
    UpdateWeights,
    UpdateWeightsFromDisk,
    UpdateWeightsFromTensors,
)
from tests.conftest import MOE_FIXTURES, ZOO_FIXTURES, make_tiny_model
from tests.unit.test_engine_inproc import (
    MAX_TOKENS,
    hf_greedy,
    make_core,
    make_prompts,
    run_greedy,
    vocab_of,
)
from tests.unit.test_model_runner import GREEDY, make_runner, run
from tests.unit.test_model_runner import make_prompts as runner_prompts
from tests.unit.test_weight_control import N, blob, call, greedy

_reference: dict[Path, list[list[int]]] = {}


@pytest.fixture(params=ZOO_FIXTURES + MOE_FIXTURES)
def model_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)


def _hf(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    if model_dir not in _reference:
        _reference[model_dir] = hf_greedy(model_dir, prompts, MAX_TOKENS)
        assert len({tuple(r) for r in _reference[model_dir]}) == len(prompts)
    return _reference[model_dir]


def test_engine_matches_hf_and_the_prefix_cache_hits(model_dir: Path) -> None:
    prompts = make_prompts(vocab_of(model_dir))
    ref = _hf(model_dir, prompts)
    out, core = run_greedy(model_dir, prompts, block_size=4)
    assert out == ref
    # Hybrid models resume from the linear-attention states checkpointed at the prompts' last
    # block (enginecore/state_checkpoints.py).
    again, cached = rerun_from_the_prefix_cache(core, prompts)
    assert cached > 0
    assert again == ref


def rerun_from_the_prefix_cache(core, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """The same prompts again on the same engine, whose full blocks come from the prefix cache:
    (their greedy outputs, the most tokens a request found cached)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts):
        assert core.add_request(EngineCoreRequest(f"again{i}", p, params)) == []
    cached = 0
    outs: dict[str, list[int]] = {}
    while core.scheduler.has_requests:
        for o in core.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            cached = max(cached, o.num_cached_tokens or 0)
    return [outs[f"again{i}"] for i in range(len(prompts))], cached


def _layer_windows(model_dir: Path) -> set[str]:
    """ "sliding" and / or "full": the attention layers' kinds of the tiny checkpoint."""
    config = json.loads((model_dir / "config.json").read_text())
    if not config.get("sliding_window"):
        return {"full"}
    types = set(config.get("layer_types") or ["sliding_attention"]) - {"linear_attention"}
    return {t.removesuffix("_attention") for t in types}


def test_preemption_and_chunked_prefill(model_dir: Path) -> None:
    prompts = make_prompts(vocab_of(model_dir))
    ref = _hf(model_dir, prompts)
    # 24 blocks of 4 tokens: far fewer than 8 requests of up to 80 tokens need at once. Sliding
    # layers give back the blocks out of their window (and their blocks hold fewer layers when
    # full layers keep their own): prompts chunked by 16 tokens and fewer blocks run out.
    kw = {
        frozenset({"full"}): {"num_blocks": 24},
        frozenset({"sliding", "full"}): {"num_blocks": 40, "max_num_batched_tokens": 16},
        frozenset({"sliding"}): {"num_blocks": 12, "max_num_batched_tokens": 16},
    }[frozenset(_layer_windows(model_dir))]
    out, core = run_greedy(model_dir, prompts, block_size=4, **kw)
    assert core.scheduler.num_preempted_total > 0
    assert out == ref
    out, _ = run_greedy(model_dir, prompts, max_num_batched_tokens=7)
    assert out == ref


def test_logprobs_match_hf(model_dir: Path) -> None:
    """Against the scores of Hugging Face's generate (the prompt in one pass, then one token at a
    time with its cache): the order tern computes in. A single forward over prompt and output
    differs from those scores by up to 1.3e-3 itself on the tiny Qwen3.5, whose logits are large."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = runner_prompts(hf.config.vocab_size)
    reqs = run(make_runner(model_dir, block_size=16), prompts, GREEDY, chunk_size=7)
    assert_logprobs_match_hf(hf, reqs.values())


def assert_logprobs_match_hf(hf: transformers.PreTrainedModel, reqs, atol: float = 1e-3) -> None:
    """Each served request's greedy tokens and logprobs against Hugging Face's generate."""
    with torch.no_grad():
        for r in reqs:
            ids = torch.tensor([r.prompt])
            out = hf.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=len(r.output), min_new_tokens=len(r.output), pad_token_id=0,
                eos_token_id=None, output_scores=True, return_dict_in_generate=True,
            )  # fmt: skip
            assert out.sequences[0, len(r.prompt) :].tolist() == r.output
            hf_logprobs = torch.stack([s[0] for s in out.scores]).float().log_softmax(-1)
            torch.testing.assert_close(torch.stack(r.logprobs), hf_logprobs, atol=atol, rtol=0)


@pytest.mark.parametrize("arch", ["gemma3_vl", "qwen3_5_vl", "qwen3_5_moe_vl", "qwen2_vl"])
def test_a_checkpoint_with_a_vision_tower_serves_its_language_model(
    arch: str, tmp_path: Path, tokenizer_dir: Path | None
) -> None:
    """*ForConditionalGeneration (a random vision tower): the text answers are those of Hugging
    Face's model on the same weights, and the tower's weights load (their images are served: the
    log says so)."""
    model_dir = make_tiny_model(arch, tmp_path / arch, tokenizer_dir)
    vocab = json.loads((model_dir / "config.json").read_text())["text_config"]["vocab_size"]
    prompts = make_prompts(vocab)
    out, _ = run_greedy(model_dir, prompts)
    assert out == hf_greedy(model_dir, prompts, MAX_TOKENS)
    runner = make_runner(model_dir, block_size=16)
    assert "with its image encoder" in runner.model_summary
    assert runner.args.architecture.endswith("ForConditionalGeneration")


def test_language_model_only_skips_the_tower(tmp_path: Path, tokenizer_dir: Path | None) -> None:
    """--language-model-only on a checkpoint whose images are served: the engine answers text as
    Hugging Face's whole model does, with no encoder built (fewer parameters, the log says so)."""
    model_dir = make_tiny_model("qwen3_5_vl", tmp_path / "qwen3_5_vl", tokenizer_dir)
    vocab = json.loads((model_dir / "config.json").read_text())["text_config"]["vocab_size"]
    prompts = make_prompts(vocab)[:4]
    out, core = run_greedy(model_dir, prompts, language_model_only=True)
    assert out == hf_greedy(model_dir, prompts, MAX_TOKENS)
    assert not core.model_task.takes_images
    runner = core.executor.runner  # type: ignore[attr-defined]
    assert runner.model.vision is None
    assert "image and audio inputs are not served" in runner.model_summary


@pytest.mark.parametrize("arch", ["gemma3", "phi3", "qwen2_moe", "mixtral"])
def test_weight_updates_from_disk_and_tensors(
    arch: str, tmp_path: Path, tokenizer_dir: Path | None, request: pytest.FixtureRequest
) -> None:
    """Gemma 3 (1 + weight norms, two rope bases), Phi-3 (fused checkpoint tensors, split as
    they arrive) and mixture-of-experts models take new weights from disk and as tensors, then
    answer as Hugging Face does on them. Experts arrive from disk as released checkpoints name
    them (one tensor per expert and projection; Mixtral's w1/w3/w2) and as tensors stacked as a
    live Hugging Face model holds them (`mlp.experts.gate_up_proj` (E, 2I, H), `down_proj`)."""
    from safetensors.torch import save

    original = request.getfixturevalue(f"tiny_{arch}")
    trained = make_tiny_model(arch, tmp_path / "trained", tokenizer_dir, seed=1)
    prompts = make_prompts(vocab_of(original), n=3)
    expected_trained = hf_greedy(trained, prompts, N)
    expected_original = hf_greedy(original, prompts, N)
    assert expected_trained != expected_original
    control = EngineControl(make_core(original))
    assert greedy(control, prompts, "a")[0] == expected_original
    call(control, UpdateWeights(UpdateWeightsFromDisk(str(trained))))
    assert greedy(control, prompts, "b")[0] == expected_trained
    tensors = blob(original)
    if "moe" in arch or arch == "mixtral":
        live = transformers.AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32)
        state = {k: v.contiguous() for k, v in live.state_dict().items()}
        assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
        tensors = save(state)
    call(control, UpdateWeights(UpdateWeightsFromTensors(blobs=[tensors])))
    assert greedy(control, prompts, "c")[0] == expected_original


def test_moe_refuses_int8_experts(tiny_olmoe: Path) -> None:
    with pytest.raises(ValueError, match="does not cover expert weights"):
        make_core(tiny_olmoe, quantization="int8")


def test_qwen3_5_prompts_over_several_chunks(tiny_qwen3_5: Path) -> None:
    """Prompts of 1 to 3 delta-rule chunks (64 tokens), whole and prefilled 50 tokens a step."""
    rng = random.Random(5)
    vocab = vocab_of(tiny_qwen3_5)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (63, 64, 65, 130, 200)]
    ref = hf_greedy(tiny_qwen3_5, prompts, MAX_TOKENS)
    assert run_greedy(tiny_qwen3_5, prompts)[0] == ref
    assert run_greedy(tiny_qwen3_5, prompts, max_num_batched_tokens=50)[0] == ref


def test_qwen3_5_prefix_hits_resume_from_state_checkpoints(tiny_qwen3_5: Path) -> None:
    """Prompts after a shared 42-token system prefix, then a second turn of each conversation:
    with states checkpointed every 8 tokens (blocks of 4), each later prompt resumes from the
    checkpoint at its longest cached prefix, whole and prefilled 7 tokens a step, and still
    generates Hugging Face's tokens."""
    rng = random.Random(7)
    vocab = vocab_of(tiny_qwen3_5)
    system = [rng.randrange(vocab) for _ in range(42)]
    firsts = [system + [rng.randrange(vocab) for _ in range(n)] for n in (5, 11, 2)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ref_firsts = hf_greedy(tiny_qwen3_5, firsts, MAX_TOKENS)
    seconds = [p + o + [rng.randrange(vocab) for _ in range(6)] for p, o in zip(firsts, ref_firsts)]
    ref_seconds = hf_greedy(tiny_qwen3_5, seconds, MAX_TOKENS)
    for chunk in (2048, 7):
        core = make_core(
            tiny_qwen3_5, block_size=4, state_checkpoint_interval=8, max_num_batched_tokens=chunk
        )
        assert core.scheduler.kv.checkpoints is not None
        turns = [
            ("first", firsts[:1], ref_firsts[:1], 0),
            ("first", firsts[1:], ref_firsts[1:], 40),
        ]
        turns.append(("second", seconds, ref_seconds, None))
        for name, prompts, ref, least_cached in turns:
            for i, p in enumerate(prompts):
                assert core.add_request(EngineCoreRequest(f"{name}{i}{len(p)}", p, params)) == []
            outs: dict[str, list[int]] = {}
            cached: dict[str, int] = {}
            while core.scheduler.has_requests:
                for o in core.step():
                    outs.setdefault(o.request_id, []).extend(o.new_token_ids)
                    cached[o.request_id] = o.num_cached_tokens or 0
            assert [outs[f"{name}{i}{len(p)}"] for i, p in enumerate(prompts)] == ref
            for i, (p, prev) in enumerate(zip(prompts, firsts)):
                # The second turn finds the first turn's prompt, up to its last checkpoint.
                floor = (len(prev) - 1) // 4 * 4 if least_cached is None else least_cached
                assert cached[f"{name}{i}{len(p)}"] >= floor, (name, i, chunk)
        assert core.stats().num_used_state_checkpoints > 0


def test_gpt_oss_mxfp4_experts_load_as_hf_runs_them_dequantized(
    tmp_path: Path, tokenizer_dir: Path | None, caplog: pytest.LogCaptureFixture
) -> None:
    """gpt-oss as released stores its experts in MXFP4 (`_blocks` / `_scales`): tern dequantizes
    them as they load (and says so; the values and layout transformers' own MXFP4 conversion
    gives) and answers as Hugging Face does on the dequantized weights."""
    import logging

    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from scripts.make_tiny_model import write_mxfp4_gpt_oss
    from workers.weight_loader import dequantize_mxfp4

    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8)
    scales = torch.randint(118, 136, (3, 10, 4), dtype=torch.uint8)
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(dequantize_mxfp4(blocks, scales).transpose(1, 2), expected)

    reference = make_tiny_model("gpt_oss", tmp_path / "reference", tokenizer_dir, seed=2)
    write_mxfp4_gpt_oss(reference, tmp_path / "mxfp4")
    prompts = make_prompts(vocab_of(reference))
    with caplog.at_level(logging.INFO, logger="workers.weight_loader"):
        out, _ = run_greedy(tmp_path / "mxfp4", prompts)
    assert "experts stored in MXFP4" in caplog.text
    assert out == hf_greedy(reference, prompts, MAX_TOKENS)

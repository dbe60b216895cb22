"""ModelRunner against Hugging Face (fp32): greedy tokens and logprobs, with a tiny scheduler here.

The scheduler in this file is deliberately simple: it admits requests at given steps, gives each
running request its next prefill chunk or decode token every step, allocates blocks from a shuffled
free list (so block tables are not contiguous), frees blocks of finished requests for reuse, and can
preempt a request (forget it, then recompute prompt + output on resume).
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import transformers

from enginecore.config import CacheConfig, Config, ModelConfig
from enginecore.messages import SamplingParams, ScheduledRequest, SchedulerOutput
from workers.kernels.kernel_library import runnable_tiers, use_tier
from workers.runner.model_runner import ModelRunner

ARCHS = ("tiny_llama", "tiny_qwen2", "tiny_qwen3")
PROMPT_LENS = (1, 3, 7, 12, 17, 26, 33, 50)
ARRIVAL_STEPS = (0, 0, 0, 1, 2, 3, 5, 8)  # later arrivals prefill next to running decodes
MAX_TOKENS = 16


@dataclass
class _Req:
    req_id: str
    prompt: list[int]
    params: SamplingParams
    arrival_step: int
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    blocks: list[list[int]] = field(default_factory=list)  # per KV-cache group
    is_new: bool = True  # the next schedule sends sampling params and starts a new block table
    logprobs: list[torch.Tensor] = field(default_factory=list)


def make_runner(
    model_dir: Path, block_size: int, num_blocks: int = 256, dtype: str = "float32"
) -> ModelRunner:
    config = Config(
        model=ModelConfig(path=str(model_dir), dtype=dtype),
        cache=CacheConfig(block_size=block_size, num_gpu_blocks_override=num_blocks),
    )
    runner = ModelRunner(config)
    runner.load_model()
    runner.init_kv_cache(runner.num_kv_blocks_for_memory())
    return runner


def make_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENS]


def run(
    runner: ModelRunner,
    prompts: list[list[int]],
    params: SamplingParams,
    *,
    chunk_size: int | None = None,
    arrival_steps: tuple[int, ...] = ARRIVAL_STEPS,
    preempt: dict[int, str] | None = None,
    seed: int = 0,
) -> dict[str, _Req]:
    """Serve every prompt to MAX_TOKENS output tokens; `preempt` maps step -> request to preempt."""
    num_blocks, bs = runner.num_kv_blocks, runner.block_size
    num_groups = len(runner.kv_cache_groups)  # a block table per KV-cache group, none freed here
    free_blocks = list(range(num_blocks))
    random.Random(seed).shuffle(free_blocks)
    reqs = [_Req(f"r{i}", p, params, a) for i, (p, a) in enumerate(zip(prompts, arrival_steps))]
    running: list[_Req] = []
    finished: list[str] = []
    step = 0
    while any(len(r.output) < MAX_TOKENS for r in reqs):
        running += [r for r in reqs if r.arrival_step == step]
        victim = (preempt or {}).get(step)
        assert victim is None or victim in {r.req_id for r in running}
        scheduled = []
        for r in running:
            if r.req_id == victim:
                finished.append(r.req_id)
                free_blocks += [b for table in r.blocks for b in table]
                r.blocks, r.num_computed, r.is_new = [], 0, True
                continue
            tokens = r.prompt + r.output
            end = (
                len(tokens) if chunk_size is None else min(len(tokens), r.num_computed + chunk_size)
            )
            r.blocks = r.blocks or [[] for _ in range(num_groups)]
            num_new_blocks = -(-end // bs) - len(r.blocks[0])
            new_blocks = [[free_blocks.pop() for _ in range(num_new_blocks)] for _ in r.blocks]
            for table, new in zip(r.blocks, new_blocks):
                table += new
            scheduled.append(
                ScheduledRequest(
                    req_id=r.req_id,
                    token_ids=tokens[r.num_computed : end],
                    start_pos=r.num_computed,
                    new_block_ids=new_blocks[0],
                    sample_index=len(r.output) if end == len(tokens) else -1,
                    sampling_params=r.params if r.is_new else None,
                    other_group_block_ids=new_blocks[1:],
                    state_slot=reqs.index(r),  # hybrid models' state row: one per request here
                )
            )
            r.num_computed, r.is_new = end, False
        out, logprobs = runner.execute_model_with_logprobs(
            SchedulerOutput(step_id=step, requests=scheduled, finished_req_ids=finished)
        )
        by_id = {r.req_id: r for r in running}
        sampled = [s.req_id for s in scheduled if s.sample_index >= 0]
        assert out.step_id == step and out.req_ids == sampled  # batch order
        for i, (req_id, (token,)) in enumerate(zip(out.req_ids, out.sampled_token_ids)):
            by_id[req_id].output.append(token)
            by_id[req_id].logprobs.append(logprobs[i])
        finished = [r.req_id for r in running if len(r.output) == MAX_TOKENS]
        for r in running:
            if len(r.output) == MAX_TOKENS:
                free_blocks += [b for table in r.blocks for b in table]
        running = [r for r in running if len(r.output) < MAX_TOKENS]
        step += 1
    return {r.req_id: r for r in reqs}


@pytest.fixture(scope="module", params=ARCHS)
def arch_setup(request: pytest.FixtureRequest) -> tuple[Path, transformers.PreTrainedModel, list]:
    """(model dir, the Hugging Face model, prompts, HF greedy outputs) for one architecture."""
    model_dir = request.getfixturevalue(request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # random weights: never stop early
    prompts = make_prompts(hf.config.vocab_size)
    expected = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                pad_token_id=0,
            )
            expected.append(out[0, len(p) :].tolist())
    return model_dir, hf, prompts, expected


GREEDY = SamplingParams(temperature=0.0, seed=1234, max_tokens=MAX_TOKENS)
# The HF-exactness checks with this CPU's kernels, with TERN_KERNELS=off's torch paths, and with
# the AVX2 tier (the one AVX2-only machines run) when this CPU has a higher one.
KERNEL_SETTINGS = ["default", "off"] + (
    ["avx2"] if "avx2" in {t.name for t in runnable_tiers()[:-1]} else []
)


def kernels(setting: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if setting == "default" else use_tier(setting)


@pytest.mark.parametrize("setting", KERNEL_SETTINGS)
def test_greedy_matches_hf(arch_setup, setting: str) -> None:
    model_dir, _, prompts, expected = arch_setup
    # All distinct, or a broken model that repeats one token would pass too easily.
    assert len({tuple(e) for e in expected}) == len(expected)
    with kernels(setting):
        reqs = run(make_runner(model_dir, block_size=4), prompts, GREEDY)
    assert [r.output for r in reqs.values()] == expected


@pytest.mark.parametrize("setting", KERNEL_SETTINGS)
def test_chunked_prefill_matches_hf(arch_setup, setting: str) -> None:
    model_dir, _, prompts, expected = arch_setup
    with kernels(setting):
        reqs = run(make_runner(model_dir, block_size=8), prompts, GREEDY, chunk_size=5)
    assert [r.output for r in reqs.values()] == expected


@pytest.mark.parametrize("setting", KERNEL_SETTINGS)
def test_logprobs_match_hf(arch_setup, setting: str) -> None:
    model_dir, hf, prompts, _ = arch_setup
    with kernels(setting):
        reqs = run(make_runner(model_dir, block_size=16), prompts, GREEDY, chunk_size=7)
    with torch.no_grad():
        for r in reqs.values():
            ids = torch.tensor([r.prompt + r.output[:-1]])
            hf_logprobs = hf(ids).logits[0].float().log_softmax(-1)[len(r.prompt) - 1 :]
            ours = torch.stack(r.logprobs)  # (MAX_TOKENS, vocab): output token i's distribution
            assert ours.shape == hf_logprobs.shape
            torch.testing.assert_close(ours, hf_logprobs, atol=1e-3, rtol=0)


@pytest.mark.parametrize(
    "params",
    [GREEDY, SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=7, max_tokens=MAX_TOKENS)],
    ids=["greedy", "seeded"],
)
def test_preemption_and_batch_composition_do_not_change_output(tiny_llama, params) -> None:
    runner = make_runner(tiny_llama, block_size=4, num_blocks=128)
    prompts = make_prompts(runner.vocab_size, seed=1)
    base = run(runner, prompts, params)
    preempted = run(runner, prompts, params, preempt={6: "r2", 9: "r7", 12: "r0"}, seed=1)
    assert [r.output for r in preempted.values()] == [r.output for r in base.values()]
    alone = run(runner, prompts[3:4], params, arrival_steps=(0,), seed=2)
    assert alone["r0"].output == base["r3"].output
    if not params.is_greedy:  # the noise differs per request: outputs are not all the greedy ones
        greedy = run(runner, prompts, GREEDY)
        assert [r.output for r in greedy.values()] != [r.output for r in base.values()]


def test_rejects_inconsistent_steps(tiny_qwen2) -> None:
    runner = make_runner(tiny_qwen2, block_size=4, num_blocks=8)
    with pytest.raises(ValueError, match="no state"):
        runner.execute_model(SchedulerOutput(0, [ScheduledRequest("x", [5], 3, [], 0)]))
    with pytest.raises(ValueError, match="block table"):
        short = ScheduledRequest("y", [5] * 9, 0, [0, 1], 0, GREEDY)
        runner.execute_model(SchedulerOutput(1, [short]))
    with pytest.raises(ValueError, match="seed"):
        unseeded = ScheduledRequest("z", [5, 6], 0, [2], 0, SamplingParams(temperature=1.0))
        runner.execute_model(SchedulerOutput(2, [unseeded]))


def test_kv_cache_sizing_and_summary(tiny_qwen3) -> None:
    config = Config(
        model=ModelConfig(path=str(tiny_qwen3), dtype="float32", max_model_len=100),
        cache=CacheConfig(block_size=16, kv_cache_memory_gib=0.001),
    )
    runner = ModelRunner(config)
    runner.load_model()
    # K and V x 4 layers x 16 slots x 2 KV heads x head_dim 32 x 4 bytes
    assert runner.kv_cache_bytes_per_block() == 2 * 4 * 16 * 2 * 32 * 4
    assert runner.num_kv_blocks_for_memory() == int(0.001 * 2**30) // (2 * 4 * 16 * 2 * 32 * 4)
    assert runner.max_model_len == 100
    summary = runner.model_summary
    assert "Qwen3ForCausalLM: 4 layers, hidden 64, 4 heads / 2 KV heads" in summary
    assert summary.endswith("float32")

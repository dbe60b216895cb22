"""EngineCore (scheduler + KV cache + model runner + sampler) in one process, against Hugging Face.

Greedy fp32 output must equal transformers' token for token, with 8 prompts of different lengths in
flight at once, and must not change with prefix caching off, with a KV cache so small that requests are
preempted, or with every prefill chunked.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from enginecore.config import CacheConfig, Config, ModelConfig, SchedulerConfig
from enginecore.core import EngineCore
from enginecore.executor import InProcExecutor
from enginecore.messages import EngineCoreRequest, FinishReason, SamplingParams
from tests.conftest import IN_PROCESS_KV_CACHE_GIB

MAX_TOKENS = 16


def hf_greedy(model_dir: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    except ValueError:  # an image-text model transformers has no causal-LM class for (Qwen2-VL)
        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            past = None
            new: list[int] = []
            step_ids = torch.tensor([prompt])
            for _ in range(n):
                res = model(step_ids, past_key_values=past, use_cache=True)
                past = res.past_key_values
                tok = int(res.logits[0, -1].argmax())
                new.append(tok)
                step_ids = torch.tensor([[tok]])
            outs.append(new)
    return outs


def make_core(model_dir: Path, **kw) -> EngineCore:
    cache = CacheConfig(
        block_size=kw.pop("block_size", 16),
        enable_prefix_caching=kw.pop("prefix_caching", True),
        num_gpu_blocks_override=kw.pop("num_blocks", None),
        kv_cache_memory_gib=kw.pop("kv_cache_memory_gib", IN_PROCESS_KV_CACHE_GIB),
        state_checkpoint_interval=kw.pop("state_checkpoint_interval", None),
    )
    config = Config(
        model=ModelConfig(
            path=str(model_dir),
            dtype=kw.pop("dtype", "float32"),
            quantization=kw.pop("quantization", None),
            language_model_only=kw.pop("language_model_only", False),
        ),
        cache=cache,
        scheduler=SchedulerConfig(**kw),
    )
    return EngineCore(config, InProcExecutor(config))


def run_to_end(core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]):
    for req_id, (prompt, params) in requests.items():
        assert core.add_request(EngineCoreRequest(req_id, prompt, params)) == []
    return drain(core)


def drain(core: EngineCore) -> tuple[dict[str, list[int]], dict[str, FinishReason]]:
    """Steps until every request has finished: (output tokens, finish reason) by request id."""
    outs: dict[str, list[int]] = {}
    reasons: dict[str, FinishReason] = {}
    for _ in range(10_000):
        if not core.scheduler.has_requests:
            break
        for out in core.step():
            outs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason
    assert not core.scheduler.has_requests
    return outs, reasons


def run_greedy(
    model_dir: Path, prompts: list[list[int]], **kw
) -> tuple[list[list[int]], EngineCore]:
    core = make_core(model_dir, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs, reasons = run_to_end(core, {f"r{i}": (p, params) for i, p in enumerate(prompts)})
    assert set(reasons.values()) == {FinishReason.LENGTH}
    assert core.scheduler.kv.num_free_blocks == core.scheduler.kv.num_total_blocks
    return [outs[f"r{i}"] for i in range(len(prompts))], core


def make_prompts(vocab: int, n: int = 8, seed: int = 0) -> list[list[int]]:
    """Prompts of 3 to 64 tokens; every other one shares a prefix, so the prefix cache matters."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(40)]
    prompts = []
    for i, length in enumerate([3, 9, 17, 24, 33, 40, 51, 64][:n]):
        head = shared[: length // 2] if i % 2 else []
        prompts.append(head + [rng.randrange(vocab) for _ in range(length - len(head))])
    return prompts


def vocab_of(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


@pytest.fixture(params=["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def model_dir(request) -> Path:
    return request.getfixturevalue(request.param)


def test_greedy_matches_hf_with_8_prompts_in_flight(model_dir: Path):
    prompts = make_prompts(vocab_of(model_dir))
    ref = hf_greedy(model_dir, prompts, MAX_TOKENS)
    out, _ = run_greedy(model_dir, prompts)
    assert out == ref


def test_same_output_without_prefix_cache_with_preemption_and_chunking(tiny_llama: Path):
    prompts = make_prompts(vocab_of(tiny_llama))
    ref, _ = run_greedy(tiny_llama, prompts)
    out, _ = run_greedy(tiny_llama, prompts, prefix_caching=False)
    assert out == ref
    # 24 blocks of 4 tokens: far fewer than 8 requests of up to 80 tokens need at once.
    out, core = run_greedy(tiny_llama, prompts, block_size=4, num_blocks=24)
    assert core.scheduler.num_preempted_total > 0
    assert out == ref
    out, _ = run_greedy(tiny_llama, prompts, max_num_batched_tokens=7)
    assert out == ref


def test_repeated_prompt_hits_prefix_cache(tiny_qwen2: Path):
    prompt = make_prompts(vocab_of(tiny_qwen2))[7]  # 64 tokens
    core = make_core(tiny_qwen2)
    results = []
    for i in range(2):
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        core.add_request(EngineCoreRequest(f"r{i}", prompt, params))
        toks, cached = [], None
        while core.scheduler.has_requests:
            for out in core.step():
                toks += out.new_token_ids
                cached = out.num_cached_tokens
        results.append((toks, cached))
    assert results[0][1] == 0
    assert results[1][1] == 48  # 3 of 4 full blocks: the last prompt token is always computed
    assert results[0][0] == results[1][0]


def test_seeded_sampling_is_reproducible_across_batches(tiny_llama: Path):
    prompts = make_prompts(vocab_of(tiny_llama))
    core = make_core(tiny_llama)

    def sample(batch: list[int], tag: str) -> dict[int, list[int]]:
        reqs = {
            f"{tag}{i}": (
                prompts[i],
                SamplingParams(
                    temperature=1.0, top_p=0.9, seed=1234 + i, max_tokens=12, ignore_eos=True
                ),
            )
            for i in batch
        }
        outs, _ = run_to_end(core, reqs)
        return {int(k[len(tag) :]): v for k, v in outs.items()}

    alone = sample([3], "a")
    together = sample(list(range(8)), "b")
    assert together[3] == alone[3]
    assert len({tuple(v) for v in together.values()}) > 1
    again = sample([5, 3], "c")
    assert again[3] == alone[3] and again[5] == together[5]


def test_invalid_requests_fail_with_an_error_output(tiny_llama: Path):
    core = make_core(tiny_llama, num_blocks=8, block_size=4)  # max_model_len capped at 32 tokens
    assert core.max_model_len == 32
    params = SamplingParams(max_tokens=4)
    for req_id, prompt in [("empty", []), ("long", [1] * 32), ("oov", [vocab_of(tiny_llama)])]:
        (out,) = core.add_request(EngineCoreRequest(req_id, prompt, params))
        assert out.finish_reason == FinishReason.ERROR and out.error
    assert not core.scheduler.has_requests

"""--batch-invariant: a request's logprobs are bitwise the same whatever else is in the batch.

A "needle" prompt runs alone, then at a random place among 0 to 63 other requests (random
lengths, greedy and sampled, some sharing its first tokens), with its prompt chunked by 8, 64 or
whole, its prefix cached or not: over 24 trials its text and every logprob (with the top 3) are
identical to the first run's. The same trials with the mode off find differences, so the test
can fail. tp 2 is in tests/integration/test_parallel.py.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from enginecore.config import CacheConfig, Config, ModelConfig, SchedulerConfig
from enginecore.core import EngineCore
from enginecore.executor import InProcExecutor
from enginecore.messages import EngineCoreRequest, SamplingParams
from tests.conftest import IN_PROCESS_KV_CACHE_GIB
from tests.unit.test_engine_inproc import vocab_of

CHUNKS = (8, 64, 2048)


def make_core(model_dir: Path, invariant: bool, chunk: int, **model: object) -> EngineCore:
    config = Config(
        model=ModelConfig(path=str(model_dir), dtype="float32", batch_invariant=invariant, **model),
        cache=CacheConfig(block_size=16, kv_cache_memory_gib=IN_PROCESS_KV_CACHE_GIB),
        scheduler=SchedulerConfig(max_num_batched_tokens=chunk, max_num_seqs=64),
    )
    return EngineCore(config, InProcExecutor(config))


def needle_runs(model_dir: Path, invariant: bool, trials: int) -> list[tuple]:
    """The needle's (tokens, logprobs, top logprobs) in each trial."""
    vocab = vocab_of(model_dir)
    rng = random.Random(1)
    needle = [rng.randrange(3, vocab) for _ in range(45)]
    cores = {chunk: make_core(model_dir, invariant, chunk) for chunk in CHUNKS}
    runs = []
    try:
        for trial in range(trials):
            core = cores[CHUNKS[trial % len(CHUNKS)]]
            if trial == 0 or rng.random() < 0.5:
                core.scheduler.kv.reset_prefix_cache()  # a miss; else its prefix is cached
            n = 0 if trial == 0 else rng.randrange(0, 64)
            batch = []
            for i in range(n):
                prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 90))]
                if rng.random() < 0.2:  # shares the needle's first blocks
                    prompt = needle[: rng.randrange(16, 45)] + prompt
                params = SamplingParams(
                    temperature=rng.choice([0.0, 0.8]), max_tokens=rng.randrange(1, 20),
                    ignore_eos=True,
                )  # fmt: skip
                batch.append(EngineCoreRequest(f"t{trial}.{i}", prompt, params))
            mine = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
            batch.insert(rng.randrange(0, n + 1), EngineCoreRequest(f"needle{trial}", needle, mine))
            for req in batch:
                assert core.add_request(req) == []
            tokens, logprobs, tops = [], [], []
            for _ in range(10_000):
                if not core.scheduler.has_requests:
                    break
                for out in core.step():
                    if out.request_id == f"needle{trial}":
                        tokens += out.new_token_ids
                        logprobs += out.new_logprobs.logprobs
                        tops += out.new_logprobs.top_logprobs
            runs.append((tokens, logprobs, tops))
    finally:
        for core in cores.values():
            core.shutdown()
    return runs


def test_needle_is_bitwise_the_same_in_any_batch(tiny_llama: Path) -> None:
    runs = needle_runs(tiny_llama, invariant=True, trials=24)
    assert len(runs[0][0]) == 12
    assert all(run == runs[0] for run in runs)  # float ==: bitwise
    off = needle_runs(tiny_llama, invariant=False, trials=9)
    assert any(run != off[0] for run in off)  # the default kernels depend on the batch


@pytest.mark.parametrize("arch", ["tiny_qwen3", "tiny_gemma3"])
def test_other_families(arch: str, request: pytest.FixtureRequest) -> None:
    """q/k norms (Qwen3); sliding windows in a KV-cache group of their own, softcapping and
    norms in float32 (Gemma 3)."""
    runs = needle_runs(request.getfixturevalue(arch), invariant=True, trials=9)
    assert all(run == runs[0] for run in runs)


def test_refusals(tiny_qwen3_moe: Path) -> None:
    with pytest.raises(ValueError, match="float32"):
        ModelConfig(path="x", dtype="bfloat16", batch_invariant=True)
    with pytest.raises(ValueError, match="unquantized"):
        ModelConfig(path="x", quantization="int8", batch_invariant=True)
    with pytest.raises(ValueError, match="expert or linear-attention"):
        make_core(tiny_qwen3_moe, True, 2048)

"""Logprobs, prompt logprobs and penalties at --tp 2 --pp 2 (gloo, real worker processes): the same
tokens and logprobs as one in-process rank. Prompt logprobs run extra LM-head rows, a collective
every last-stage rank must join; the new fields cross the step broadcast and the reply socket.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from enginecore.config import SchedulerConfig
from enginecore.core import EngineCore
from enginecore.executor import MultiprocExecutor
from enginecore.messages import SamplingParams
from tests.integration.test_parallel import parallel_config
from tests.unit.test_engine_inproc import make_core, make_prompts, vocab_of
from tests.unit.test_sampling_engine import run

pytestmark = pytest.mark.timeout(600)


def test_logprobs_and_penalties_at_tp2_pp2_match_one_rank(tiny_llama: Path) -> None:
    prompts = make_prompts(vocab_of(tiny_llama))[2:7]
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, repetition_penalty=0.8,
                       frequency_penalty=-0.5, logprobs=0),
        SamplingParams(seed=9, max_tokens=6, ignore_eos=True, logit_bias={5: 4.0}, min_tokens=3),
    ]  # fmt: skip
    requests = {f"r{i}": (p, kinds[i % len(kinds)]) for i, p in enumerate(prompts)}
    ref = run(make_core(tiny_llama, max_num_batched_tokens=16), requests)
    config = parallel_config(tiny_llama, 2, 2).replace(
        scheduler=SchedulerConfig(max_num_batched_tokens=16)  # prompts in several chunks
    )
    core = EngineCore(config, MultiprocExecutor(config))
    try:
        got = run(core, requests)
    finally:
        core.shutdown()
    for req_id, r in ref.items():
        g = got[req_id]
        assert g.tokens == r.tokens
        assert g.all_logprobs.token_ids == r.all_logprobs.token_ids
        assert g.all_logprobs.logprobs == pytest.approx(r.all_logprobs.logprobs, abs=1e-4)
        if r.prompt_logprobs is not None:
            assert g.prompt_logprobs is not None
            assert g.prompt_logprobs.token_ids == r.prompt_logprobs.token_ids
            assert g.prompt_logprobs.logprobs == pytest.approx(r.prompt_logprobs.logprobs, abs=1e-4)
            assert g.prompt_logprobs.top_token_ids == r.prompt_logprobs.top_token_ids

"""Sampling parameters through EngineCore + InProcExecutor (scheduler, prefix cache, model runner,
sampler) against Hugging Face in fp32: logprobs and prompt logprobs are log_softmax of HF's logits;
repetition, frequency and presence penalties give what HF's RepetitionPenaltyLogitsProcessor and
OpenAI's formula give on HF's logits; logit_bias, allowed_token_ids and min_tokens do what they say;
seeded samples do not depend on their neighbours, and parallel samples share the prompt's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, RepetitionPenaltyLogitsProcessor

from enginecore.core import EngineCore
from enginecore.messages import (
    Codec,
    EngineCoreOutput,
    EngineCoreRequest,
    ExecuteModel,
    FinishReason,
    Logprobs,
    ModelRunnerOutput,
    PromptLogprobs,
    SamplingParams,
    ScheduledRequest,
    SchedulerOutput,
    WorkerCall,
    WorkerReply,
    WorkerResult,
)
from tests.unit.test_engine_inproc import make_core, make_prompts, vocab_of

MAX_TOKENS = 8


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] = field(default_factory=list)
    prompt_logprobs: Logprobs | None = None
    finish: FinishReason | None = None
    num_cached: int = 0

    @property
    def all_logprobs(self) -> Logprobs:
        return Logprobs.concat(self.logprobs)


def run(core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for req_id, (prompt, params) in requests.items():
        assert core.add_request(EngineCoreRequest(req_id, prompt, params)) == []
    results = {req_id: Result() for req_id in requests}
    for _ in range(10_000):
        if not core.scheduler.has_requests:
            break
        for out in core.step():
            r = results[out.request_id]
            r.tokens += out.new_token_ids
            assert (out.new_logprobs is not None) == (
                requests[out.request_id][1].logprobs is not None
            )
            if out.new_logprobs is not None:
                r.logprobs.append(out.new_logprobs)
            if out.prompt_logprobs is not None:
                assert r.prompt_logprobs is None, "prompt logprobs come once"
                r.prompt_logprobs = out.prompt_logprobs
            r.num_cached = out.num_cached_tokens
            r.finish = out.finish_reason or r.finish
    assert not core.scheduler.has_requests
    return results


@pytest.fixture(scope="module")
def hf(tiny_llama: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def hf_logprobs(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """(len(ids), V): row i is the distribution of token i + 1."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kw)


# --------------------------------------------------------------------------- logprobs


def assert_logprobs_match(ours: Logprobs, ref: torch.Tensor, tokens: list[int], k: int) -> None:
    """ours: positions whose distributions are ref's rows (P, V) and whose tokens are `tokens`."""
    assert ours.token_ids == tokens and ours.num_top == k
    assert len(ours.top_token_ids) == len(ours.top_logprobs) == k * len(tokens)
    expected = ref.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(ours.logprobs), expected, atol=1e-3, rtol=0)
    for i, row in enumerate(ref):
        c = expected[i]
        # The rank up to near-ties, which fp32 differences may order either way.
        assert int((row > c + 1e-3).sum()) + 1 <= ours.ranks[i] <= int((row >= c - 1e-3).sum())
        top = ours.top(i)
        values = torch.tensor([v for _, v in top])
        torch.testing.assert_close(values, row.topk(k).values, atol=1e-3, rtol=0)
        # Each top id has the value HF gives that id: these are the k most likely tokens.
        torch.testing.assert_close(values, row[[t for t, _ in top]], atol=1e-3, rtol=0)


@pytest.mark.parametrize("chunk", [2048, 7], ids=["one-chunk", "chunked-prefill"])
def test_logprobs_and_prompt_logprobs_match_hf(tiny_llama: Path, hf, chunk: int) -> None:
    prompts = make_prompts(vocab_of(tiny_llama))[:6]  # 3 to 40 tokens, half with a shared prefix
    core = make_core(tiny_llama, block_size=4, max_num_batched_tokens=chunk)
    # Put the shared prefix in the prefix cache: prompt logprobs must still cover every position.
    run(core, {"warm": (prompts[5], greedy())})
    params = greedy(logprobs=5, prompt_logprobs=3)
    plain = greedy(logprobs=0)  # the sampled token's logprob only
    requests = {f"r{i}": (p, params if i % 2 else plain) for i, p in enumerate(prompts)}
    requests["r5"] = (prompts[5], params)
    results = run(core, requests)
    for req_id, (prompt, p) in requests.items():
        r = results[req_id]
        n = len(prompt)
        ref = hf_logprobs(hf, prompt + r.tokens[:-1])
        assert r.tokens == ref[n - 1 :].argmax(-1).tolist()  # greedy
        assert_logprobs_match(r.all_logprobs, ref[n - 1 :], r.tokens, p.logprobs)
        assert all(rank == 1 for rank in r.all_logprobs.ranks)
        if p.prompt_logprobs is None:
            assert r.prompt_logprobs is None
            continue
        assert r.num_cached == 0  # the prefix cache was bypassed
        assert r.prompt_logprobs is not None
        assert_logprobs_match(r.prompt_logprobs, ref[: n - 1], prompt[1:], 3)


def test_prompt_logprobs_survive_preemption(tiny_llama: Path, hf) -> None:
    prompts = make_prompts(vocab_of(tiny_llama))
    core = make_core(tiny_llama, block_size=4, num_blocks=24, max_num_batched_tokens=16)
    params = greedy(logprobs=2, prompt_logprobs=2)
    results = run(core, {f"r{i}": (p, params) for i, p in enumerate(prompts)})
    assert core.scheduler.num_preempted_total > 0
    for i, prompt in enumerate(prompts):
        r = results[f"r{i}"]
        ref = hf_logprobs(hf, prompt + r.tokens[:-1])
        assert_logprobs_match(r.prompt_logprobs, ref[: len(prompt) - 1], prompt[1:], 2)
        assert_logprobs_match(r.all_logprobs, ref[len(prompt) - 1 :], r.tokens, 2)


# --------------------------------------------------------------------------- penalties


def hf_penalized_greedy(
    hf: torch.nn.Module,
    prompt: list[int],
    rep: float,
    freq: float,
    pres: float,
    num_tokens: int = MAX_TOKENS,
) -> list[int]:
    """The reference loop: HF's processor for the repetition penalty, OpenAI's formula for the
    frequency and presence penalties (over output tokens), on HF's logits."""
    processor = RepetitionPenaltyLogitsProcessor(rep) if rep != 1.0 else None
    out: list[int] = []
    for _ in range(num_tokens):
        ids = torch.tensor([prompt + out])
        with torch.no_grad():
            logits = hf(ids).logits[:, -1].float()  # (1, V)
        if processor is not None:
            logits = processor(ids, logits)
        counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=logits.size(-1))
        logits = logits - freq * counts - pres * (counts > 0).float()
        out.append(int(logits.argmax()))
    return out


# NOTE: a tiny random model never repeats a token within a few greedy steps: positive frequency
# and presence penalties change nothing there, so most cases reward repeats instead (negative
# values, a repetition penalty below 1), and the prompts start with the token greedy would pick
# first, which a repetition penalty above 1 pushes away.
@pytest.mark.parametrize(
    ("rep", "freq", "pres"),
    [(1.5, 0.0, 0.0), (0.7, 0.0, 0.0), (1.0, -1.5, 0.0), (1.0, 0.0, -2.0), (1.2, -1.0, 0.5)],
)
def test_penalties_match_hf_logits_processors(
    tiny_llama: Path, hf, rep: float, freq: float, pres: float
) -> None:
    prompts = [
        [hf_penalized_greedy(hf, p, 1.0, 0.0, 0.0, 1)[0], *p]
        for p in make_prompts(vocab_of(tiny_llama))[2:6]
    ]
    core = make_core(tiny_llama, block_size=4)
    # The same prompts go first, so the penalized requests find their prompts in the prefix cache:
    # the worker learns those tokens only from the history the engine core sends.
    plain = run(core, {f"w{i}": (p, greedy()) for i, p in enumerate(prompts)})
    params = greedy(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)
    results = run(core, {f"r{i}": (p, params) for i, p in enumerate(prompts)})
    assert min(results[f"r{i}"].num_cached for i in range(len(prompts))) > 0
    expected = [hf_penalized_greedy(hf, p, rep, freq, pres) for p in prompts]
    assert [results[f"r{i}"].tokens for i in range(len(prompts))] == expected
    # The penalty changed something, or this test could not fail.
    assert expected != [plain[f"w{i}"].tokens for i in range(len(prompts))]


def test_penalties_survive_preemption_and_chunking(tiny_llama: Path, hf) -> None:
    prompts = make_prompts(vocab_of(tiny_llama))
    core = make_core(tiny_llama, block_size=4, num_blocks=24, max_num_batched_tokens=11)
    params = greedy(repetition_penalty=0.8, frequency_penalty=-0.5, presence_penalty=0.3)
    results = run(core, {f"r{i}": (p, params) for i, p in enumerate(prompts)})
    assert core.scheduler.num_preempted_total > 0
    for i, prompt in enumerate(prompts):
        assert results[f"r{i}"].tokens == hf_penalized_greedy(hf, prompt, 0.8, -0.5, 0.3)


# --------------------------------------------------------------------------- bias, allowed, min


def test_logit_bias_forbids_and_forces_a_token(tiny_llama: Path) -> None:
    prompt = make_prompts(vocab_of(tiny_llama))[4]
    core = make_core(tiny_llama)
    base = run(core, {"base": (prompt, greedy())})["base"].tokens
    forbidden = base[0]
    forced = next(t for t in range(3, 100) if t not in base)
    results = run(
        core,
        {
            "forbid": (prompt, greedy(logit_bias={forbidden: -100.0})),
            "force": (prompt, greedy(logit_bias={forced: 100.0})),
            "sampled": (
                prompt,
                SamplingParams(seed=3, max_tokens=MAX_TOKENS, logit_bias={forced: 100.0}),
            ),
            "neighbour": (prompt, greedy()),
        },
    )
    assert forbidden not in results["forbid"].tokens and results["forbid"].tokens != base
    assert results["force"].tokens == [forced] * MAX_TOKENS
    assert results["sampled"].tokens == [forced] * MAX_TOKENS
    assert results["neighbour"].tokens == base  # the bias is per request


def test_allowed_token_ids(tiny_llama: Path, hf) -> None:
    prompt = make_prompts(vocab_of(tiny_llama))[3]
    core = make_core(tiny_llama)
    allowed = [11, 12, 13]
    sampled = SamplingParams(seed=5, max_tokens=MAX_TOKENS, allowed_token_ids=allowed)
    results = run(
        core,
        {"greedy": (prompt, greedy(allowed_token_ids=allowed)), "sampled": (prompt, sampled)},
    )
    assert set(results["sampled"].tokens) <= set(allowed)
    tokens = results["greedy"].tokens
    # Greedy among the allowed tokens: the best of them by HF's logits at every position.
    ref = hf_logprobs(hf, prompt + tokens[:-1])[len(prompt) - 1 :]
    assert tokens == [allowed[int(i)] for i in ref[:, allowed].argmax(-1)]
    assert tokens != ref.argmax(-1).tolist()


def test_min_tokens_holds_off_eos_and_stop_tokens(tiny_llama: Path) -> None:
    prompt = make_prompts(vocab_of(tiny_llama))[5]
    core = make_core(tiny_llama)
    base = run(core, {"base": (prompt, greedy())})["base"].tokens
    eos = base[0]

    def params(**kw) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **kw)

    results = run(
        core,
        {
            "eos": (prompt, params(eos_token_ids=[eos])),
            "eos_min": (prompt, params(eos_token_ids=[eos], min_tokens=4)),
            "stop_min": (prompt, params(stop_token_ids=[eos], min_tokens=5)),
        },
    )
    assert results["eos"].tokens == [eos] and results["eos"].finish == FinishReason.STOP
    for name, n in (("eos_min", 4), ("stop_min", 5)):
        tokens = results[name].tokens
        assert len(tokens) > n and eos not in tokens[:n]
        # Afterwards the token stops the request again, or it ran to max_tokens.
        assert (tokens[-1] == eos) == (results[name].finish == FinishReason.STOP)
        assert eos not in tokens[:-1]


# --------------------------------------------------------------------------- parallel samples


def test_seeded_parallel_samples_are_reproducible_and_share_the_prompt(tiny_llama: Path) -> None:
    prompts = make_prompts(vocab_of(tiny_llama))
    prompt = prompts[7]  # 64 tokens: 4 full blocks of 16
    core = make_core(tiny_llama)

    def samples(tag: str, order: list[int], neighbours: list[int]) -> dict[int, Result]:
        reqs = {
            f"{tag}{i}": (prompt, SamplingParams(seed=1000 + i, max_tokens=10, ignore_eos=True))
            for i in order
        }
        for j in neighbours:
            reqs[f"{tag}n{j}"] = (prompts[j], SamplingParams(temperature=0.8, seed=j, max_tokens=6))
        results = run(core, reqs)
        return {i: results[f"{tag}{i}"] for i in order}

    together = samples("a", [0, 1, 2, 3], [])
    # The four arrive together: one computes the prompt, the others reuse its full blocks.
    assert sorted(r.num_cached for r in together.values()) == [0, 48, 48, 48]
    alone = {i: samples(f"b{i}", [i], [])[i] for i in range(4)}
    mixed = samples("c", [3, 1, 0, 2], [2, 5, 6])
    for i in range(4):
        assert together[i].tokens == alone[i].tokens == mixed[i].tokens
    assert len({tuple(r.tokens) for r in together.values()}) == 4


# --------------------------------------------------------------------------- the wire


def test_new_fields_survive_the_wire() -> None:
    lp = Logprobs([5, 6], [-0.5, -1.25], [1, 3], 2, [5, 9, 2, 6], [-0.5, -0.75, -1.0, -1.25])
    assert lp.top(1) == [(2, -1.0), (6, -1.25)] and lp.slice(1, 2).token_ids == [6]
    assert Logprobs.concat([lp.slice(0, 1), Logprobs(), lp.slice(1, 2)]) == lp
    params = SamplingParams(
        seed=1, logit_bias={7: -100.0}, repetition_penalty=1.2, logprobs=2, prompt_logprobs=0
    )
    step = SchedulerOutput(
        3, [ScheduledRequest("r", [1, 2], 4, [0], 0, params, [8, 8, 8, 8, 1, 2], 4)]
    )
    call = Codec(WorkerCall)
    assert call.decode(call.encode(ExecuteModel(step))).step == step
    result = WorkerResult(
        0, ModelRunnerOutput(3, ["r"], [[5]], {"r": lp.slice(0, 1)}, {"r": PromptLogprobs(1, lp)})
    )
    reply = Codec(WorkerReply)
    assert reply.decode(reply.encode(result)) == result
    out = EngineCoreOutput("r", [5], new_logprobs=lp.slice(0, 1), prompt_logprobs=lp)
    codec = Codec(EngineCoreOutput)
    assert codec.decode(codec.encode(out)) == out

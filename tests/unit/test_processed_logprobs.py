"""--logprobs-mode processed_logprobs on the sampler path: the logprobs are those of the distribution
each token was drawn from (processors, penalties, temperature, top-k / top-p / min-p masks), equal
to references computed here from the raw logits; greedy rows follow vLLM (temperature 0: the
log_softmax of the processed logits; top_k 1: a point mass); the sampled frequencies match them.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from enginecore.config import ModelConfig
from enginecore.messages import Logprobs, SamplingParams
from frontend.cli.launch import config_from_args, make_parser
from workers.sample.logits_processors import TokenHistory
from workers.sample.logprobs import logprob_rows, sampled_logprobs_rows
from workers.sample.sampler import Sampler, SamplingTensors

torch.set_num_threads(1)
CPU = torch.device("cpu")
SAMPLER = Sampler()
NEG_INF = float("-inf")


def run(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[TokenHistory | None] | None = None,
    indices: list[int] | None = None,
    bitmasks: list[bytes | None] | None = None,
) -> tuple[list[int], torch.Tensor | None, dict[str, Logprobs]]:
    """Sampled ids, the sampler's processed logprobs (R, V) and each asking row's Logprobs (by
    its row number), as the model runner gets them in processed_logprobs mode."""
    indices = indices if indices is not None else [0] * len(params)
    t = SamplingTensors.from_params(params, indices, logits.size(-1), CPU, histories, bitmasks)
    num_tops = [p.logprobs for p in params]
    sampled, processed = SAMPLER.sample(logits, t, logprob_rows(num_tops))
    rows = sampled_logprobs_rows(logits, sampled, num_tops, processed)
    by_row = {str(i): lp for i, lp in enumerate(rows) if lp is not None}
    return sampled.tolist(), processed, by_row


def reference(
    row: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> torch.Tensor:
    """(V,) log p of tern's sampling distribution, from scratch: temperature; top-k; then top-p
    (the smallest prefix reaching top_p) and min-p (p >= min_p * p_max), both on the top-k
    distribution; renormalised; -inf outside."""
    x = row.double() / temperature
    keep = torch.ones_like(x, dtype=torch.bool)
    if top_k > 0:
        keep[:] = False
        keep[x.topk(top_k).indices] = True
    probs = x.masked_fill(~keep, NEG_INF).softmax(-1)
    order = probs.argsort(descending=True)
    mass_before = probs[order].cumsum(0) - probs[order]
    drop = torch.zeros_like(keep)
    drop[order[1:]] = mass_before[1:] >= top_p
    drop |= probs < min_p * probs.max()
    keep &= ~drop
    return x.masked_fill(~keep, NEG_INF).log_softmax(-1).float()


def check_row(got: Logprobs, token: int, ref: torch.Tensor) -> None:
    """One position's Logprobs against the reference distribution (V,)."""
    kept = int(ref.isfinite().sum())
    assert math.isfinite(ref[token]), "the sampled token must be one the mask kept"
    assert got.token_ids == [token]
    assert got.logprobs[0] == pytest.approx(float(ref[token]), abs=1e-5)
    assert got.ranks == [int((ref >= ref[token]).sum())]
    top_ids, top_lp = torch.tensor(got.top_token_ids), torch.tensor(got.top_logprobs)
    shown = min(kept, got.num_top)
    torch.testing.assert_close(top_lp[:shown], ref[top_ids[:shown]], atol=1e-5, rtol=0)
    torch.testing.assert_close(top_lp[:shown], ref.topk(shown).values, atol=1e-5, rtol=0)
    assert (top_lp[shown:] == NEG_INF).all(), "beyond the kept tokens, only masked ones"
    if got.num_top >= kept:
        assert top_lp[:kept].exp().sum().item() == pytest.approx(1.0, abs=1e-5)


def test_top_k_5_at_temperature_0_7() -> None:
    logits = torch.randn(4, 2000, generator=torch.Generator().manual_seed(0)) * 3
    params = [SamplingParams(temperature=0.7, top_k=5, logprobs=5, seed=i) for i in range(4)]
    params[3] = SamplingParams(temperature=0.7, top_k=5, logprobs=8, seed=3)  # asks beyond top_k
    sampled, processed, by_row = run(logits, params)
    assert processed is not None and processed.shape == (4, 2000)
    assert (processed.isfinite().sum(-1) == 5).all()  # the masked 1995 tokens are -inf
    for i in range(4):
        ref = reference(logits[i], 0.7, top_k=5)
        torch.testing.assert_close(processed[i], ref, atol=1e-5, rtol=0)
        check_row(by_row[str(i)], sampled[i], ref)
        top = by_row[str(i)].top_logprobs[:5]
        assert sum(math.exp(v) for v in top) == pytest.approx(1.0, abs=1e-5)
        assert set(by_row[str(i)].top_token_ids[:5]) == set(logits[i].topk(5).indices.tolist())


@pytest.mark.parametrize(
    "masks",
    [
        {"top_p": 0.8},
        {"min_p": 0.05},
        {"top_k": 50, "top_p": 0.9, "min_p": 0.02},
        {},  # temperature alone: every token kept, in vocabulary order
    ],
    ids=["top_p", "min_p", "all_three", "temperature_only"],
)
def test_top_p_min_p_and_temperature(masks: dict) -> None:
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(1)) * 2
    params = [SamplingParams(temperature=0.7, logprobs=20, seed=i, **masks) for i in range(3)]
    sampled, processed, by_row = run(logits, params, indices=[5, 6, 7])
    assert processed is not None
    for i in range(3):
        ref = reference(logits[i], 0.7, **masks)
        assert torch.equal(processed[i].isfinite(), ref.isfinite())
        torch.testing.assert_close(processed[i], ref, atol=1e-5, rtol=0)
        assert processed[i][ref.isfinite()].exp().sum().item() == pytest.approx(1.0, abs=1e-5)
        check_row(by_row[str(i)], sampled[i], ref)


def test_penalties_bias_and_min_tokens_come_before_temperature_and_masks() -> None:
    vocab = 500
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(2)) * 2
    prompt, output = [3, 7, 7, 11], [int(logits[0].argmax()), 19, 19, 19]
    history = TokenHistory(prompt + output, len(prompt))
    history.extend(0, prompt + output)
    bias = {int(logits[0].argmin()): 25.0}  # the worst token becomes a candidate
    params = SamplingParams(
        temperature=0.7,
        top_k=5,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=0.4,
        logit_bias=bias,
        min_tokens=10,
        eos_token_ids=[int(logits[0].topk(2).indices[1])],
        logprobs=5,
        seed=4,
    )
    sampled, _, by_row = run(logits, [params], [history], indices=[len(output)])
    # Hugging Face's repetition penalty, OpenAI's frequency and presence penalties, the bias and
    # min_tokens' EOS ban, then tern's temperature and top-k.
    ids = torch.tensor([prompt + output])
    x = RepetitionPenaltyLogitsProcessor(1.3)(ids, logits.clone())[0]
    counts = torch.bincount(torch.tensor(output), minlength=vocab).float()
    x = x - 0.5 * counts - 0.4 * (counts > 0).float()
    for token, b in bias.items():
        x[token] += b
    x[params.eos_token_ids[0]] = NEG_INF
    ref = reference(x, 0.7, top_k=5)
    assert ref.isfinite().sum() == 5 and ref[list(bias)[0]].isfinite()
    check_row(by_row["0"], sampled[0], ref)
    assert sum(math.exp(v) for v in by_row["0"].top_logprobs) == pytest.approx(1.0, abs=1e-5)


def test_grammar_bitmask_comes_first() -> None:
    """Structured output: the tokens the grammar forbids are out before temperature and top-k."""
    vocab = 320  # ten 32-bit words
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(5)) * 2
    even_only = torch.full((vocab // 32,), 0x55555555, dtype=torch.int32).numpy().tobytes()
    params = [SamplingParams(temperature=0.7, top_k=5, logprobs=5, seed=i) for i in range(2)]
    sampled, _, by_row = run(logits, params, bitmasks=[even_only, None])
    x = logits[0].clone()
    x[1::2] = NEG_INF
    check_row(by_row["0"], sampled[0], reference(x, 0.7, top_k=5))
    assert all(t % 2 == 0 for t in by_row["0"].top_token_ids)
    check_row(by_row["1"], sampled[1], reference(logits[1], 0.7, top_k=5))


def test_greedy_rows_follow_vllm() -> None:
    """Temperature 0: log_softmax of the processed logits, no temperature, no masks (even with
    top_p set); top_k 1 at a positive temperature: a point mass on the argmax. In an all-greedy
    batch and next to a sampled row alike."""
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(3)) * 2
    allowed = list(range(0, 300, 3))
    zero_t = SamplingParams(
        temperature=0.0, top_p=0.5, allowed_token_ids=allowed, logit_bias={3: 1.5}, logprobs=4,
        seed=1,
    )  # fmt: skip
    top_one = SamplingParams(temperature=0.7, top_k=1, logprobs=3, seed=2)
    sampled_row = SamplingParams(temperature=0.9, top_p=0.9, logprobs=2, seed=3)
    x = torch.full((300,), NEG_INF)
    x[allowed] = logits[0, allowed]
    x[3] += 1.5
    zero_ref = x.log_softmax(-1)
    point_ref = torch.full((300,), NEG_INF)
    point_ref[logits[1].argmax()] = 0.0
    for batch in ([zero_t, top_one], [zero_t, top_one, sampled_row]):
        sampled, _, by_row = run(logits[: len(batch)], batch)
        assert sampled[:2] == [int(x.argmax()), int(logits[1].argmax())]
        check_row(by_row["0"], sampled[0], zero_ref)
        check_row(by_row["1"], sampled[1], point_ref)
        assert by_row["1"].logprobs == [0.0] and by_row["1"].top_logprobs[1:] == [NEG_INF] * 2
    check_row(by_row["2"], sampled[2], reference(logits[2], 0.9, top_p=0.9))


def test_mixed_batch_rows_match_their_own_and_raw_mode_is_untouched() -> None:
    """Rows computed together equal rows computed alone, whatever path the batch takes (top-k
    candidates, a full sort, vocabulary order); rows that did not ask cost nothing and get none."""
    logits = torch.randn(5, 800, generator=torch.Generator().manual_seed(4)) * 2
    params = [
        SamplingParams(temperature=0.7, top_k=5, logprobs=5, seed=1),
        SamplingParams(temperature=1.3, seed=2),  # no logprobs
        SamplingParams(temperature=0.8, top_p=0.7, logprobs=3, seed=3),
        SamplingParams(temperature=0.0, logprobs=2, seed=4),
        SamplingParams(temperature=1.1, min_p=0.1, logprobs=0, seed=5),
    ]
    sampled, processed, by_row = run(logits, params)
    assert processed is not None and processed.shape == (4, 800)
    assert sorted(by_row) == ["0", "2", "3", "4"]
    for i in (0, 2, 3, 4):
        alone_sampled, _, alone = run(logits[i : i + 1], [params[i]])
        got, want = by_row[str(i)], alone["0"]
        assert alone_sampled[0] == sampled[i]
        assert (got.token_ids, got.ranks) == (want.token_ids, want.ranks)
        assert got.top_token_ids == want.top_token_ids
        assert got.logprobs + got.top_logprobs == pytest.approx(
            want.logprobs + want.top_logprobs, abs=1e-6
        )
    # raw_logprobs: no rows asked of the sampler, the same tokens, log_softmax of the raw logits.
    t = SamplingTensors.from_params(params, [0] * 5, 800, CPU)
    raw_sampled, none = SAMPLER.sample(logits, t)
    assert none is None and raw_sampled.tolist() == sampled == SAMPLER(logits, t).tolist()
    raw = sampled_logprobs_rows(logits, raw_sampled, [p.logprobs for p in params])
    raw_ref = logits.log_softmax(-1)
    for i in (0, 2, 3, 4):
        assert raw[i].logprobs[0] == pytest.approx(float(raw_ref[i, sampled[i]]), abs=1e-6)


def test_sampled_frequencies_are_the_processed_probabilities() -> None:
    """The returned distribution is the one sampled from: 40000 draws match exp(logprobs)."""
    num = 40000
    logits = torch.log(torch.tensor([0.30, 0.25, 0.20, 0.12, 0.08, 0.05])).expand(num, -1)
    params = SamplingParams(temperature=0.7, top_p=0.85, logprobs=6, seed=7)
    t = SamplingTensors.from_params([params] * num, list(range(num)), 6, CPU)
    sampled, processed = SAMPLER.sample(logits, t, [0])
    assert processed is not None
    freq = torch.bincount(sampled, minlength=6).float() / num
    expected = processed[0].exp()
    assert (freq[expected == 0] == 0).all() and (expected == 0).sum() == 2
    # Binomial standard error is at most 0.0025 at n=40000; 0.01 is 4 sigma.
    torch.testing.assert_close(freq, expected, atol=0.01, rtol=0)


def test_flag_builds_the_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")

    def mode(*argv: str) -> str:
        args = make_parser().parse_args(["launch", "--model", str(tmp_path), *argv])
        return config_from_args(args).model.logprobs_mode

    assert mode() == "raw_logprobs"  # vLLM's default
    assert mode("--logprobs-mode", "processed_logprobs") == "processed_logprobs"
    with pytest.raises(SystemExit):
        mode("--logprobs-mode", "processed_logits")
    with pytest.raises(ValueError, match="--logprobs-mode"):
        ModelConfig(path="/m", logprobs_mode="raw")

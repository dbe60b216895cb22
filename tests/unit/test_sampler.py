"""The sampler: greedy rows, masks that keep the right tokens with the right probabilities, and
noise that depends only on (seed, sample index, token id)."""

from __future__ import annotations

import pytest
import torch

from enginecore.messages import SamplingParams
from workers.sample.sampler import Sampler, SamplingTensors

torch.set_num_threads(1)
CPU = torch.device("cpu")
SAMPLER = Sampler()


def sample(logits: torch.Tensor, params: list[SamplingParams], indices: list[int]) -> list[int]:
    t = SamplingTensors.from_params(params, indices, logits.size(-1), CPU)
    return SAMPLER(logits, t).tolist()


def test_seeded_samples_do_not_depend_on_the_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=gen) * 2
    params = [SamplingParams(temperature=1.0, seed=s) for s in (11, 12, 13, 14, 15, 16)]
    params[2] = SamplingParams(temperature=0.7, top_p=0.9, seed=13)
    params[4] = SamplingParams(temperature=1.2, top_k=40, min_p=0.01, seed=15)
    indices = [0, 5, 3, 17, 2, 9]
    batch = sample(logits, params, indices)
    alone = [sample(logits[i : i + 1], [params[i]], [indices[i]])[0] for i in range(6)]
    order = [4, 1, 5, 0, 3, 2]
    shuffled = sample(logits[order], [params[i] for i in order], [indices[i] for i in order])
    # Another batch: the same requests next to a greedy row and a top-k-only row.
    extra = [SamplingParams(temperature=0.0, seed=1), SamplingParams(top_k=3, seed=2)]
    mixed = sample(torch.cat([logits, logits[:2]]), params + extra, indices + [0, 0])
    assert batch == alone == [batch[i] for i in range(6)]
    assert shuffled == [batch[i] for i in order]
    assert mixed[:6] == batch
    # The noise really varies with the seed and with the sample index.
    draws = {tuple(sample(logits, [SamplingParams(seed=s)] * 6, indices)) for s in range(20)}
    assert len(draws) > 15
    by_index = {tuple(sample(logits, params, [i] * 6)) for i in range(20)}
    assert len(by_index) > 15


def test_temperature_zero_and_top_k_one_are_argmax() -> None:
    logits = torch.randn(32, 500, generator=torch.Generator().manual_seed(1)) * 3
    argmax = logits.argmax(-1).tolist()
    assert (
        sample(
            logits, [SamplingParams(temperature=0.0, seed=i) for i in range(32)], list(range(32))
        )
        == argmax
    )
    assert (
        sample(
            logits,
            [SamplingParams(temperature=1.5, top_k=1, seed=i) for i in range(32)],
            list(range(32)),
        )
        == argmax
    )
    # Mixed with sampled rows, greedy rows still take the argmax.
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i) for i in range(32)]
    got = sample(logits, params, [0] * 32)
    assert got[1::2] == argmax[1::2]
    assert got[0::2] != argmax[0::2]


def test_unseeded_request_is_rejected() -> None:
    with pytest.raises(ValueError, match="seed"):
        sample(torch.zeros(1, 10), [SamplingParams(temperature=1.0)], [0])


LOGITS = torch.log(torch.tensor([0.30, 0.25, 0.20, 0.12, 0.08, 0.05]))


def _expected(probs: list[float]) -> torch.Tensor:
    p = torch.tensor(probs)
    return p / p.sum()


@pytest.mark.parametrize(
    "params, expected",
    [
        (SamplingParams(), _expected([0.30, 0.25, 0.20, 0.12, 0.08, 0.05])),
        (SamplingParams(top_k=3), _expected([0.30, 0.25, 0.20, 0, 0, 0])),
        # top_p 0.7: 0.30 + 0.25 = 0.55 < 0.7, + 0.20 = 0.75 reaches it -> three tokens.
        (SamplingParams(top_p=0.7), _expected([0.30, 0.25, 0.20, 0, 0, 0])),
        (SamplingParams(top_p=0.5), _expected([0.30, 0.25, 0, 0, 0, 0])),
        # min_p 0.3: tokens below 0.3 * 0.30 = 0.09 go.
        (SamplingParams(min_p=0.3), _expected([0.30, 0.25, 0.20, 0.12, 0, 0])),
        # top_k 4 renormalises to [.345, .287, .230, .138]; top_p 0.6 keeps two.
        (SamplingParams(top_k=4, top_p=0.6), _expected([0.30, 0.25, 0, 0, 0, 0])),
        # Temperature 2 flattens: p ~ sqrt(p).
        (
            SamplingParams(temperature=2.0),
            _expected([0.30**0.5, 0.25**0.5, 0.20**0.5, 0.12**0.5, 0.08**0.5, 0.05**0.5]),
        ),
    ],
    ids=["plain", "top_k", "top_p", "top_p_small", "min_p", "top_k_top_p", "temperature"],
)
def test_masks_and_temperature_give_the_right_distribution(params, expected) -> None:
    num = 40000
    params = SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        seed=99,
    )
    # One request sampling 40000 output tokens: the sample index alone varies the noise.
    tokens = torch.tensor(sample(LOGITS.expand(num, -1), [params] * num, list(range(num))))
    freq = torch.bincount(tokens, minlength=6).float() / num
    assert (freq[expected == 0] == 0).all()
    # Binomial standard error at p=0.3 and n=40000 is 0.0023; 0.01 is over 4 sigma.
    torch.testing.assert_close(freq, expected, atol=0.01, rtol=0)


@pytest.mark.parametrize("vocab", [100, 49152])
def test_grammar_bitmask_native_and_torch_paths_agree(vocab: int, monkeypatch) -> None:
    """The native kernel and the torch fallback forbid exactly the tokens whose bit is clear."""
    from workers.kernels import sampling_ops
    from workers.sample import logits_processors

    g = torch.Generator().manual_seed(0)
    words = torch.randint(-(2**31), 2**31 - 1, (3, (vocab + 31) // 32), generator=g)
    words = words.to(torch.int32)
    words[0, 1] = 0  # a whole word forbidden
    words[1, 0] = -1  # a whole word allowed
    rows = [0, 2, 3]
    logits = torch.randn(4, vocab, generator=g)
    expected = logits.clone()
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    expected[rows] = expected[rows].masked_fill(bits.view(3, -1)[:, :vocab] == 0, float("-inf"))
    out = logits.clone()
    logits_processors.apply_grammar_bitmask(out, words, rows)
    assert torch.equal(out, expected)
    monkeypatch.setattr(sampling_ops, "apply_token_bitmask", lambda *args: False)
    out = logits.clone()
    logits_processors.apply_grammar_bitmask(out, words, rows)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("per_row_ids", [False, True])
def test_noise_kernel_and_torch_paths_agree(per_row_ids: bool, monkeypatch) -> None:
    """The noise is the same float32 bits from tern's kernel and from the torch expression (keys
    and ids up to 2^32 - 1, the vocabulary's ids shared or each row's own candidates)."""
    from workers.kernels import kernel_library, sampling_ops
    from workers.sample import sampler

    if kernel_library.load() is None:
        pytest.skip("kernels off")
    g = torch.Generator().manual_seed(0)
    keys = torch.randint(0, 2**32, (5,), generator=g, dtype=torch.int64)
    keys[0] = 2**32 - 1
    ids = (
        torch.randint(0, 2**31, (5, 300), generator=g, dtype=torch.int64)
        if per_row_ids
        else torch.arange(49152, dtype=torch.int64)
    )
    fast = sampler.exponential_noise(keys, ids)
    monkeypatch.setattr(sampling_ops, "exponential_uniforms", lambda *args: None)
    slow = sampler.exponential_noise(keys, ids)
    assert fast.shape == slow.shape == (5, ids.size(-1))
    assert torch.equal(fast, slow)


def _kept_ids(logits: torch.Tensor, params: list[SamplingParams]) -> list[set[int]]:
    from workers.sample import sampler

    t = SamplingTensors.from_params(params, list(range(len(params))), logits.size(-1), CPU)
    values, ids = sampler.masked_candidates(logits / t.temperature[:, None], t)
    ids = ids.expand_as(values)
    return [set(ids[r][values[r] > float("-inf")].tolist()) for r in range(len(params))]


def _reference_kept(row: torch.Tensor, p: SamplingParams) -> set[int]:
    """vLLM's order of masks, one row at a time over the whole sorted vocabulary: top-k,
    renormalise, top-p (the smallest prefix reaching it), min-p."""
    values, ids = (row / p.temperature).double().sort(descending=True)
    k = p.top_k if p.top_k > 0 else row.numel()
    values, ids = values[:k], ids[:k]
    probs = values.softmax(-1)
    keep = torch.ones(k, dtype=torch.bool)
    if p.top_p < 1.0:
        keep &= probs.cumsum(-1) - probs < p.top_p
    keep[0] = True
    if p.min_p > 0.0:
        keep &= probs >= p.min_p * probs[0]
    return set(ids[keep].tolist())


MASKS = [
    dict(top_p=0.9),
    dict(top_p=0.5, temperature=0.7),
    dict(top_p=0.999),  # keeps past the first candidates: the rows are sorted whole
    dict(min_p=0.05),
    dict(min_p=0.001, temperature=1.5),
    dict(top_k=40, top_p=0.8),
    dict(top_k=3000, top_p=0.9),  # a top-k past the first candidates
    dict(top_k=20),
]


def test_masks_over_a_large_vocabulary_keep_what_vllm_keeps(monkeypatch) -> None:
    """top-k, top-p and min-p over 49152 tokens keep vLLM's tokens (distinct logits), whether the
    candidates come from the first 1025 or the whole sort, each row alone or in a batch."""
    from workers.sample import sampler

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(MASKS), 49152, generator=g) * 3
    logits[1] *= 3  # a peaked row
    params = [SamplingParams(seed=i, **kw) for i, kw in enumerate(MASKS)]
    expected = [_reference_kept(logits[r], p) for r, p in enumerate(params)]
    # floats near a top-p boundary may round either way: at most a token or two apart
    batch = _kept_ids(logits, params)
    for got, want in zip(batch, expected):
        assert len(got ^ want) <= 2 and len(got & want) >= len(want) - 1
    alone = [_kept_ids(logits[r : r + 1], [p])[0] for r, p in enumerate(params)]
    assert alone == batch
    monkeypatch.setattr(sampler, "TRUNCATED_CANDIDATES", 10**9)  # always the whole sort
    assert _kept_ids(logits, params) == batch
    assert sample(logits, params, list(range(len(params)))) == [
        sample(logits[r : r + 1], [p], [r])[0] for r, p in enumerate(params)
    ]


def test_tied_logits_are_kept_or_dropped_together() -> None:
    """bfloat16-rounded logits tie by the hundreds: a cut keeps every token tied with its last
    one, so the candidates do not depend on a sort's order of ties."""
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(4, 49152, generator=g) * 2).bfloat16().float()
    params = [SamplingParams(seed=i, **kw) for i, kw in enumerate(MASKS[:4])]
    ties_at_a_cut = 0
    for r, ids in enumerate(_kept_ids(logits, params)):
        lowest = logits[r, sorted(ids)].min()
        ties_at_a_cut += int((logits[r] == lowest).sum()) > 1
        assert ids == set((logits[r] >= lowest).nonzero().flatten().tolist())
    assert ties_at_a_cut >= 2


def test_penalties_touch_only_the_seen_tokens_and_equal_the_dense_formula() -> None:
    """Repetition, frequency and presence penalties applied to the (row, token) pairs a row has
    seen give the bits of the formula over whole rows (rows without penalties, a -inf logit and
    a token seen only in the prompt among them)."""
    from workers.sample.logits_processors import TokenHistory, apply_logits_processors

    g = torch.Generator().manual_seed(2)
    vocab = 3000
    logits = torch.randn(4, vocab, generator=g) * 3
    logits[0, 7] = float("-inf")
    kinds = [
        dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=-0.5),
        dict(),
        dict(repetition_penalty=0.8),
        dict(frequency_penalty=1.0),
    ]
    params = [SamplingParams(seed=i, **kw) for i, kw in enumerate(kinds)]
    histories = []
    for _ in params:
        tokens = torch.randint(0, vocab, (200,), generator=g).tolist() + [7, 7, 5]
        history = TokenHistory(tokens, num_prompt_tokens=120)
        history.num_computed = len(tokens)
        histories.append(history)
    t = SamplingTensors.from_params(params, [0] * 4, vocab, CPU, histories=histories)
    got = apply_logits_processors(logits, t.processors)
    expected = logits.clone()
    for r, (p, h) in enumerate(zip(params, histories)):
        if not p.has_penalties:
            continue
        prompt_mask, counts = h.counters(vocab, CPU)
        row = logits[r]
        penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        row = torch.where(prompt_mask | (counts > 0), penalized, row)
        expected[r] = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
    assert torch.equal(got, expected)
    assert not torch.equal(got[0], logits[0]) and torch.equal(got[1], logits[1])

"""Speculative decoding in one process (EngineCore + InProcExecutor, tiny random models).

A verified step keeps exactly the tokens plain decoding samples (workers/spec/verification.py), so every
check compares a speculative run with a plain one: greedy and seeded sampled tokens equal token
for token (and greedy equal to Hugging Face's), logprobs within 1e-5, with chunked prefill, prefix
caching, preemption, penalties, min_tokens, logit bias, stop tokens and grammars. Random tiny models
do not repeat themselves, so besides the real drafters (whose proposals are checked on token lists
here and on the default model in tests/integration/test_spec_server.py) an oracle drafter proposes
plain decoding's own continuation with corrupted positions: every step then verifies drafts that
are accepted whole, in part, or not at all.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch

from enginecore.config import (
    CacheConfig,
    Config,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from enginecore.core import EngineCore
from enginecore.executor import InProcExecutor
from enginecore.messages import (
    EngineCoreRequest,
    FinishReason,
    SamplingParams,
    StructuredOutputKind,
    StructuredOutputSpec,
)
from enginecore.speculative import Drafter, NgramIndex, SuffixTrie
from tests.conftest import IN_PROCESS_KV_CACHE_GIB
from tests.unit.test_engine_inproc import hf_greedy, vocab_of

NGRAM = SpeculativeConfig("ngram", 5, disable_by_batch_size=64)
SUFFIX = SpeculativeConfig("suffix", 8, disable_by_batch_size=64)


def make_core(model_dir: Path, spec: SpeculativeConfig | None = None, **kw) -> EngineCore:
    config = Config(
        model=ModelConfig(
            path=str(model_dir),
            dtype="float32",
            logprobs_mode=kw.pop("logprobs_mode", "raw_logprobs"),
            batch_invariant=kw.pop("batch_invariant", False),
        ),
        cache=CacheConfig(
            block_size=kw.pop("block_size", 16),
            enable_prefix_caching=kw.pop("prefix_caching", True),
            num_gpu_blocks_override=kw.pop("num_blocks", None),
            kv_cache_memory_gib=kw.pop("kv_cache_memory_gib", IN_PROCESS_KV_CACHE_GIB),
            kv_cache_dtype=kw.pop("kv_cache_dtype", "auto"),
            state_checkpoint_interval=kw.pop("state_checkpoint_interval", None),
        ),
        scheduler=SchedulerConfig(**kw),
        speculative=spec or SpeculativeConfig(),
    )
    return EngineCore(config, InProcExecutor(config))


class Oracle:
    """Drafts plain decoding's continuation (`plain`: each request's output), each draft
    corrupted with probability `noise`; installed as the drafter's proposer, and every draft it
    proposes is verified (the drafter's plan is tested on its own below)."""

    def __init__(self, core: EngineCore, plain: dict[str, list[int]], noise: float, vocab: int):
        self.plain, self.noise, self.vocab = plain, noise, vocab
        self.rng = random.Random(0)
        self.prompt_lens: dict[str, int] = {}
        drafter = core.scheduler.drafter
        assert drafter is not None
        drafter.draft = self.draft  # type: ignore[method-assign]
        verify_every_draft(core)

    def draft(self, request_id: str, tokens: list[int], limit: int) -> list[int]:
        base = request_id.split("#")[0]  # the second round of a prompt reuses its name
        done = len(tokens) - self.prompt_lens[request_id]
        k = min(limit, self.rng.randrange(1, 7))
        drafts = list(self.plain[base][done : done + k])
        for i in range(len(drafts)):
            if self.rng.random() < self.noise:
                drafts[i] = (drafts[i] + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
        return drafts


def verify_every_draft(core: EngineCore) -> None:
    """Every proposed draft is verified (the drafter's plan is tested on its own below)."""
    drafter = core.scheduler.drafter
    assert drafter is not None
    drafter.plan = lambda proposals, _: {k: len(v) for k, v in proposals.items()}  # type: ignore[method-assign]


def run(
    core: EngineCore,
    requests: dict[str, tuple[list[int], SamplingParams]],
    oracle: Oracle | None = None,
    structured: StructuredOutputSpec | None = None,
) -> tuple[dict[str, list[int]], dict[str, list[float]], dict[str, FinishReason]]:
    """Steps to the end: each request's tokens, sampled logprobs and finish reason."""
    for req_id, (prompt, params) in requests.items():
        if oracle is not None:
            oracle.prompt_lens[req_id] = len(prompt)
        req = EngineCoreRequest(req_id, prompt, params, structured_output=structured)
        assert core.add_request(req) == []
    outs: dict[str, list[int]] = collections.defaultdict(list)
    lps: dict[str, list[float]] = collections.defaultdict(list)
    reasons: dict[str, FinishReason] = {}
    for _ in range(20_000):
        if not core.scheduler.has_requests:
            break
        for out in core.step():
            outs[out.request_id] += out.new_token_ids
            if out.new_logprobs is not None:
                assert out.new_logprobs.num_positions == len(out.new_token_ids)
                lps[out.request_id] += out.new_logprobs.logprobs
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason
    assert not core.scheduler.has_requests
    assert core.scheduler.kv.num_free_blocks == core.scheduler.kv.num_total_blocks
    return dict(outs), dict(lps), reasons


def plain_and_oracle(model_dir: Path, requests: dict, noise: float, **kw) -> tuple:
    """`requests` decoded plainly, then with the oracle drafter (drafts corrupted with
    probability `noise`) on an ngram core of the same settings: (plain's run, the speculative
    run, drafts accepted)."""
    plain_core = make_core(model_dir, **kw)
    plain = run(plain_core, requests)
    core = make_core(model_dir, SpeculativeConfig("ngram", 6, disable_by_batch_size=64), **kw)
    spec = run(core, requests, Oracle(core, plain[0], noise, vocab_of(model_dir)))
    accepted = spec_stats(core)[1]
    for c in (core, plain_core):
        c.shutdown()
    return plain, spec, accepted


def prompts_of(vocab: int, n: int = 16, seed: int = 0) -> list[list[int]]:
    """Prompts of 4 to 60 tokens, half of them repeating a short pattern (lookup finds it)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        length = rng.randrange(4, 61)
        if i % 2:
            pattern = [rng.randrange(3, vocab) for _ in range(rng.randrange(2, 7))]
            prompts.append((pattern * 61)[:length])
        else:
            prompts.append([rng.randrange(3, vocab) for _ in range(length)])
    return prompts


def half_greedy(prompts: list[list[int]], max_tokens: int, seed: int, **sampling) -> dict:
    """Requests r0, r1, ...: the odd ones greedy (with their logprobs), the even ones sampled with
    `sampling` (temperature, top-p/k) from `seed`."""
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    seeded = SamplingParams(seed=seed, max_tokens=max_tokens, ignore_eos=True, **sampling)
    return {f"r{i}": (p, greedy if i % 2 else seeded) for i, p in enumerate(prompts)}


def next_turns(first: dict, outputs: dict[str, list[int]]) -> dict:
    """Each request's prompt + output + a few tokens, greedy: a next turn whose prefix is cached."""
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    return {
        f"t{r[1:]}": ([*prompt, *outputs[r], 5, 6, 7], greedy) for r, (prompt, _) in first.items()
    }


def spec_stats(core: EngineCore) -> tuple[int, int]:
    s = core.stats()
    return s.spec_num_draft_tokens, s.spec_num_accepted_tokens


# ------------------------------------------------------------------------------------ greedy


@pytest.mark.parametrize("chunk", [2048, 7])
def test_greedy_equals_plain_and_hf(tiny_llama: Path, chunk: int) -> None:
    """16 prompts at once, then the same 16 again (prefix-cache hits), with every drafter: the
    tokens of plain decoding and of Hugging Face, logprobs within 1e-5."""
    vocab = vocab_of(tiny_llama)
    prompts = prompts_of(vocab)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
    requests = {f"r{i}": (p, params) for i, p in enumerate(prompts)}
    again = {f"r{i}#2": (p, params) for i, p in enumerate(prompts)}
    plain_core = make_core(tiny_llama, max_num_batched_tokens=chunk)
    plain, plain_lps, _ = run(plain_core, requests)
    assert [plain[f"r{i}"] for i in range(16)] == hf_greedy(tiny_llama, prompts, 24)
    for spec in (NGRAM, SUFFIX, SpeculativeConfig("ngram", 6, disable_by_batch_size=64)):
        core = make_core(tiny_llama, spec, max_num_batched_tokens=chunk)
        oracle = Oracle(core, plain, 0.2, vocab) if spec.num_speculative_tokens == 6 else None
        for reqs in (requests, again):
            outs, lps, reasons = run(core, reqs, oracle)
            assert set(reasons.values()) == {FinishReason.LENGTH}
            for req_id in reqs:
                base = req_id.split("#")[0]
                assert outs[req_id] == plain[base], (spec.method, req_id)
                assert lps[req_id] == pytest.approx(plain_lps[base], rel=1e-5, abs=1e-5)
        assert core.stats().prefix_cache_hits > 0
        drafted, accepted = spec_stats(core)
        if oracle is not None:
            assert accepted > 100  # most drafts were the right continuation
        elif spec.method == "suffix":
            # NOTE: how many it verifies is planned from measured step times (a loaded machine
            # drafts less): that drafts were accepted is what holds everywhere
            assert drafted >= accepted > 0  # the second round drafts from the first's outputs
        core.shutdown()
    plain_core.shutdown()


@pytest.mark.parametrize(
    "arch",
    ["tiny_gemma3", "tiny_mistral", "tiny_qwen3_moe", "tiny_gpt_oss", "tiny_qwen3_5", "int8_kv"],
)
def test_other_families_and_an_int8_kv_cache(arch: str, request: pytest.FixtureRequest) -> None:
    """Sliding windows in their own KV-cache groups (Gemma 3, Mistral), experts, attention sinks
    (gpt-oss) and an int8 KV cache: verified drafts give plain decoding's tokens."""
    kw = {}
    if arch == "int8_kv":
        arch, kw = "tiny_llama", {"kv_cache_dtype": "int8"}
    model_dir = request.getfixturevalue(arch)
    vocab = vocab_of(model_dir)
    prompts = prompts_of(vocab, 6, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    requests = {f"r{i}": ([*p, *p], params) for i, p in enumerate(prompts)}  # past the windows
    (plain, plain_lps, _), (outs, lps, _), accepted = plain_and_oracle(
        model_dir, requests, 0.2, **kw
    )
    assert outs == plain
    for req_id in requests:
        assert lps[req_id] == pytest.approx(plain_lps[req_id], rel=1e-5, abs=1e-5)
    assert accepted > 20


def test_hybrid_linear_attention_takes_back_rejected_drafts(tiny_qwen3_5: Path) -> None:
    """Qwen3.5's Gated DeltaNet layers carry a state from token to token: after a verification
    step it must be the state after the last kept token. Chunked prompts, greedy and seeded
    sampling, then a next turn (prompt + output + more) whose prefix-cache hit resumes from state
    checkpoints that verification steps took: plain decoding's tokens and HF's."""
    vocab = vocab_of(tiny_qwen3_5)
    prompts = prompts_of(vocab, 8, seed=8)
    first = half_greedy(prompts, 24, 3, temperature=1.0, top_p=0.9)
    kw = {"block_size": 4, "state_checkpoint_interval": 8, "max_num_batched_tokens": 7}
    plain_core = make_core(tiny_qwen3_5, **kw)
    plain, plain_lps, _ = run(plain_core, first)
    greedy_ids = [i for i in range(8) if i % 2]
    assert [plain[f"r{i}"] for i in greedy_ids] == hf_greedy(
        tiny_qwen3_5, [prompts[i] for i in greedy_ids], 24
    )
    turns = next_turns(first, plain)
    plain_turns = run(plain_core, turns)
    core = make_core(tiny_qwen3_5, SpeculativeConfig("ngram", 6, disable_by_batch_size=64), **kw)
    oracle = Oracle(core, {**plain, **plain_turns[0]}, 0.3, vocab)
    outs, lps, _ = run(core, first, oracle)
    assert outs == plain
    for req_id in first:
        assert lps.get(req_id, []) == pytest.approx(plain_lps.get(req_id, []), rel=1e-5, abs=1e-5)
    turn_outs, _, _ = run(core, turns, oracle)
    assert turn_outs == plain_turns[0]
    stats = core.stats()
    assert stats.prefix_cache_hits > 0 and spec_stats(core)[1] > 20
    for c in (core, plain_core):
        c.shutdown()


@pytest.mark.parametrize("arch", ["tiny_qwen3_5_mtp", "tiny_qwen3_5_moe_mtp"])
def test_mtp_head_drafts_from_the_served_models_hidden_states(
    arch: str, request: pytest.FixtureRequest
) -> None:
    """Speculative method mtp: the checkpoint's own multi-token-prediction head (random here:
    correctness does not depend on its quality) drafts from the served model's final hidden
    states, every draft verified. Chunked prompts, greedy and seeded sampling, a next turn from
    the prefix cache: plain decoding's tokens and logprobs. And the head itself: each step's
    first greedy draft is the argmax of a Hugging Face-built reference head run over the
    sequence so far (transformers' Qwen3.5 decoder layer with the mtp.* weights). A pool small
    enough to preempt requests mid-drafting: the same tokens. Qwen3.5-MoE's head has experts."""
    model_dir = request.getfixturevalue(arch)
    first = half_greedy(prompts_of(vocab_of(model_dir), 8, seed=9), 20, 5, temperature=0.8,
                        top_p=0.9)  # fmt: skip
    spec = SpeculativeConfig("mtp", 3, disable_by_batch_size=64)
    proposed = head_drafts_equal_plain(
        model_dir, spec, first, block_size=4, state_checkpoint_interval=8, max_num_batched_tokens=9
    )
    reference = reference_mtp_first_drafts(model_dir, [seq for seq, _ in proposed])
    assert [drafts[0] for _, drafts in proposed] == reference


def test_weight_updates_reach_the_mtp_head(tiny_qwen3_5_mtp: Path, tmp_path: Path) -> None:
    """The MTP head is part of the policy's checkpoint: an update that carries mtp.* tensors
    replaces it (here only the head changes), and the drafts that follow are the new head's."""
    from safetensors.torch import load_file, save

    from enginecore.control import EngineControl
    from enginecore.messages import UpdateWeights, UpdateWeightsFromTensors
    from tests.conftest import _load_tiny_model_module

    other = _load_tiny_model_module().add_mtp_head(tiny_qwen3_5_mtp, tmp_path / "other", seed=1)
    vocab = vocab_of(tiny_qwen3_5_mtp)
    prompts = prompts_of(vocab, 4, seed=11)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    requests = {f"r{i}": (p, greedy) for i, p in enumerate(prompts)}
    plain_core = make_core(tiny_qwen3_5_mtp)
    plain = run(plain_core, requests)[0]
    plain_core.shutdown()
    core = make_core(tiny_qwen3_5_mtp, SpeculativeConfig("mtp", 2, disable_by_batch_size=64))
    verify_every_draft(core)
    control = EngineControl(core)
    head = {k: v for k, v in load_file(other / "model.safetensors").items() if k.startswith("mtp.")}
    result = control.handle(1, UpdateWeights(UpdateWeightsFromTensors(blobs=[save(head)])), [])
    assert result is not None and not result.error
    proposed = spy_first_drafts(core, {r: [*p, *plain[r]] for r, (p, _) in requests.items()})
    assert run(core, requests)[0] == plain
    core.shutdown()
    firsts = [drafts[0] for _, drafts in proposed]
    assert firsts == reference_mtp_first_drafts(other, [seq for seq, _ in proposed])
    assert firsts != reference_mtp_first_drafts(tiny_qwen3_5_mtp, [seq for seq, _ in proposed])


def test_mtp_needs_a_checkpoint_with_its_head(tiny_llama: Path, tiny_qwen3_5: Path) -> None:
    for model_dir in (tiny_llama, tiny_qwen3_5):
        with pytest.raises(ValueError, match="mtp_num_hidden_layers"):
            make_core(model_dir, SpeculativeConfig("mtp", 2))


def reference_mtp_first_drafts(model_dir: Path, sequences: list[list[int]]) -> list[int]:
    """Qwen3.5's MTP head as released checkpoints define it, from transformers' modules: at
    each position i, fc([norm_e(embed(t_{i+1})), norm_h(h_i)]) -> the decoder layer (causal over
    positions 0..i) -> norm -> LM head; the greedy guess at the token after each sequence's
    last one (h: the served model's final hidden states)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe

    config = AutoConfig.from_pretrained(model_dir)
    moe = config.model_type.startswith("qwen3_5_moe")
    q = modeling_qwen3_5_moe if moe else modeling_qwen3_5
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    weights = load_file(model_dir / "model.safetensors")
    last_full = max(i for i, t in enumerate(config.layer_types) if t == "full_attention")
    layer = (q.Qwen3_5MoeDecoderLayer if moe else q.Qwen3_5DecoderLayer)(config, last_full)
    state = {k.removeprefix("mtp.layers.0."): v for k, v in weights.items() if "mtp.layers.0." in k}
    if moe:  # saved per expert; the module holds them stacked, gate and up fused
        n = config.num_experts
        per = [
            state.pop(f"mlp.experts.{e}.{w}_proj.weight")
            for e in range(n)
            for w in ("gate", "up", "down")
        ]
        state["mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat(per[3 * e : 3 * e + 2]) for e in range(n)]
        )
        state["mlp.experts.down_proj"] = torch.stack([per[3 * e + 2] for e in range(n)])
    layer.load_state_dict(state)
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = (q.Qwen3_5MoeRMSNorm if moe else q.Qwen3_5RMSNorm)(
            config.hidden_size, eps=config.rms_norm_eps
        )
        norms[name].weight.data.copy_(weights[f"mtp.{name}.weight"])
    fc = weights["mtp.fc.weight"]
    rotary = (q.Qwen3_5MoeTextRotaryEmbedding if moe else q.Qwen3_5TextRotaryEmbedding)(config)
    guesses = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq])
            h = model(ids, output_hidden_states=True).hidden_states[-1][:, :-1]
            e = model.model.embed_tokens(ids[:, 1:])
            x = torch.cat((norms["pre_fc_norm_embedding"](e), norms["pre_fc_norm_hidden"](h)), -1)
            x = x @ fc.t()
            positions = torch.arange(x.size(1))[None]
            mask = torch.full((x.size(1), x.size(1)), float("-inf")).triu(1)[None, None]
            out = layer(x, position_embeddings=rotary(x, positions), attention_mask=mask,
                        position_ids=positions)  # fmt: skip
            out = out[0] if isinstance(out, tuple) else out
            logits = model.lm_head(norms["norm"](out))
            guesses.append(int(logits[0, -1].argmax()))
    return guesses


def test_eagle3_head_drafts_from_three_layers_features(
    tiny_llama: Path, tiny_llama_eagle3: Path
) -> None:
    """Speculative method eagle3: a (random) EAGLE-3 head for the tiny Llama drafts from the
    residual stream before its layers 0, 1 and 2, through its own draft vocabulary, every draft
    verified: plain decoding's tokens and logprobs, chunked, cached and preempted. And the head
    itself: each step's first greedy draft is the one a plain-torch reading of the EAGLE-3 layout
    gives over the sequence so far, with the features from Hugging Face's forward."""
    first = half_greedy(prompts_of(vocab_of(tiny_llama), 8, seed=10), 20, 6, temperature=0.8,
                        top_k=40)  # fmt: skip
    spec = SpeculativeConfig("eagle3", 3, model=str(tiny_llama_eagle3), disable_by_batch_size=64)
    proposed = head_drafts_equal_plain(tiny_llama, spec, first, max_num_batched_tokens=9)
    reference = reference_eagle3_first_drafts(
        tiny_llama, tiny_llama_eagle3, [s for s, _ in proposed]
    )
    assert [drafts[0] for _, drafts in proposed] == reference


def head_drafts_equal_plain(
    model_dir: Path, spec: SpeculativeConfig, first: dict, **kw
) -> list[tuple[list[int], list[int]]]:
    """`first` and its next turns decoded plainly, then with a draft head (`spec`, every draft
    verified), and on a pool small enough to preempt mid-drafting: the same tokens and logprobs,
    prefix-cache hits, drafts made. Returns the greedy requests' drafting steps (spy_first_drafts)."""
    plain_core = make_core(model_dir, **kw)
    plain, plain_lps, _ = run(plain_core, first)
    turns = next_turns(first, plain)
    plain_turns = run(plain_core, turns)[0]
    plain_core.shutdown()
    core = make_core(model_dir, spec, **kw)
    verify_every_draft(core)
    proposed = spy_first_drafts(core, {r: [*p, *plain[r]] for r, (p, params) in first.items()
                                       if params.temperature == 0})  # fmt: skip
    outs, lps, _ = run(core, first)
    assert outs == plain
    for req_id in first:
        assert lps.get(req_id, []) == pytest.approx(plain_lps.get(req_id, []), rel=1e-5, abs=1e-5)
    assert run(core, turns)[0] == plain_turns
    assert core.stats().prefix_cache_hits > 0 and spec_stats(core)[0] > 50
    core.shutdown()
    small_pool = make_core(model_dir, spec, block_size=4, num_blocks=40)
    verify_every_draft(small_pool)
    assert run(small_pool, first)[0] == plain
    assert small_pool.scheduler.num_preempted_total > 0
    small_pool.shutdown()
    assert len(proposed) > 20
    return proposed


def spy_first_drafts(
    core: EngineCore, sequences: dict[str, list[int]]
) -> list[tuple[list[int], list[int]]]:
    """Records (the sequence up to the token a step computes, the drafts after it) for every
    drafting step of the requests in `sequences` (each one's whole known sequence)."""
    runner = core.executor.runner
    propose = runner.draft.propose
    proposed: list[tuple[list[int], list[int]]] = []

    def spy(reqs, tables, params):
        drafts = propose(reqs, tables, params)
        for r in reqs:
            if r.req_id in drafts and r.req_id in sequences:
                proposed.append((sequences[r.req_id][: r.start_pos + 1], drafts[r.req_id]))
        return drafts

    runner.draft.propose = spy
    return proposed


def reference_eagle3_first_drafts(
    target_dir: Path, head_dir: Path, sequences: list[list[int]]
) -> list[int]:
    """The EAGLE-3 layout read plainly: at position i, f = fc([s_0; s_1; s_2]) of the served
    model's residual streams before its feature layers; x = [rms(embed(t_{i+1})); rms(f)];
    causal GQA attention with rotary over positions 0..i, plus f; then the MLP branch; the final
    norm; the draft vocabulary's argmax mapped by d2t: the guess at the token after each
    sequence."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    config = json.loads((head_dir / "config.json").read_text())
    w = load_file(head_dir / "model.safetensors")
    layers = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    heads, kv_heads, d = config["num_attention_heads"], config["num_key_value_heads"], 16
    eps = config["rms_norm_eps"]

    def rms(x: torch.Tensor, name: str) -> torch.Tensor:
        return w[name] * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def rotate(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # (n, h, d), halves
        freq = 1.0 / config["rope_theta"] ** (torch.arange(0, d, 2).float() / d)
        angle = torch.cat((pos[:, None] * freq, pos[:, None] * freq), -1)[:, None]
        half = torch.cat((-x[..., d // 2 :], x[..., : d // 2]), -1)
        return x * angle.cos() + half * angle.sin()

    guesses = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq])
            streams = target(ids, output_hidden_states=True).hidden_states
            feats = torch.cat([streams[i][0, :-1] for i in layers], -1) @ w["fc.weight"].t()
            e = target.model.embed_tokens(ids[0, 1:])
            x = torch.cat((rms(e, "midlayer.input_layernorm.weight"),
                           rms(feats, "midlayer.hidden_norm.weight")), -1)  # fmt: skip
            n, pos = x.size(0), torch.arange(x.size(0)).float()
            q = rotate((x @ w["midlayer.self_attn.q_proj.weight"].t()).view(n, heads, d), pos)
            k = rotate((x @ w["midlayer.self_attn.k_proj.weight"].t()).view(n, kv_heads, d), pos)
            v = (x @ w["midlayer.self_attn.v_proj.weight"].t()).view(n, kv_heads, d)
            k, v = (t.repeat_interleave(heads // kv_heads, 1) for t in (k, v))
            scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
            scores = scores + torch.full((n, n), float("-inf")).triu(1)
            o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * d)
            stream = o @ w["midlayer.self_attn.o_proj.weight"].t() + feats
            h = rms(stream, "midlayer.post_attention_layernorm.weight")
            gate = torch.nn.functional.silu(h @ w["midlayer.mlp.gate_proj.weight"].t())
            up = h @ w["midlayer.mlp.up_proj.weight"].t()
            stream = (gate * up) @ w["midlayer.mlp.down_proj.weight"].t() + stream
            draft = int((rms(stream[-1], "norm.weight") @ w["lm_head.weight"].t()).argmax())
            guesses.append(draft + int(w["d2t"][draft]))
    return guesses


def test_batch_invariant_verification_is_bitwise_plain_decoding(tiny_llama: Path) -> None:
    """Under --batch-invariant a verification row computes exactly what the decode step of plain
    decoding does: the logprobs are equal bit for bit, not within a tolerance."""
    vocab = vocab_of(tiny_llama)
    prompts = prompts_of(vocab, 8, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)
    requests = {f"r{i}": (p, params) for i, p in enumerate(prompts)}
    (plain, plain_lps, _), (outs, lps, _), accepted = plain_and_oracle(
        tiny_llama, requests, 0.2, batch_invariant=True
    )
    assert outs == plain and lps == plain_lps
    assert accepted > 50


@pytest.mark.parametrize("draft", ["itself", "other weights"])
def test_draft_model(tiny_llama: Path, tiny_llama_perturbed: Path, draft: str) -> None:
    """method draft_model, the draft on the same worker with its own KV cache: greedy and seeded
    sampled tokens (and logprobs) are plain decoding's with 7-token prefill chunks, a second
    round from the prefix cache, and a pool small enough to preempt. The served model as its
    own draft has its drafts accepted (the draft samples with the request's noise); another
    model's much less."""
    draft_dir = tiny_llama if draft == "itself" else tiny_llama_perturbed
    vocab = vocab_of(tiny_llama)
    prompts = prompts_of(vocab, 8, seed=8)
    requests = {}
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=1, seed=i,
                                temperature=0.0 if i % 2 else 0.9, top_p=0.9)  # fmt: skip
        requests[f"r{i}"] = (p, params)
    again = {f"{k}#2": v for k, v in requests.items()}
    plain_core = make_core(tiny_llama, max_num_batched_tokens=7)
    plain, plain_lps, _ = run(plain_core, requests)
    spec = SpeculativeConfig("draft_model", 4, model=str(draft_dir), disable_by_batch_size=64)
    for kw in ({"max_num_batched_tokens": 7}, {"block_size": 4, "num_blocks": 48}):
        core = make_core(tiny_llama, spec, **kw)
        for reqs in (requests, again):
            outs, lps, _ = run(core, reqs)
            for req_id in reqs:
                base = req_id.split("#")[0]
                assert outs[req_id] == plain[base], (kw, req_id)
                assert lps[req_id] == pytest.approx(plain_lps[base], rel=1e-5, abs=1e-5)
        drafted, accepted = spec_stats(core)
        if draft == "itself":
            assert accepted > 0.9 * drafted > 0
        else:
            assert drafted > 0 and accepted < 0.9 * drafted
        if "num_blocks" in kw:
            assert core.scheduler.num_preempted_total > 0
        core.shutdown()
    plain_core.shutdown()


def test_weight_updates_reach_a_draft_model(tiny_llama: Path, tiny_llama_perturbed: Path) -> None:
    """A draft model's tensors travel in weight updates under `draft.` names (a trainer that
    trains its draft beside the policy). The other weights' drafts are mostly rejected; updated
    to the served model's own weights the draft's are accepted (>90%); an update that fails
    (a wrong shape among them) rolls the draft back with the rest. Outputs stay plain's."""
    from safetensors.torch import load_file, save

    from enginecore.control import EngineControl
    from enginecore.messages import UpdateWeights, UpdateWeightsFromTensors

    prompts = prompts_of(vocab_of(tiny_llama), 6, seed=12)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain_core = make_core(tiny_llama)
    plain = run(plain_core, {f"r{i}": (p, params) for i, p in enumerate(prompts)})[0]
    plain_core.shutdown()
    spec = SpeculativeConfig("draft_model", 4, model=str(tiny_llama_perturbed),
                             disable_by_batch_size=64)  # fmt: skip
    core = make_core(tiny_llama, spec)
    verify_every_draft(core)
    control = EngineControl(core)
    draft = core.executor.runner.draft.model

    def serve_round(tag: str) -> float:
        before = spec_stats(core)
        outs = run(core, {f"{tag}{i}": (p, params) for i, p in enumerate(prompts)})[0]
        assert [outs[f"{tag}{i}"] for i in range(len(prompts))] == list(plain.values())
        drafted, accepted = (a - b for a, b in zip(spec_stats(core), before))
        return accepted / drafted

    def update(tensors: dict) -> str | None:
        blob = save({f"draft.{k}": v for k, v in tensors.items()})
        result = control.handle(1, UpdateWeights(UpdateWeightsFromTensors(blobs=[blob])), [])
        assert result is not None
        return result.error

    assert serve_round("a") < 0.9
    own = load_file(next(tiny_llama.glob("*.safetensors")))
    assert update(own) is None
    assert serve_round("b") > 0.9
    kept = {k: v.clone() for k, v in draft.state_dict().items()}
    bad = {k: v for k, v in load_file(next(tiny_llama_perturbed.glob("*.safetensors"))).items()}
    bad["model.norm.weight"] = torch.ones(3)
    assert "model.norm.weight" in (update(bad) or "")
    assert all(torch.equal(kept[k], v) for k, v in draft.state_dict().items())
    assert serve_round("c") > 0.9
    core.shutdown()


def test_preemption_keeps_outputs(tiny_llama: Path) -> None:
    """A pool too small for the batch: requests are preempted mid-speculation and resume."""
    vocab = vocab_of(tiny_llama)
    prompts = prompts_of(vocab, 8, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    requests = {f"r{i}": (p, params) for i, p in enumerate(prompts)}
    plain_core = make_core(tiny_llama)
    plain, _, _ = run(plain_core, requests)
    core = make_core(tiny_llama, SpeculativeConfig("ngram", 6, disable_by_batch_size=64),
                     block_size=4, num_blocks=40)  # fmt: skip
    oracle = Oracle(core, plain, 0.1, vocab)
    outs, _, _ = run(core, requests, oracle)
    assert core.scheduler.num_preempted_total > 0
    assert outs == plain
    assert spec_stats(core)[1] > 0
    for c in (core, plain_core):
        c.shutdown()


# ------------------------------------------------------------------------------------ sampling


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_sampled_tokens_equal_plain_decoding(tiny_llama: Path, mode: str) -> None:
    """Seeded sampling with every processor: the same tokens and logprobs as plain decoding."""
    vocab = vocab_of(tiny_llama)
    prompts = prompts_of(vocab, 12, seed=2)
    kinds = [
        dict(temperature=0.8, top_p=0.9),
        dict(temperature=1.2, top_k=20, min_p=0.05),
        dict(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3),
        dict(temperature=0.9, min_tokens=12, logit_bias={7: 3.0, 9: -100.0}),
        dict(temperature=1.0, stop_token_ids=[11, 12, 13, 14, 15]),
        dict(temperature=0.0, repetition_penalty=1.5),
    ]
    requests = {}
    for i, p in enumerate(prompts):
        kw = kinds[i % len(kinds)]
        params = SamplingParams(max_tokens=30, seed=100 + i, logprobs=2, eos_token_ids=[2], **kw)
        requests[f"r{i}"] = (p, params)
    (plain, plain_lps, plain_reasons), (outs, lps, reasons), accepted = plain_and_oracle(
        tiny_llama, requests, 0.25, logprobs_mode=mode
    )
    assert outs == plain
    assert reasons == plain_reasons
    for req_id in requests:
        assert lps[req_id] == pytest.approx(plain_lps[req_id], rel=1e-5, abs=1e-5)
    assert accepted > 50


def _chi2_p_value(a: collections.Counter, b: collections.Counter) -> float:
    """Two-sample chi-square test of equal distributions (categories with < 10 draws pooled)."""
    keys = [k for k in a.keys() | b.keys() if a[k] + b[k] >= 10]
    rest_a = sum(a.values()) - sum(a[k] for k in keys)
    rest_b = sum(b.values()) - sum(b[k] for k in keys)
    table = torch.tensor(
        [[a[k] for k in keys] + [rest_a], [b[k] for k in keys] + [rest_b]], dtype=torch.float64
    )
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    df = torch.tensor(table.size(1) - 1.0, dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


NUM_DRAWS = 20_000


@dataclasses.dataclass(frozen=True)
class DrawSetup:
    """A tiny Llama with a 512-token vocabulary (20,000 draws stay quick), the prompt drawn
    from, its greedy continuation and the plain draws at temperature 0.8 that each drafter's
    draws are tested against."""

    model: Path
    prompt: list[int]
    greedy: list[int]
    plain: collections.Counter


def draws(base: DrawSetup, spec: SpeculativeConfig | None, temperature: float,
          greedy: list[int] | None = None) -> collections.Counter:  # fmt: skip
    """NUM_DRAWS unseeded draws of 4 tokens at `temperature` and top-p 0.9, counted."""
    model, prompt = base.model, base.prompt
    core = make_core(model, spec, max_num_seqs=512, max_num_batched_tokens=8192)
    oracle = None
    if spec is not None and spec.method == "ngram":
        oracle = Oracle(core, {f"s{i}": greedy for i in range(NUM_DRAWS)}, 0.0, vocab_of(model))
    elif spec is not None:
        verify_every_draft(core)
    # NOTE: one params object each: the engine core gives each request its own seed.
    requests = {
        f"s{i}": (prompt, SamplingParams(temperature=temperature, top_p=0.9, max_tokens=4,
                                         ignore_eos=True))
        for i in range(NUM_DRAWS)
    }  # fmt: skip
    outs, _, _ = run(core, requests, oracle)
    if spec is not None:
        drafted, accepted = spec_stats(core)
        if spec.method == "draft_model":
            assert accepted > 0.8 * drafted > 0
        else:
            assert 0.02 * drafted < accepted < drafted  # drafts both kept and refused
    core.shutdown()
    return collections.Counter(tuple(t) for t in outs.values())


@pytest.fixture(scope="module")
def draw_setup(tmp_path_factory: pytest.TempPathFactory) -> DrawSetup:
    from tests.conftest import make_tiny_model

    model = make_tiny_model("llama", tmp_path_factory.mktemp("small_vocab_llama"), None)
    prompt = prompts_of(vocab_of(model), 2, seed=3)[1]
    greedy_core = make_core(model)
    greedy, _, _ = run(greedy_core, {"g": (prompt, SamplingParams(temperature=0.0, max_tokens=4))})
    greedy_core.shutdown()
    base = DrawSetup(model, prompt, greedy["g"], collections.Counter())
    return dataclasses.replace(base, plain=draws(base, None, 0.8))


@pytest.mark.parametrize("drafter", ["oracle", "draft_model"])
def test_sampled_distribution_is_the_targets(draw_setup: DrawSetup, drafter: str) -> None:
    """20,000 unseeded draws of 4 tokens at temperature 0.8 and top-p 0.9, speculative against
    plain: a chi-square test cannot tell the 4-token sequences apart; the same test tells plain
    at temperature 0.8 from 0.9. Drafts: the greedy continuation (accepted in part), or the
    served model as its own draft model (sampled with each request's noise: mostly accepted)."""
    if drafter == "oracle":
        config = SpeculativeConfig("ngram", 3, disable_by_batch_size=1024)
    else:
        config = SpeculativeConfig("draft_model", 3, model=str(draw_setup.model),
                                   disable_by_batch_size=1024)  # fmt: skip
    spec = draws(draw_setup, config, 0.8, draw_setup.greedy)
    assert _chi2_p_value(draw_setup.plain, spec) > 1e-3
    if drafter == "oracle":
        # the test has the power to fail
        assert _chi2_p_value(draw_setup.plain, draws(draw_setup, None, 0.9)) < 1e-6


# ------------------------------------------------------------------------------------ grammars


def test_json_schema_with_drafts(tiny_llama_with_tokenizer: Path) -> None:
    """Drafts the grammar refuses are cut before verification; the output is plain decoding's
    and valid JSON of the schema."""
    from transformers import AutoTokenizer

    model_dir = tiny_llama_with_tokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab = vocab_of(model_dir)
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    spec = StructuredOutputSpec(StructuredOutputKind.JSON, json.dumps(schema), any_whitespace=False)
    prompts = prompts_of(vocab, 6, seed=4)
    params = SamplingParams(temperature=0.7, max_tokens=60, seed=5, eos_token_ids=[2])
    requests = {f"j{i}": (p, params) for i, p in enumerate(prompts)}
    plain_core = make_core(model_dir)
    plain, _, plain_reasons = run(plain_core, requests, structured=spec)
    core = make_core(model_dir, SpeculativeConfig("ngram", 6, disable_by_batch_size=64))
    oracle = Oracle(core, plain, 0.3, vocab)
    outs, _, reasons = run(core, requests, oracle, structured=spec)
    assert outs == plain and reasons == plain_reasons
    for req_id, tokens in outs.items():
        if reasons[req_id] == FinishReason.STOP:
            value = json.loads(tokenizer.decode(tokens, skip_special_tokens=True))
            assert set(value) == {"name", "n"} and isinstance(value["n"], int)
    assert spec_stats(core)[1] > 0
    for c in (core, plain_core):
        c.shutdown()


# ------------------------------------------------------------------------------------ limits


def test_drafts_respect_max_tokens_stops_and_batch_size(tiny_llama: Path) -> None:
    vocab = vocab_of(tiny_llama)
    prompt = prompts_of(vocab, 2, seed=5)[1]
    plain_core = make_core(tiny_llama)
    long_params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain, _, _ = run(plain_core, {"a": (prompt, long_params)})
    stop = plain["a"][9]
    cut = plain["a"][: plain["a"].index(stop) + 1]
    core = make_core(tiny_llama, SpeculativeConfig("ngram", 8, disable_by_batch_size=2))
    oracle = Oracle(core, {"a": plain["a"], "b": plain["a"]}, 0.0, vocab)
    # a stop token inside accepted drafts ends the output there; max_tokens bounds the drafts
    stop_params = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop])
    outs, _, reasons = run(core, {"a": (prompt, stop_params)}, oracle)
    assert outs["a"] == cut and reasons["a"] == FinishReason.STOP
    outs, _, reasons = run(core, {"b": (prompt, SamplingParams(temperature=0.0, max_tokens=5))},
                           oracle)  # fmt: skip
    assert outs["b"] == plain["a"][:5] and reasons["b"] == FinishReason.LENGTH
    # three sequences are above disable_by_batch_size 2: no drafts
    before = spec_stats(core)
    three = {f"c{i}": (prompt, long_params) for i in range(3)}
    oracle.plain.update({f"c{i}": plain["a"] for i in range(3)})
    outs, _, _ = run(core, three, oracle)
    assert all(o == plain["a"] for o in outs.values())
    assert spec_stats(core) == before
    for c in (core, plain_core):
        c.shutdown()


# ------------------------------------------------------------------------------------ drafters


def test_ngram_index_proposes_the_latest_continuation() -> None:
    index = NgramIndex(2, 4)
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    assert index.propose(tokens, 3) == [7, 5, 1]  # the latest earlier 1 2 3 was followed by 7 5 1
    tokens += [7, 5]
    assert index.propose(tokens, 4) == [1, 2, 3, 7]  # "7 5" last seen before "1 2 3 7"
    assert NgramIndex(2, 4).propose([4, 5, 6, 7], 3) == []  # nothing repeats
    # a match running into the end repeats its period
    assert NgramIndex(2, 3).propose([8, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]
    assert NgramIndex(3, 3).propose([1, 2, 5, 1, 2], 2) == []  # below prompt_lookup_min


def test_suffix_trie_counts_and_proposals() -> None:
    trie = SuffixTrie(depth=4)
    trie.add([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4])
    # after "1 2 3": 4 twice, 5 once -> 4 (2/3 >= min prob), then "1" after "2 3 4" (1 of 1)
    draft, score = trie.propose([9, 1, 2, 3], 3, factor=2.0, min_prob=0.1)
    assert draft[0] == 4 and score > 0.6
    assert trie.propose([9, 1, 2, 3], 3, factor=2.0, min_prob=0.9)[0] == []  # 2/3 < 0.9
    trie.remove([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4])
    assert trie.root == [0, {}]


def test_suffix_drafter_learns_from_finished_requests() -> None:
    drafter = Drafter(SpeculativeConfig("suffix", 8, suffix_decoding_max_cached_requests=2))
    output = [10, 11, 12, 13, 14, 15, 16, 17]
    prompt = [1, 2, 3]
    drafter.finish("a", prompt + output)  # an earlier rollout of the same prompt
    assert drafter.draft("b", prompt + output[:3], 8) == output[3:]
    drafter.record("b", 5, 2)
    assert drafter.stats.num_accepted_tokens == 2 and drafter.stats.accepted_per_pos[:3] == [
        1,
        1,
        0,
    ]
    drafter.finish("b", [])
    for name in ("c", "d"):  # the cache keeps the last 2 outputs: "a"'s goes
        drafter.finish(name, [50, 51, 52])
    assert drafter.draft("e", prompt + output[:3], 8) == []


def test_plan_follows_acceptance_and_measured_step_costs() -> None:
    """Long drafts for a sequence whose drafts are accepted, none for one whose are not (but a
    probe every PROBE_EVERY steps); a step size measured as expensive is avoided."""
    from enginecore.speculative import PROBE_EVERY, StepCost

    drafter = Drafter(SpeculativeConfig("ngram", 16))
    for n, ms in [(1, 10.0), (2, 10.2), (3, 15.0), (9, 18.0), (17, 24.0)]:
        for _ in range(3):
            drafter.cost.observe(n, ms / 1000)
    proposals = {"copy": list(range(16)), "noise": list(range(16))}
    for _ in range(20):
        drafter.record("copy", 16, 16)
        drafter.record("noise", 4, 0)
    plan = drafter.plan(proposals, 2)
    assert plan["copy"] >= 8 and plan["noise"] == 0
    # drafts that always fail, where each row costs: none, but a probe every PROBE_EVERY steps
    failing = Drafter(SpeculativeConfig("ngram", 16))
    for n, ms in [(1, 10.0), (2, 12.0), (3, 14.0)]:
        failing.cost.observe(n, ms / 1000)
    for _ in range(20):
        failing.record("noise", 4, 0)
    counts = [failing.plan({"noise": [1, 2, 3]}, 1)["noise"] for _ in range(PROBE_EVERY)]
    assert counts.count(1) == 1 and set(counts) == {0, 1}
    # a middling sequence: 2 rows cost what 1 does, 3 much more -> one draft
    fresh = Drafter(SpeculativeConfig("ngram", 16))
    fresh.cost = StepCost()
    for n, ms in [(1, 10.0), (2, 10.2), (3, 15.0), (4, 15.5)]:
        fresh.cost.observe(n, ms / 1000)
    for _ in range(10):
        fresh.record("mid", 3, 1)
    assert fresh.plan({"mid": [1, 2, 3, 4]}, 1)["mid"] == 1
    cost = StepCost()
    cost.observe(1, 0.010)
    cost.observe(5, 0.014)
    assert cost.seconds(3) == pytest.approx(0.012)  # interpolated
    assert 0.014 < cost.seconds(9) < 0.018  # extrapolated at the prior's slope


def test_step_cost_follows_a_loaded_machine() -> None:
    """When another process takes the cores, the sizes now run say so and every size is priced at
    the new pace, not at the quiet times it was last measured at; when the load goes, so does the
    extra."""
    from enginecore.speculative import StepCost

    cost = StepCost()
    quiet = {n: 0.010 + 0.001 * n for n in range(1, 7)}
    for _ in range(40):  # a server that has run a while
        for n, seconds in quiet.items():
            cost.observe(n, seconds)
    assert cost.seconds(6) == pytest.approx(quiet[6], rel=0.02)
    for _ in range(12):  # loaded: only 1-token steps run, at twice their quiet time
        cost.observe(1, 2 * quiet[1])
    assert cost.seconds(1) == pytest.approx(2 * quiet[1], rel=0.05)
    assert cost.seconds(6) == pytest.approx(2 * quiet[6], rel=0.15)
    for _ in range(12):
        cost.observe(1, quiet[1])
    assert cost.seconds(6) == pytest.approx(quiet[6], rel=0.15)


def test_suffix_cache_is_bounded_in_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    import enginecore.speculative as speculative

    monkeypatch.setattr(speculative, "SUFFIX_CACHE_TOKENS", 10)
    drafter = Drafter(SpeculativeConfig("suffix", 8))
    drafter.finish("a", [1, 2, 3, 4, 5, 6, 7, 8])
    assert drafter.draft("x", [9, 1, 2, 3], 8) == [4, 5, 6]  # up to the match's length
    drafter.finish("b", [20, 21, 22, 23, 24, 25, 26, 27])  # 16 tokens > 10: "a" goes
    assert drafter.draft("y", [9, 1, 2, 3], 8) == []
    assert drafter.draft("z", [20, 21, 22], 8) == [23, 24, 25]

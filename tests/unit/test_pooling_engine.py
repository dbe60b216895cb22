"""Pooling models (embed, classify, reward) through EngineCore in one process, against Hugging Face.

Sixteen prompts of different lengths in flight at once: the pooled outputs of tiny Llama / Qwen2 /
Qwen3 sequence classifiers (1 and 3 labels) and of every zoo family's (3 labels), a Qwen2ForRewardModel and a Llama served as an
embedding model (LAST, MEAN, CLS; from a *ForCausalLM and from a bare LlamaModel checkpoint) equal
transformers' fp32 outputs to 1e-4, also when every prompt is chunked, when requests are preempted,
and when the prefix cache holds the prompts already. Requests of the wrong kind, and prompts
longer than the context, end in an error output; weight updates reach the heads.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save

from enginecore.config import CacheConfig, Config, ModelConfig, SchedulerConfig
from enginecore.control import EngineControl
from enginecore.core import EngineCore
from enginecore.executor import InProcExecutor
from enginecore.messages import (
    EngineControlOp,
    EngineCoreRequest,
    FinishReason,
    PauseGeneration,
    ResumeGeneration,
    SamplingParams,
    UpdateWeights,
    UpdateWeightsFromDisk,
    UpdateWeightsFromTensors,
)
from enginecore.model_task import read_model_task
from tests.unit.test_engine_inproc import vocab_of

LENGTHS = (5, 6, 7, 9, 11, 13, 16, 17, 20, 24, 31, 33, 40, 47, 55, 64)  # all > CHUNK
CHUNK = 4
ATOL = 1e-4
_hf_cache: dict[tuple, torch.Tensor] = {}


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """16 prompts; every other one starts with a shared prefix, so that the prefix cache matters."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(40)]
    prompts = []
    for i, n in enumerate(LENGTHS):
        head = shared[: n * 3 // 4] if i % 2 else []
        prompts.append(head + [rng.randrange(vocab) for _ in range(n - len(head))])
    return prompts


def make_core(model_dir: Path, task: str = "auto", pooling_type: str = "LAST", **kw) -> EngineCore:
    config = Config(
        model=ModelConfig(
            path=str(model_dir),
            dtype="float32",
            task=task,
            pooling_type=pooling_type,
            max_model_len=kw.pop("max_model_len", None),
        ),
        cache=CacheConfig(
            enable_prefix_caching=kw.pop("prefix_caching", True),
            num_gpu_blocks_override=kw.pop("num_blocks", 128),  # not 1 GiB to zero: faster
        ),
        scheduler=SchedulerConfig(**kw),
    )
    return EngineCore(config, InProcExecutor(config))


def pool(core: EngineCore, prompts: list[list[int]], tag: str = "p") -> torch.Tensor:
    """Every prompt as one pooling request, all in flight at once: (N, pooled_size) by prompt."""
    for i, p in enumerate(prompts):
        req = EngineCoreRequest(f"{tag}{i}", p, SamplingParams(), pooling=True)
        assert core.add_request(req) == []
    outs = {}
    for _ in range(10_000):
        if not core.scheduler.has_requests:
            break
        for out in core.step():
            assert out.finish_reason == FinishReason.STOP and out.new_token_ids == [], out
            assert out.pooled is not None and out.request_id not in outs
            outs[out.request_id] = out
    assert not core.scheduler.has_requests
    assert core.scheduler.kv.num_free_blocks == core.scheduler.kv.num_total_blocks
    assert all(out.first_scheduled_time is not None for out in outs.values())
    return torch.tensor([outs[f"{tag}{i}"].pooled for i in range(len(prompts))])


def _pool_rows(hidden: torch.Tensor, pooling_type: str) -> torch.Tensor:
    """hidden (T, H) -> (H,)"""
    return {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling_type]


@torch.no_grad()
def hf_reference(model_dir: Path, prompts: list[list[int]], pooling_type: str) -> torch.Tensor:
    """What Hugging Face gives, prompt by prompt (batch 1: no padding, as tern): sequence
    classifiers' logits; Qwen2ForRewardModel's score MLP on AutoModel's last hidden state; for
    any other model, AutoModel's last hidden state pooled."""
    import transformers

    key = (model_dir, pooling_type, tuple(map(tuple, prompts)))
    if key in _hf_cache:
        return _hf_cache[key]
    arch = read_model_task(model_dir).architecture
    if arch.endswith("ForSequenceClassification"):
        assert pooling_type == "LAST"
        model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir)
        rows = [model(torch.tensor([p])).logits[0] for p in prompts]
    else:
        model, info = transformers.AutoModel.from_pretrained(model_dir, output_loading_info=True)
        assert not info["missing_keys"], info
        rows = [
            _pool_rows(model(torch.tensor([p])).last_hidden_state[0], pooling_type) for p in prompts
        ]
        if arch == "Qwen2ForRewardModel":
            w = load_file(next(model_dir.glob("*.safetensors")))
            mlp = torch.nn.Sequential(
                torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
            )
            mlp.load_state_dict({k.removeprefix("score."): v for k, v in w.items() if "score" in k})
            rows = [mlp(row) for row in rows]
    _hf_cache[key] = torch.stack(rows).float()
    return _hf_cache[key]


# The model zoo's families with a *ForSequenceClassification in transformers: 3 labels each.
ZOO_CLASSIFIERS = ("mistral", "ministral", "gemma2", "gemma3", "phi3", "smollm3", "olmo2", "glm4")
CLASSIFIERS = [(a, n) for a in ("llama", "qwen2", "qwen3") for n in (1, 3)] + [
    (a, 3) for a in ZOO_CLASSIFIERS
]


@pytest.mark.parametrize("arch,num_labels", CLASSIFIERS)
def test_classifiers_match_hf_batched_and_chunked(
    arch: str, num_labels: int, tiny_pooling_model
) -> None:
    model_dir = tiny_pooling_model(arch, "score", num_labels)
    prompts = make_prompts(vocab_of(model_dir))
    ref = hf_reference(model_dir, prompts, "LAST")
    assert ref.shape == (16, num_labels)
    core = make_core(model_dir)
    assert core.model_task.task == "classify" and core.model_task.pooled_size == num_labels
    torch.testing.assert_close(pool(core, prompts), ref, atol=ATOL, rtol=0)
    chunked = make_core(model_dir, max_num_batched_tokens=CHUNK)
    torch.testing.assert_close(pool(chunked, prompts), ref, atol=ATOL, rtol=0)
    if num_labels == 1:  # a one-label classifier may be served as a reward model
        reward = make_core(model_dir, task="reward", max_num_batched_tokens=CHUNK)
        torch.testing.assert_close(pool(reward, prompts), ref, atol=ATOL, rtol=0)


def test_reward_model_matches_hf_batched_and_chunked(tiny_qwen2_reward: Path) -> None:
    prompts = make_prompts(vocab_of(tiny_qwen2_reward))
    ref = hf_reference(tiny_qwen2_reward, prompts, "LAST")
    core = make_core(tiny_qwen2_reward)
    assert (core.model_task.task, core.model_task.pooled_size) == ("reward", 1)
    torch.testing.assert_close(pool(core, prompts), ref, atol=ATOL, rtol=0)
    chunked = make_core(tiny_qwen2_reward, max_num_batched_tokens=CHUNK)
    torch.testing.assert_close(pool(chunked, prompts), ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_embeddings_match_hf_batched_and_chunked(pooling_type: str, tiny_llama: Path) -> None:
    prompts = make_prompts(vocab_of(tiny_llama))
    ref = hf_reference(tiny_llama, prompts, pooling_type)
    core = make_core(tiny_llama, task="embed", pooling_type=pooling_type)
    assert (core.model_task.task, core.model_task.pooled_size) == ("embed", 64)
    torch.testing.assert_close(pool(core, prompts), ref, atol=ATOL, rtol=0)
    chunked = make_core(tiny_llama, "embed", pooling_type, max_num_batched_tokens=CHUNK)
    torch.testing.assert_close(pool(chunked, prompts), ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_preempted_prompts_pool_from_scratch(pooling_type: str, tiny_llama: Path) -> None:
    """Prefill-only batches never run out of blocks (the oldest prompt always finishes first), so
    preemption comes from a pause that retracts running requests halfway through their prompts:
    they recompute (LAST from the prefix cache), and their pooling starts over."""
    prompts = make_prompts(vocab_of(tiny_llama))
    ref = hf_reference(tiny_llama, prompts, pooling_type)
    control = EngineControl(make_core(tiny_llama, "embed", pooling_type, max_num_batched_tokens=24))
    core = control.core
    for i, p in enumerate(prompts):
        assert core.add_request(EngineCoreRequest(f"p{i}", p, SamplingParams(), pooling=True)) == []
    outs = {}
    for step in range(10_000):
        if not core.scheduler.has_requests:
            break
        if step in (3, 9):
            assert any(0 < r.num_computed_tokens < r.num_tokens for r in core.scheduler.running)
            for op in (PauseGeneration(mode="retract"), ResumeGeneration()):
                result = control.handle(1, op, [])
                assert result is not None and result.error is None, result
        outs.update({out.request_id: out.pooled for out in core.step()})
    assert core.scheduler.num_preempted_total >= 2
    got = torch.tensor([outs[f"p{i}"] for i in range(len(prompts))])
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


def test_bare_decoder_checkpoint_is_an_embedding_model(tiny_pooling_model) -> None:
    model_dir = tiny_pooling_model("llama", "none")
    prompts = make_prompts(vocab_of(model_dir))[:6]
    core = make_core(model_dir, pooling_type="MEAN")  # auto: LlamaModel -> embed
    assert core.model_task.task == "embed"
    torch.testing.assert_close(
        pool(core, prompts), hf_reference(model_dir, prompts, "MEAN"), atol=ATOL, rtol=0
    )


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_prefix_cache_serves_last_pooling_only(pooling_type: str, tiny_llama: Path) -> None:
    """The second pass finds every prompt cached: LAST uses the cache, MEAN and CLS recompute
    (they need every position's hidden states, which the cache does not keep)."""
    prompts = make_prompts(vocab_of(tiny_llama))
    ref = hf_reference(tiny_llama, prompts, pooling_type)
    core = make_core(tiny_llama, "embed", pooling_type, max_num_batched_tokens=CHUNK * 8)
    torch.testing.assert_close(pool(core, prompts, "a"), ref, atol=ATOL, rtol=0)
    hits = core.scheduler.kv.prefix_cache_hits
    torch.testing.assert_close(pool(core, prompts, "b"), ref, atol=ATOL, rtol=0)
    if pooling_type == "LAST":
        # Every full block but the one holding the last token (which must be computed).
        assert core.scheduler.kv.prefix_cache_hits - hits == sum(
            (n - 1) // 16 * 16 for n in LENGTHS
        )
    else:
        assert core.scheduler.kv.prefix_cache_hits == hits == 0


def test_wrong_kind_of_request_and_too_long_prompts_are_refused(
    tiny_llama: Path, tiny_qwen3_classifier: Path
) -> None:
    classifier = make_core(tiny_qwen3_classifier, max_model_len=32)
    generate = EngineCoreRequest("g", [1, 2, 3], SamplingParams(max_tokens=2))
    (out,) = classifier.add_request(generate)
    assert out.finish_reason == FinishReason.ERROR and "cannot generate" in out.error
    (out,) = classifier.add_request(
        EngineCoreRequest("long", [5] * 33, SamplingParams(), pooling=True)
    )
    assert out.finish_reason == FinishReason.ERROR and "33 tokens" in out.error
    # A prompt may fill the context: nothing follows it. The engine serves on after the refusals.
    prompts = [[7] * 32, [8] * 3]
    ref = hf_reference(tiny_qwen3_classifier, prompts, "LAST")
    torch.testing.assert_close(pool(classifier, prompts), ref, atol=ATOL, rtol=0)

    generator = make_core(tiny_llama)
    (out,) = generator.add_request(EngineCoreRequest("e", [1, 2], SamplingParams(), pooling=True))
    assert out.finish_reason == FinishReason.ERROR and "--task embed" in out.error


def test_tasks_a_checkpoint_cannot_serve_fail_at_load(
    tiny_llama: Path, tiny_qwen3_classifier: Path
) -> None:
    with pytest.raises(
        ValueError, match="--task classify: LlamaForCausalLM serves generate, embed"
    ):
        make_core(tiny_llama, task="classify")
    with pytest.raises(ValueError, match="--task reward needs a score head with one output"):
        make_core(tiny_qwen3_classifier, task="reward")
    with pytest.raises(ValueError, match="generate needs a \\*ForCausalLM"):
        make_core(tiny_qwen3_classifier, task="generate")
    task = read_model_task(tiny_qwen3_classifier)
    assert task.id2label == {0: "LABEL_0", 1: "LABEL_1", 2: "LABEL_2"}


def test_weight_updates_reach_the_reward_head(tiny_pooling_model) -> None:
    model_dir, other_dir = (
        tiny_pooling_model("qwen2", "score_mlp"),
        tiny_pooling_model("qwen2", "score_mlp", seed=1),
    )
    prompts = make_prompts(vocab_of(model_dir))[:8]
    control = EngineControl(make_core(model_dir))

    def update(op: EngineControlOp) -> None:
        result = control.handle(1, op, [])
        assert result is not None and result.error is None, result

    ref, other = hf_reference(model_dir, prompts, "LAST"), hf_reference(other_dir, prompts, "LAST")
    assert (ref - other).abs().max() > 0.1
    update(UpdateWeights(UpdateWeightsFromDisk(str(other_dir))))
    torch.testing.assert_close(pool(control.core, prompts, "a"), other, atol=ATOL, rtol=0)
    (file,) = model_dir.glob("*.safetensors")
    update(UpdateWeights(UpdateWeightsFromTensors(blobs=[save(load_file(file))])))
    torch.testing.assert_close(pool(control.core, prompts, "b"), ref, atol=ATOL, rtol=0)

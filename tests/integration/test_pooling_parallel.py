"""Pooling models through the real engine-core process and its worker processes, at --tp 2, --pp 2.

Gloo on CPU: 16 prompts of different lengths in flight at once, their pooled outputs equal to
Hugging Face fp32 (to 1e-4) for a Qwen2ForRewardModel at --tp 2 (its score MLP is column- then
row-parallel: the last stage's ranks meet in an all-reduce), a 3-label Qwen3 classifier at --pp 2
with every prompt chunked (the last stage pools, the driver answers), and a Llama served as a MEAN
embedding model at --tp 2, chunked (the running sums live on both ranks of the last stage).
EngineReady announces the task to the frontend.
"""

from __future__ import annotations

from pathlib import Path

import torch

from enginecore.config import ModelConfig, ParallelConfig, SchedulerConfig
from enginecore.messages import (
    EngineCoreRequest,
    EngineReady,
    FinishReason,
    RequestType,
    SamplingParams,
)
from tests.integration.test_engine_core_proc import CoreClient, config_for
from tests.unit.test_engine_inproc import vocab_of
from tests.unit.test_pooling_engine import ATOL, hf_reference, make_prompts


def serve_pooled(
    model_dir: Path, tp: int, pp: int, *, task: str = "auto", pooling_type: str = "LAST", **sched
) -> tuple[EngineReady, torch.Tensor]:
    """EngineReady and the pooled outputs of make_prompts' 16 prompts, all sent at once."""
    base = config_for(model_dir, num_gpu_blocks_override=128)
    config = base.replace(
        model=ModelConfig(str(model_dir), dtype="float32", task=task, pooling_type=pooling_type),
        scheduler=SchedulerConfig(**sched),
        parallel=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp),
    )
    prompts = make_prompts(vocab_of(model_dir))
    client = CoreClient(config)
    try:
        ready = client.startup()
        assert isinstance(ready, EngineReady), ready
        for i, p in enumerate(prompts):
            client.send(
                RequestType.ADD, EngineCoreRequest(f"r{i}", p, SamplingParams(), pooling=True)
            )
        pooled: dict[str, list[float]] = {}
        while len(pooled) < len(prompts):
            for out in client.recv().outputs:
                assert out.finish_reason == FinishReason.STOP and out.pooled is not None, out
                pooled[out.request_id] = out.pooled
        stats = client.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
    finally:
        client.close()
    return ready, torch.tensor([pooled[f"r{i}"] for i in range(len(prompts))])


def test_reward_model_at_tp2(tiny_qwen2_reward: Path) -> None:
    ready, got = serve_pooled(tiny_qwen2_reward, 2, 1)
    assert (ready.task, ready.pooled_size, ready.pooling_type) == ("reward", 1, "LAST")
    ref = hf_reference(tiny_qwen2_reward, make_prompts(vocab_of(tiny_qwen2_reward)), "LAST")
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


def test_classifier_at_pp2_every_prompt_chunked(tiny_qwen3_classifier: Path) -> None:
    ready, got = serve_pooled(tiny_qwen3_classifier, 1, 2, max_num_batched_tokens=4)
    assert (ready.task, ready.pooled_size) == ("classify", 3)
    assert ready.id2label == {0: "LABEL_0", 1: "LABEL_1", 2: "LABEL_2"}
    prompts = make_prompts(vocab_of(tiny_qwen3_classifier))
    assert min(map(len, prompts)) > 4
    ref = hf_reference(tiny_qwen3_classifier, prompts, "LAST")
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


def test_mean_embeddings_at_tp2_chunked(tiny_llama: Path) -> None:
    ready, got = serve_pooled(
        tiny_llama, 2, 1, task="embed", pooling_type="MEAN", max_num_batched_tokens=16
    )
    assert (ready.task, ready.pooled_size, ready.pooling_type) == ("embed", 64, "MEAN")
    ref = hf_reference(tiny_llama, make_prompts(vocab_of(tiny_llama)), "MEAN")
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)

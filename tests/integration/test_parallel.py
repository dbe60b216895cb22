"""Tensor and pipeline parallelism through the real engine-core process and its worker processes.

Gloo on CPU, every worker a real process: greedy outputs at --tp 2, --pp 2 and --tp 2 --pp 2 equal
Hugging Face fp32 for the tiny Llama, Qwen2 and Qwen3 checkpoints with 8 prompts in flight, and at
--tp 2 --pp 2 for the zoo families that shard differently (tests/unit/test_model_zoo.py); the
default model (9 heads / 3 KV heads: an uneven split, 6 + 3 heads) at --tp 2 equals --tp 1; a split
the model cannot take, or a missing model, fails start-up in one message with no process left; a
SIGKILLed worker at --tp 2 fails every request and the core exits non-zero within seconds; a frozen
rank is cut off by the process-group timeout; an exception on a non-driver rank fails the step
instead of hanging it. Two nodes (on loopback, and in two network namespaces joined by a veth pair)
give the same tokens, stop together, and fail together when a remote worker is killed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from enginecore.config import Config, ParallelConfig, SchedulerConfig, SpeculativeConfig
from enginecore.executor import MultiprocExecutor, WorkerFailed
from enginecore.messages import (
    EngineCoreRequest,
    EngineReady,
    EngineStartupFailed,
    FinishReason,
    RequestType,
    SamplingParams,
    ScheduledRequest,
    SchedulerOutput,
)
from tests.integration.test_engine_core_proc import CoreClient, config_for, greedy
from tests.unit.test_engine_inproc import hf_greedy, make_core, make_prompts, run_to_end, vocab_of
from workers.distributed import mlp_shard, shard_heads
from workers.models.args import load_model_args
from workers.runner.loading import check_parallel_split

NUM_TOKENS = 6
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "tp2pp2": (2, 2)}
_hf_cache: dict[Path, list[list[int]]] = {}


def parallel_config(model_dir: Path, tp: int, pp: int, **cache) -> Config:
    config = config_for(model_dir, **cache)
    return config.replace(
        parallel=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    )


def generate(config: Config, prompts: list[list[int]], n: int, rounds: int = 1) -> list[list[int]]:
    """The greedy outputs, the prompts sent `rounds` times one after the other (each round's
    outputs in turn): later rounds find the earlier ones' prefixes in the cache."""
    client = CoreClient(config)
    try:
        ready = client.startup()
        assert isinstance(ready, EngineReady), ready
        outs = []
        for k in range(rounds):
            ids = [f"r{k}.{i}" for i in range(len(prompts))]
            got = client.run({r: greedy(r, p, n) for r, p in zip(ids, prompts)})
            assert all(reason == FinishReason.LENGTH for _, reason in got.values())
            outs += [got[r][0] for r in ids]
        if rounds > 1:
            assert client.stats()["prefix_cache_hits"] > 0
        return outs
    finally:
        client.close()


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_greedy_matches_hf_with_8_prompts(arch: str, layout: str, request) -> None:
    model_dir = request.getfixturevalue(arch)
    prompts = make_prompts(vocab_of(model_dir))
    if model_dir not in _hf_cache:
        _hf_cache[model_dir] = hf_greedy(model_dir, prompts, NUM_TOKENS)
    tp, pp = LAYOUTS[layout]
    assert generate(parallel_config(model_dir, tp, pp), prompts, NUM_TOKENS) == _hf_cache[model_dir]


SENTENCES = (
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Pack my box with five dozen liquor jugs before the night ends.",
    "A journey of a thousand miles begins with a single careful step.",
    "Paris is the capital of France and sits on the river Seine.",
    "Water boils at one hundred degrees Celsius at sea level pressure.",
    "The library opens at nine in the morning and closes at six.",
    "She sells sea shells by the sea shore every summer afternoon.",
    "Our train leaves from platform four at a quarter past eight.",
    "Mix the flour with two eggs, then add milk and a pinch of salt.",
    "The committee will meet again next Tuesday to review the budget.",
    "Bright stars filled the clear sky above the quiet mountain village.",
    "Please send the signed contract back to us by Friday at noon.",
    "The old lighthouse guided ships safely through the rocky strait.",
    "Fresh bread from the corner bakery sells out before ten o'clock.",
    "Turn left at the second light and the museum is on your right.",
    "Every student must return their library books by the end of June.",
)


def copy_prompts(model_dir: Path) -> list[list[int]]:
    """16 prompts asking to copy a line, the copy begun: the default model goes on copying."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [
        tokenizer.encode(f"Copy the line.\nLine: {s}\nCopy: {s[: len(s) // 3]}") for s in SENTENCES
    ]


@pytest.mark.parametrize(
    "method", ["ngram", "suffix", "draft_model", "suffix-qwen3_5-pp2", "mtp-qwen3_5", "eagle3"]
)
def test_speculative_decoding_at_tp2_matches_hf(
    tiny_llama: Path, method: str, request: pytest.FixtureRequest
) -> None:
    """16 prompts twice, with 16-token prefill chunks at --tp 2 (the second round's prompts hit
    the prefix cache): every drafter's greedy output is Hugging Face's, drafts accepted.
    ngram runs the default model on prompts it copies from; suffix the tiny Llama, whose second
    round it drafts from the first round's outputs; draft_model the tiny Llama drafting for
    itself (sharded as it is, its own KV cache). The tiny Qwen3.5 with suffix at --pp 2: each
    stage takes back its own linear-attention states' rejected drafts; and with its own (random)
    MTP head at --tp 2, the head sharded as the model's layers; the tiny Llama with a (random)
    EAGLE-3 head, sharded too."""
    from frontend.model_prep import default_model_dir, is_complete
    from tests.unit.test_spec_decode import prompts_of

    tp, pp = 2, 1
    if method == "ngram":
        model_dir = Path(default_model_dir())
        if not is_complete(model_dir):
            pytest.skip("the default model is not prepared (scripts/setup_env prepares it)")
        prompts = copy_prompts(model_dir)
    elif method == "suffix-qwen3_5-pp2":
        method, model_dir, tp, pp = "suffix", request.getfixturevalue("tiny_qwen3_5"), 1, 2
        prompts = prompts_of(vocab_of(model_dir))
    elif method == "mtp-qwen3_5":
        method, model_dir = "mtp", request.getfixturevalue("tiny_qwen3_5_mtp")
        prompts = prompts_of(vocab_of(model_dir))
    else:
        model_dir = tiny_llama
        prompts = prompts_of(vocab_of(tiny_llama))
    config = parallel_config(model_dir, tp, pp).replace(
        scheduler=SchedulerConfig(max_num_batched_tokens=16),
        speculative=SpeculativeConfig(
            method, 6, disable_by_batch_size=64,
            model={"draft_model": str(tiny_llama),
                   "eagle3": str(request.getfixturevalue("tiny_llama_eagle3"))}.get(method),
        ),
    )  # fmt: skip
    client = CoreClient(config)
    try:
        assert isinstance(client.startup(), EngineReady)
        outs = []
        for k in range(2):
            ids = [f"r{k}.{i}" for i in range(len(prompts))]
            got = client.run({r: greedy(r, p, 16) for r, p in zip(ids, prompts)})
            outs.append([got[r][0] for r in ids])
        stats = client.stats()
    finally:
        client.close()
    ref = hf_greedy(model_dir, prompts, 16)
    assert outs == [ref, ref]
    assert stats["prefix_cache_hits"] > 0
    # NOTE: how many drafts pays is planned from measured step times (a loaded machine drafts
    # less); tests/unit/test_spec_decode.py verifies every draft of an oracle drafter.
    if method in ("mtp", "eagle3"):  # a random head: its drafts are verified, few are right
        assert stats["spec_num_draft_tokens"] > 0
    else:
        assert stats["spec_num_draft_tokens"] >= stats["spec_num_accepted_tokens"] > 0


def test_batch_invariant_at_tp2(tiny_llama: Path) -> None:
    """--batch-invariant at --tp 2 (the row-parallel layers' all-reduces included): a needle's
    tokens and logprobs are bitwise the same alone, among 24 other requests with 16-token
    prefill chunks, and from the prefix cache."""
    vocab = vocab_of(tiny_llama)
    rng = random.Random(5)
    needle = [rng.randrange(3, vocab) for _ in range(40)]
    config = parallel_config(tiny_llama, 2, 1)
    config = config.replace(
        model=dataclasses.replace(config.model, batch_invariant=True),
        scheduler=SchedulerConfig(max_num_batched_tokens=16),
    )
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    client = CoreClient(config)
    runs = []
    try:
        assert isinstance(client.startup(), EngineReady)
        for k, others in enumerate([0, 24, 24]):
            reqs = {
                f"o{k}.{i}": greedy(f"o{k}.{i}", [rng.randrange(3, vocab) for _ in range(30)], 6)
                for i in range(others)
            }
            reqs[f"n{k}"] = EngineCoreRequest(f"n{k}", needle, params)
            got = client.run(reqs)
            runs.append((got[f"n{k}"][0], client.logprobs[f"n{k}"]))
        stats = client.stats()
    finally:
        client.close()
    assert stats["prefix_cache_hits"] >= 32  # the third run's needle came from the cache
    assert len(runs[0][1]) == 10 and runs[1] == runs[0] and runs[2] == runs[0]


# The zoo's families whose layers shard or split differently from Llama's (the rest only change
# maths the single-rank tests cover): windows in the fused TP layer, per-head 1 + weight norms,
# fused checkpoint tensors and partial rotation, whole-projection q/k norms, interleaved rotation,
# Gated DeltaNet heads, experts' intermediate features (with Qwen2-MoE's shared expert; Qwen3-MoE
# with a dense layer between expert layers, which pp 2 puts on another stage; gpt-oss's sinks per
# head and expert biases added once).
ZOO_PARALLEL = ("tiny_mistral", "tiny_gemma3", "tiny_phi3", "tiny_olmo2", "tiny_glm4",
                "tiny_qwen3_5", "tiny_qwen2_moe", "tiny_qwen3_moe", "tiny_gpt_oss")  # fmt: skip


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_adapters_mixed_in_one_batch_match_hf_peft(
    layout: str, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Base-model requests and three PEFT adapters' in one batch, A and B sharded as their layers
    are (column-parallel: B's rows; row-parallel: A's columns, the partial products summed by the
    all-reduce), each stage its own layers' adapters; prompts served twice (prefix cache)."""
    from enginecore.config import LoraConfig
    from scripts.make_tiny_model import make_lora_adapter
    from tests.unit.test_lora import ADAPTERS, hf_reference, mixed_requests

    root = tmp_path_factory.mktemp("lora")
    paths = {n: make_lora_adapter(tiny_llama, root / n, **spec) for n, spec in ADAPTERS.items()}
    tp, pp = LAYOUTS[layout]
    config = parallel_config(tiny_llama, tp, pp, block_size=4).replace(
        lora=LoraConfig(enabled=True, modules=tuple((n, str(p)) for n, p in paths.items()))
    )
    requests = mixed_requests(tiny_llama)
    client = CoreClient(config)
    try:
        assert isinstance(client.startup(), EngineReady)
        for round_ in range(2):
            sent = {}
            for req_id, (prompt, name) in requests.items():
                req = greedy(f"{req_id}.{round_}", prompt, NUM_TOKENS)
                req.lora_name = name
                sent[req.request_id] = req
            got = client.run(sent)
            for req_id, (prompt, name) in requests.items():
                expected = hf_reference(tiny_llama, paths.get(name) if name else None, prompt,
                                        NUM_TOKENS)[0]  # fmt: skip
                assert got[f"{req_id}.{round_}"][0] == expected, req_id
        assert client.stats()["prefix_cache_hits"] > 0
    finally:
        client.close()


@pytest.mark.parametrize("arch", ZOO_PARALLEL)
def test_model_zoo_at_tp2_pp2_matches_hf(arch: str, request) -> None:
    """The zoo's families split both ways at once (4 ranks: each stage's layers sharded). Qwen3.5
    serves its prompts twice: the second time from the prefix cache and the state checkpoints
    each stage keeps of its own linear-attention layers."""
    model_dir = request.getfixturevalue(arch)
    prompts = make_prompts(vocab_of(model_dir))
    expected = hf_greedy(model_dir, prompts, NUM_TOKENS)
    rounds = 2 if arch == "tiny_qwen3_5" else 1
    got = generate(parallel_config(model_dir, 2, 2), prompts, NUM_TOKENS, rounds)
    assert got == expected * rounds


def test_quantized_files_split_across_ranks_match_hf(
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    tiny_llama: Path,
    tokenizer_dir: Path | None,
) -> None:
    """Block-quantized weights split both ways: a GGUF file of K-quants at --tp 2 --pp 2 (qkv rows
    in two block types, Q5_K / Q4_K MLP sharded by rows and at super-block boundaries, a Q6_K
    embedding split by vocabulary) and GPTQ checkpoints (INT4_ZP blocks; act-order) at --tp 2
    (the stages split layers, not blocks), each against Hugging Face on the dequantized
    weights."""
    from tests.unit.test_gguf import gguf_case_files
    from tests.unit.test_quantized_checkpoints import write_quantized_checkpoint

    cases = [
        (*write_quantized_checkpoint(tiny_llama, tmp_path / "gptq", "gptq", 32), 1),
        # act-order: column-parallel layers permute their input, row-parallel ones (their input
        # split across ranks) load as float
        (*write_quantized_checkpoint(tiny_llama, tmp_path / "act", "gptq", 32, act_order=True), 1),
    ]
    if tokenizer_dir is not None:
        _, prepared, reference = gguf_case_files("qwen3_k", tmp_path_factory, tokenizer_dir)
        cases.append((prepared, reference, 2))
    for model_dir, reference, pp in cases:
        prompts = make_prompts(vocab_of(reference))
        expected = hf_greedy(reference, prompts, NUM_TOKENS)
        assert generate(parallel_config(model_dir, 2, pp), prompts, NUM_TOKENS) == expected


@pytest.mark.parametrize("arch", ["tiny_qwen2_moe", "tiny_mixtral", "tiny_gpt_oss"])
def test_expert_parallel_at_tp2_matches_hf(arch: str, request) -> None:
    """--enable-expert-parallel: each of 2 ranks holds 4 of the 8 experts whole (Qwen2-MoE's
    shared expert stays sharded by features; Mixtral's experts load from w1/w2/w3; gpt-oss's
    interleaved, transposed experts with their biases on every rank)."""
    model_dir = request.getfixturevalue(arch)
    prompts = make_prompts(vocab_of(model_dir))
    config = parallel_config(model_dir, 2, 1)
    config = config.replace(
        parallel=dataclasses.replace(config.parallel, enable_expert_parallel=True)
    )
    assert generate(config, prompts, NUM_TOKENS) == hf_greedy(model_dir, prompts, NUM_TOKENS)


def test_routed_experts_at_tp2_pp2_match_hf(tiny_qwen3_moe: Path) -> None:
    """Routing replay across ranks: the tiny Qwen3-MoE's expert layers 0 and 2 sit on different
    pipeline stages (the first stage's routing travels with its hidden states), prompts are
    prefilled 7 tokens a step and sent twice (the second time from the prefix cache): every
    token's experts equal Hugging Face's router top-k."""
    import numpy as np
    import torch
    import transformers

    prompts = make_prompts(vocab_of(tiny_qwen3_moe), n=4)
    expected_tokens = hf_greedy(tiny_qwen3_moe, prompts, NUM_TOKENS)
    config = parallel_config(tiny_qwen3_moe, 2, 2, block_size=4)
    config = config.replace(
        model=dataclasses.replace(config.model, enable_return_routed_experts=True),
        scheduler=dataclasses.replace(config.scheduler, max_num_batched_tokens=7),
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe, dtype=torch.float32)
    client = CoreClient(config)
    try:
        assert isinstance(client.startup(), EngineReady)
        for round_ in range(2):
            ids = [f"{round_}.{i}" for i in range(len(prompts))]
            for r, p in zip(ids, prompts):
                client.send(RequestType.ADD, greedy(r, p, NUM_TOKENS))
            rows = {r: b"" for r in ids}
            done: set[str] = set()
            for _ in range(10_000):
                if len(done) == len(ids):
                    break
                for o in client.recv().outputs:
                    rows[o.request_id] += o.routed_experts.data if o.routed_experts else b""
                    if o.finish_reason is not None:
                        done.add(o.request_id)
            for r, p, out in zip(ids, prompts, expected_tokens):
                tokens = p + out[:-1]
                with torch.no_grad():
                    logits = hf(torch.tensor([tokens]), output_router_logits=True).router_logits
                want = torch.stack([x.softmax(-1).topk(2).indices for x in logits], 1).numpy()
                got = np.frombuffer(rows[r], dtype=np.int16).reshape(-1, 2, 2)
                np.testing.assert_array_equal(got, want)
        assert client.stats()["prefix_cache_hits"] > 0
    finally:
        client.close()


def test_default_model_at_tp2_splits_heads_unevenly_and_matches_tp1() -> None:
    from frontend.model_prep import default_model_dir, is_complete

    model_dir = Path(default_model_dir())
    if not is_complete(model_dir):
        pytest.skip("the default model is not prepared (scripts/setup_env prepares it)")
    args = load_model_args(model_dir)
    assert (args.num_attention_heads, args.num_key_value_heads) == (9, 3)
    prompts = make_prompts(args.vocab_size, n=4)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ref, _ = run_to_end(make_core(model_dir), {f"r{i}": (p, params) for i, p in enumerate(prompts)})
    got = generate(parallel_config(model_dir, 2, 1), prompts, 6)
    assert got == [ref[f"r{i}"] for i in range(len(prompts))]


def test_splits_a_model_cannot_take_are_named(tiny_llama: Path, tiny_qwen2: Path) -> None:
    llama, qwen2 = load_model_args(tiny_llama), load_model_args(tiny_qwen2)  # 4 heads / 2 KV
    with pytest.raises(ValueError, match="size 3 cannot split 4 attention heads / 2 KV heads"):
        check_parallel_split(llama, ParallelConfig(tensor_parallel_size=3))
    with pytest.raises(ValueError, match="pipeline-parallel size 3 exceeds .* 2 decoder layers"):
        check_parallel_split(qwen2, ParallelConfig(pipeline_parallel_size=3))
    odd_mlp = dataclasses.replace(llama, intermediate_size=130)
    with pytest.raises(ValueError, match="size 4 does not divide the MLP's intermediate size 130"):
        check_parallel_split(odd_mlp, ParallelConfig(tensor_parallel_size=4))
    for tp in (1, 2, 4):  # 4: each KV head replicated on two ranks
        check_parallel_split(llama, ParallelConfig(tensor_parallel_size=tp))


def test_uneven_heads_are_balanced_by_the_mlp_split() -> None:
    """SmolLM2 at tp 2: heads split 6 + 3, so rank 1 takes more MLP features; every rank ends up
    with about the same weight, and the features cover the MLP exactly once."""
    hidden, head_dim, inter = 576, 64, 1536
    heads = [shard_heads(9, 3, 2, r) for r in range(2)]
    shards = [mlp_shard(inter, hidden, head_dim, heads, r) for r in range(2)]
    assert shards == [(0, 672), (672, 864)]
    weights = [
        2 * (h.num_heads + h.num_kv_heads) * head_dim * hidden + 3 * hidden * size
        for h, (_, size) in zip(heads, shards)
    ]
    assert abs(weights[0] - weights[1]) <= 3 * hidden * 32  # within one step of 32 features
    even = [shard_heads(4, 2, 2, r) for r in range(2)]
    assert [mlp_shard(128, 64, 16, even, r) for r in range(2)] == [(0, 64), (64, 64)]


@pytest.mark.parametrize("case", ["bad_split", "no_model"])
def test_startup_error_is_one_line_and_no_process_is_left(
    case: str, tiny_llama: Path, tmp_path: Path
) -> None:
    if case == "bad_split":
        config, expected = parallel_config(tiny_llama, 3, 1), "cannot split 4 attention heads"
    else:
        config, expected = parallel_config(tmp_path / "nothing", 2, 2), "has no config.json"
    client = CoreClient(config)
    try:
        failed = client.startup()
        assert isinstance(failed, EngineStartupFailed)
        assert expected in failed.error and "\n" not in failed.error
        client.proc.join(30)
        assert client.proc.exitcode == 1
    finally:
        client.close()  # asserts that no descendant survived


def test_sigkill_of_a_worker_at_tp2_fails_every_request(tiny_llama: Path) -> None:
    client = CoreClient(parallel_config(tiny_llama, 2, 1))
    try:
        assert isinstance(client.startup(), EngineReady)
        victims = {f"v{i}" for i in range(3)}
        for req_id in sorted(victims):
            client.send(RequestType.ADD, greedy(req_id, [1, 2, 3 + len(req_id)], n=100_000))
        client.recv()
        workers = client.ps.children(recursive=True)
        assert len(workers) == 2
        victim = max(workers, key=lambda p: p.pid)  # normally rank 1, not the driver
        killed_at = time.monotonic()
        victim.send_signal(signal.SIGKILL)
        failed: dict[str, FinishReason] = {}
        dead = None
        while dead is None:
            msg = client.recv()
            failed.update({o.request_id: o.finish_reason for o in msg.outputs if o.finish_reason})
            dead = msg.engine_dead
        assert "died" in dead
        assert failed == dict.fromkeys(victims, FinishReason.ERROR)
        assert time.monotonic() - killed_at < 10
        client.proc.join(15)
        assert client.proc.exitcode == 1
        gone, alive = psutil.wait_procs(workers, timeout=15 - (time.monotonic() - killed_at))
        assert not alive, alive
        assert time.monotonic() - killed_at < 15
    finally:
        client.close()


def test_a_rank_hung_in_a_collective_times_out_and_fails_the_engine(tiny_llama: Path) -> None:
    """SIGSTOP freezes rank 1 (alive, connections open): rank 0's all-reduce times out after the
    process-group timeout (3 s here), every request fails and shutdown kills the frozen rank."""
    config = parallel_config(tiny_llama, 2, 1)
    config = config.replace(
        parallel=dataclasses.replace(config.parallel, distributed_timeout_s=3.0)
    )
    client = CoreClient(config)
    try:
        assert isinstance(client.startup(), EngineReady)
        client.send(RequestType.ADD, greedy("stuck", [5, 6, 7], n=100_000))
        client.recv()
        workers = client.ps.children(recursive=True)
        frozen = max(workers, key=lambda p: p.pid)
        frozen_at = time.monotonic()
        frozen.send_signal(signal.SIGSTOP)
        dead, failed = None, {}
        while dead is None:
            msg = client.recv()
            failed.update({o.request_id: o.finish_reason for o in msg.outputs})
            dead = msg.engine_dead
        assert failed["stuck"] == FinishReason.ERROR
        client.proc.join(15)
        assert client.proc.exitcode == 1
        gone, alive = psutil.wait_procs(workers, timeout=5)
        assert not alive
        assert time.monotonic() - frozen_at < 15
    finally:
        client.close()


def test_error_on_a_non_driver_rank_fails_the_step(tiny_qwen3: Path) -> None:
    """At pp 2 only stage 0 (rank 0, not the driver) embeds tokens: an id beyond the vocabulary
    raises there alone while the driver waits for its hidden states."""
    executor = MultiprocExecutor(parallel_config(tiny_qwen3, 1, 2))
    workers = [psutil.Process(p.pid) for p in executor.procs]
    try:
        bad = ScheduledRequest(
            "bad", [vocab_of(tiny_qwen3) + 7], 0, [0], 0, SamplingParams(temperature=0, seed=1)
        )
        with pytest.raises(WorkerFailed, match="worker 0 failed: IndexError"):
            executor.execute_model(SchedulerOutput(step_id=1, requests=[bad]))
    finally:
        started = time.monotonic()
        executor.shutdown()
        assert time.monotonic() - started < 5
    gone, alive = psutil.wait_procs(workers, timeout=5)
    assert not alive


@pytest.fixture(autouse=True)
def _no_leftover_children(no_leftover_children: None) -> None:
    """Every test here: no process it started outlives it (conftest's no_leftover_children)."""


# --------------------------------------------------------------------------- several nodes


def _run_node(config: Config) -> None:
    from workers.worker_proc import run_worker_node

    sys.exit(run_worker_node(config))


def node_configs(model_dir: Path, tp: int, host: str) -> tuple[Config, Config]:
    """Node 0's and node 1's Config for tp ranks split over two nodes."""
    from enginecore.executor import free_port

    parallel = ParallelConfig(
        tensor_parallel_size=tp, nnodes=2, dist_init_addr=f"{host}:{free_port(host)}"
    )
    node0 = config_for(model_dir).replace(parallel=parallel)
    node1 = config_for(model_dir).replace(parallel=dataclasses.replace(parallel, node_rank=1))
    return node0, node1


def test_two_nodes_on_loopback_match_hf_and_stop_together(tiny_llama: Path) -> None:
    """Ranks 0 (node 0: shared-memory reader) and 1 (node 1: ZMQ reader, TCP replies) at tp 2."""
    import multiprocessing

    prompts = make_prompts(vocab_of(tiny_llama))
    if tiny_llama not in _hf_cache:
        _hf_cache[tiny_llama] = hf_greedy(tiny_llama, prompts, NUM_TOKENS)
    node0, node1 = node_configs(tiny_llama, 2, "127.0.0.1")
    other = multiprocessing.get_context("spawn").Process(target=_run_node, args=(node1,))
    other.start()
    node_procs = [psutil.Process(other.pid)]
    client = CoreClient(node0)
    try:
        assert isinstance(client.startup(), EngineReady)
        node_procs += node_procs[0].children(recursive=True)
        assert len(client.ps.children(recursive=True)) == 1 and len(node_procs) == 2
        got = client.run({f"r{i}": greedy(f"r{i}", p, NUM_TOKENS) for i, p in enumerate(prompts)})
        assert [got[f"r{i}"][0] for i in range(len(prompts))] == _hf_cache[tiny_llama]
        client.proc.terminate()  # SIGTERM: node 0 stops, and tells node 1 to stop
        client.proc.join(15)
        assert client.proc.exitcode == 0
        other.join(15)
        assert other.exitcode == 0
        gone, alive = psutil.wait_procs(node_procs, timeout=5)
        assert not alive
    finally:
        client.close()
        if other.is_alive():
            other.kill()
        other.join(5)


@contextlib.contextmanager
def two_namespaces() -> Iterator[tuple[str, str, list[str]]]:
    """A network namespace joined to this one by a veth pair: (this side's address, the other
    side's, the command prefix that runs a program over there). Skips unless we may create one."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    tag = f"{os.getpid() % 10000}{random.randrange(100):02d}"
    ns, here, there = f"tern{tag}", f"tva{tag}", f"tvb{tag}"
    net = f"10.{random.randrange(1, 250)}.{random.randrange(1, 250)}"

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    try:
        ip("netns", "add", ns)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot create a network namespace: {e.stderr.decode().strip()}")
    try:
        ip("link", "add", here, "type", "veth", "peer", "name", there)
        ip("link", "set", there, "netns", ns)
        ip("addr", "add", f"{net}.1/30", "dev", here)
        ip("link", "set", here, "up")
        for args in (("addr", "add", f"{net}.2/30", "dev", there), ("link", "set", there, "up")):
            ip("netns", "exec", ns, "ip", *args)
        ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield f"{net}.1", f"{net}.2", ["ip", "netns", "exec", ns]
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


NODE_MAIN = """
import dataclasses, sys
from enginecore.config import CacheConfig, Config, ModelConfig, ParallelConfig
from workers.worker_proc import run_worker_node
model, tp, addr = sys.argv[1], int(sys.argv[2]), sys.argv[3]
parallel = ParallelConfig(tensor_parallel_size=tp, nnodes=2, node_rank=1, dist_init_addr=addr)
config = Config(model=ModelConfig(path=model, dtype="float32"), parallel=parallel)
sys.exit(run_worker_node(config))
"""


def test_two_nodes_in_network_namespaces_then_a_killed_remote_worker(tiny_qwen2: Path) -> None:
    """Node 1 lives in its own network namespace: every byte between the nodes crosses the veth.
    Then SIGKILL of node 1's worker mid-generation fails every request and stops both nodes."""
    prompts = make_prompts(vocab_of(tiny_qwen2))
    if tiny_qwen2 not in _hf_cache:
        _hf_cache[tiny_qwen2] = hf_greedy(tiny_qwen2, prompts, NUM_TOKENS)
    with two_namespaces() as (here, there, run_there):
        node0, node1 = node_configs(tiny_qwen2, 2, here)
        addr = node0.parallel.dist_init_addr
        other = subprocess.Popen(
            [*run_there, sys.executable, "-c", NODE_MAIN, str(tiny_qwen2), "2", addr]
        )
        client = CoreClient(node0)
        try:
            assert isinstance(client.startup(), EngineReady)
            remote = [p for p in psutil.Process(other.pid).children(recursive=True)]
            got = client.run(
                {f"r{i}": greedy(f"r{i}", p, NUM_TOKENS) for i, p in enumerate(prompts)}
            )
            assert [got[f"r{i}"][0] for i in range(len(prompts))] == _hf_cache[tiny_qwen2]

            client.send(RequestType.ADD, greedy("long", prompts[0], n=100_000))
            client.recv()
            (worker,) = [p for p in remote if "spawn_main" in " ".join(p.cmdline())]
            killed_at = time.monotonic()
            worker.send_signal(signal.SIGKILL)
            dead, failed = None, {}
            while dead is None:
                msg = client.recv()
                failed.update({o.request_id: o.finish_reason for o in msg.outputs})
                dead = msg.engine_dead
            assert "died" in dead and failed["long"] == FinishReason.ERROR
            client.proc.join(15)
            assert client.proc.exitcode == 1
            assert other.wait(15) == 1
            assert time.monotonic() - killed_at < 15
        finally:
            client.close()
            if other.poll() is None:
                other.kill()
            other.wait(5)


def test_multi_node_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="needs --dist-init-addr"):
        ParallelConfig(tensor_parallel_size=2, nnodes=2)
    with pytest.raises(ValueError, match="3 workers do not split evenly over 2 nodes"):
        ParallelConfig(tensor_parallel_size=3, nnodes=2, dist_init_addr="10.0.0.1:29500")
    with pytest.raises(ValueError, match="host:port"):
        ParallelConfig(tensor_parallel_size=2, nnodes=2, dist_init_addr="10.0.0.1")
    with pytest.raises(ValueError, match="--node-rank 2"):
        ParallelConfig(tensor_parallel_size=2, nnodes=2, node_rank=2, dist_init_addr="h:1")
    p = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=2, node_rank=1,
                       dist_init_addr="h:1")  # fmt: skip
    assert list(p.node_ranks) == [2, 3] and p.driver_rank == 2


def test_node_monitor_bootstraps_nodes_and_records_their_failures() -> None:
    """Node 0's end of the node protocol, driven by a bare DEALER socket (no processes)."""
    import zmq

    from enginecore.executor import NodeMonitor, free_port
    from enginecore.messages import (
        Codec,
        CoreToNode,
        NodeAck,
        NodeBootstrap,
        NodeHeartbeat,
        NodeHello,
        NodeStop,
        NodeToCore,
        NodeWorkerExited,
    )
    from enginecore.shm_broadcast import Handle

    addr = f"127.0.0.1:{free_port()}"
    parallel = ParallelConfig(tensor_parallel_size=2, nnodes=2, dist_init_addr=addr)
    boot = NodeBootstrap(Handle(2, 1, 1024, 8, remote_addr="tcp://x:1"), "tcp://x:2", "x:3")
    ctx = zmq.Context()
    monitor = NodeMonitor(ctx, parallel, boot)
    to_core, from_core = Codec(NodeToCore), Codec(CoreToNode)

    def node() -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{addr}")
        return sock

    def ask(sock: zmq.Socket, msg: object) -> object:
        sock.send(to_core.encode(msg))
        assert sock.poll(5000)
        return from_core.decode(sock.recv())

    good, bad = node(), node()
    try:
        assert ask(good, NodeHello(1, 2)) == boot
        monitor.wait_for_nodes(5, lambda: None)
        assert isinstance(ask(good, NodeHeartbeat(1)), NodeAck) and monitor.error is None
        refused = ask(bad, NodeHello(1, 4))
        assert "tp x pp = 4, node 0 runs 2" in refused.error
        good.send(to_core.encode(NodeWorkerExited(1, 1, -9)))
        deadline = time.monotonic() + 5
        while monitor.killed is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "runs tp x pp = 4" in monitor.error  # the first failure is kept
        assert monitor.killed == "worker tern-worker-1 on node 1 died (exit code -9)"
        monitor.close()  # tells the node that joined to stop
        assert good.poll(5000) and isinstance(from_core.decode(good.recv()), NodeStop)
    finally:
        monitor.close()
        good.close()
        bad.close()
        ctx.term()

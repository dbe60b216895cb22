"""Scheduler, KV-cache manager and block pool against a simulated paged model.

`PagedToyModel` behaves like a worker: it writes every fed token into its block (by the block table the
scheduler sent) and derives the next token from the context it *reads back from the blocks*. So a wrong
block table, a reused block with the wrong content, or a token fed twice changes the output — which must
be identical with prefix caching on/off, with preemption, and with every prefill chunked.
"""

from __future__ import annotations

import hashlib
import random

import pytest

from enginecore.config import CacheConfig, Config, ModelConfig, SchedulerConfig
from enginecore.messages import (
    FinishReason,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerOutput,
)
from enginecore.request import Request
from enginecore.scheduler import Scheduler

VOCAB = 1000


class PagedToyModel:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.slots: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.tables: dict[str, list[int]] = {}

    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in step.finished_req_ids:
            self.tables.pop(req_id, None)
        # Write every token of the batch first (as each attention layer does), then read.
        for r in step.requests:
            if r.sampling_params is not None:
                self.tables[r.req_id] = []
            self.tables[r.req_id].extend(r.new_block_ids)
            table = self.tables[r.req_id]
            for i, tok in enumerate(r.token_ids):
                pos = r.start_pos + i
                self.slots[table[pos // self.block_size]][pos % self.block_size] = tok
        req_ids, sampled = [], []
        for r in step.requests:
            if r.sample_index < 0:
                continue
            end = r.start_pos + len(r.token_ids)
            table = self.tables[r.req_id]
            context = [
                self.slots[table[p // self.block_size]][p % self.block_size] for p in range(end)
            ]
            assert None not in context
            digest = hashlib.sha256(repr(context).encode()).digest()
            req_ids.append(r.req_id)
            sampled.append(int.from_bytes(digest[:4], "little") % VOCAB)
        return ModelRunnerOutput(step.step_id, req_ids, [[t] for t in sampled])


def make_config(**sched: int) -> tuple[Config, int]:
    num_blocks = sched.pop("num_blocks", 256)
    caching = bool(sched.pop("prefix_caching", 1))
    cfg = Config(
        model=ModelConfig(path="unused"),
        cache=CacheConfig(block_size=4, enable_prefix_caching=caching),
        scheduler=SchedulerConfig(**sched),
    )
    return cfg, num_blocks


def run(prompts: list[list[int]], max_tokens: int = 12, max_steps: int = 5000, **kw: int):
    cfg, num_blocks = make_config(**kw)
    sched = Scheduler(cfg, num_blocks, max_model_len=num_blocks * 4)
    model = PagedToyModel(num_blocks, 4)
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, seed=i, ignore_eos=True)
        sched.add_request(Request(f"r{i}", p, params))
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    finish: dict[str, FinishReason] = {}
    cached: dict[str, int] = {}
    for _ in range(max_steps):
        if not sched.has_requests:
            break
        step = sched.schedule()
        assert step.num_tokens <= cfg.scheduler.max_num_batched_tokens
        assert len(step.requests) <= cfg.scheduler.max_num_seqs
        for out in sched.update_from_output(step, model.execute(step)):
            outputs[out.request_id] += out.new_token_ids
            cached[out.request_id] = out.num_cached_tokens
            if out.finish_reason is not None:
                finish[out.request_id] = out.finish_reason
    assert not sched.has_requests, "requests did not finish"
    assert sched.kv.num_free_blocks == num_blocks
    return outputs, finish, cached, sched


def prompts_of(n: int, seed: int = 0, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(VOCAB) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def test_outputs_are_independent_of_scheduling_choices():
    prompts = prompts_of(8, shared_prefix=9)
    ref, finish, _, _ = run(prompts, prefix_caching=0)
    assert all(f == FinishReason.LENGTH for f in finish.values())
    assert all(len(v) == 12 for v in ref.values())
    assert run(prompts, prefix_caching=1)[0] == ref
    assert run(prompts, max_num_batched_tokens=5)[0] == ref  # every prefill chunked
    assert run(prompts, max_num_seqs=2)[0] == ref
    out, _, _, sched = run(prompts, num_blocks=16)  # 64 token slots for 8 x up to 61 tokens
    assert sched.num_preempted_total > 0
    assert out == ref
    out, _, _, sched = run(prompts, num_blocks=16, max_num_batched_tokens=7, prefix_caching=0)
    assert sched.num_preempted_total > 0
    assert out == ref


def test_repeated_prompt_hits_prefix_cache():
    cfg, num_blocks = make_config()
    sched = Scheduler(cfg, num_blocks, max_model_len=1024)
    model = PagedToyModel(num_blocks, 4)
    prompt = list(range(1, 19))  # 18 tokens: 4 full blocks
    results = []
    for i in range(2):
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=3, seed=0)))
        tokens, cached = [], None
        while sched.has_requests:
            step = sched.schedule()
            for out in sched.update_from_output(step, model.execute(step)):
                tokens += out.new_token_ids
                cached = out.num_cached_tokens
        results.append((tokens, cached))
    assert results[0][1] == 0
    assert results[1][1] == 16
    assert results[0][0] == results[1][0]
    stats = sched.stats()
    assert stats.prefix_cache_queries == 36 and stats.prefix_cache_hits == 16


def test_fully_cached_prompt_still_computes_its_last_token():
    cfg, num_blocks = make_config()
    sched = Scheduler(cfg, num_blocks, max_model_len=1024)
    model = PagedToyModel(num_blocks, 4)
    prompt = list(range(1, 17))  # exactly 4 blocks
    for i in range(2):
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=2, seed=0)))
        while sched.has_requests:
            step = sched.schedule()
            if i == 1 and step.requests and step.requests[0].sampling_params is not None:
                assert step.requests[0].start_pos == 12
                assert step.requests[0].token_ids == [13, 14, 15, 16]
            sched.update_from_output(step, model.execute(step))


def test_abort_frees_blocks_at_once():
    cfg, num_blocks = make_config()
    sched = Scheduler(cfg, num_blocks, max_model_len=1024)
    model = PagedToyModel(num_blocks, 4)
    for i, p in enumerate(prompts_of(4)):
        sched.add_request(Request(f"r{i}", p, SamplingParams(max_tokens=50, seed=i)))
    step = sched.schedule()
    sched.update_from_output(step, model.execute(step))
    assert sched.kv.num_free_blocks < num_blocks
    outs = sched.abort_requests(["r0", "r1", "r2", "r3", "unknown"])
    assert [o.finish_reason for o in outs] == [FinishReason.ABORT] * 4
    assert sched.kv.num_free_blocks == num_blocks
    assert not sched.has_requests
    assert sorted(sched.schedule().finished_req_ids) == ["r0", "r1", "r2", "r3"]


@pytest.mark.parametrize("stop", ["eos", "stop_token", "max_tokens", "context"])
def test_stop_conditions(stop: str):
    cfg, num_blocks = make_config()
    prompt = [5, 6, 7]
    ref, _, _, _ = run([prompt], max_tokens=20)
    first = ref["r0"][3]
    params = SamplingParams(max_tokens=20, seed=0)
    max_model_len = 1024
    if stop == "eos":
        params.eos_token_ids = [first]
    elif stop == "stop_token":
        params.stop_token_ids = [first]
    elif stop == "max_tokens":
        params.max_tokens = 4
    else:
        max_model_len = len(prompt) + 4
    sched = Scheduler(cfg, num_blocks, max_model_len=max_model_len)
    model = PagedToyModel(num_blocks, 4)
    sched.add_request(Request("r0", prompt, params))
    tokens, reason = [], None
    while sched.has_requests:
        step = sched.schedule()
        for out in sched.update_from_output(step, model.execute(step)):
            tokens += out.new_token_ids
            reason = out.finish_reason
    assert tokens == ref["r0"][:4]
    expected = FinishReason.STOP if stop in ("eos", "stop_token") else FinishReason.LENGTH
    assert reason == expected


def test_ignore_eos_and_min_tokens():
    prompt = [5, 6, 7]
    ref, _, _, _ = run([prompt], max_tokens=8)
    first = ref["r0"][0]
    cfg, num_blocks = make_config()
    ignore = SamplingParams(max_tokens=8, seed=0, eos_token_ids=[first], ignore_eos=True)
    min_tokens = SamplingParams(max_tokens=8, seed=0, stop_token_ids=[first], min_tokens=2)
    for params in (ignore, min_tokens):
        sched = Scheduler(cfg, num_blocks, max_model_len=1024)
        model = PagedToyModel(num_blocks, 4)
        sched.add_request(Request("r0", prompt, params))
        tokens = []
        while sched.has_requests:
            step = sched.schedule()
            for out in sched.update_from_output(step, model.execute(step)):
                tokens += out.new_token_ids
        # The toy model's text does not depend on stop settings, so only the length can differ.
        expected_len = (
            8
            if params is ignore
            else next((i + 1 for i, t in enumerate(ref["r0"]) if t == first and i + 1 >= 2), 8)
        )
        assert tokens == ref["r0"][:expected_len]


def test_linear_attention_states_follow_running_requests() -> None:
    """A hybrid model's state rows: one per running request, taken when it starts, given back at
    finish, abort and preemption, never two requests on one row."""
    cfg, num_blocks = make_config(num_blocks=16, max_num_seqs=3)
    sched = Scheduler(cfg, num_blocks, max_model_len=64, num_state_slots=3)
    model = PagedToyModel(num_blocks, 4)
    for i, p in enumerate(prompts_of(6, seed=5)):
        sched.add_request(Request(f"r{i}", p, SamplingParams(max_tokens=8, ignore_eos=True)))
    slot_of: dict[str, int] = {}
    aborted = False
    for _ in range(500):
        if not sched.has_requests:
            break
        step = sched.schedule()
        for r in step.requests:
            if r.sampling_params is not None:
                slot_of[r.req_id] = r.state_slot
        running = [r.state_slot for r in sched.running]
        assert sorted(running) == sorted(set(running)) and -1 not in running
        assert {slot_of[r.request_id] for r in sched.running} == set(running)
        assert len(sched.free_state_slots) == 3 - len(running)
        sched.update_from_output(step, model.execute(step))
        if not aborted and sched.running:
            sched.abort_requests([sched.running[0].request_id])
            aborted = True
    assert sched.num_preempted_total > 0
    assert sorted(sched.free_state_slots) == [0, 1, 2]
    assert sched.stats().num_free_state_slots == sched.stats().num_state_slots == 3


class HybridToyModel(PagedToyModel):
    """PagedToyModel with a linear-attention layer whose per-sequence state is every token it
    has taken in, as a worker keeps it: a state row per running request, checkpoint rows the
    scheduler names, restores before the step's tokens, saves at the offsets it is told. Each
    sampled step checks that the state is exactly the request's context."""

    def __init__(self, num_blocks: int, block_size: int, num_slots: int, num_checkpoints: int):
        super().__init__(num_blocks, block_size)
        self.states: list[list[int] | None] = [None] * num_slots
        self.checkpoints: list[list[int] | None] = [None] * num_checkpoints
        self.slot_of: dict[str, int] = {}

    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        for r in step.requests:
            if r.sampling_params is not None:
                self.slot_of[r.req_id] = r.state_slot
                restored = self.checkpoints[r.restore_checkpoint] if r.start_pos else []
                assert restored is not None and len(restored) == r.start_pos, r
                self.states[r.state_slot] = list(restored)
        for r in step.requests:
            state = self.states[self.slot_of[r.req_id]]
            assert state is not None and len(state) == r.start_pos
            saves = dict(r.save_checkpoints)
            for i, token in enumerate(r.token_ids):
                state.append(token)
                if i + 1 in saves:
                    self.checkpoints[saves[i + 1]] = list(state)
        out = super().execute(step)
        for r in step.requests:
            if r.sample_index >= 0:
                table = self.tables[r.req_id]
                context = [
                    self.slots[table[p // self.block_size]][p % self.block_size]
                    for p in range(len(self.states[self.slot_of[r.req_id]]))
                ]
                assert self.states[self.slot_of[r.req_id]] == context, r.req_id
        return out


@pytest.mark.parametrize("budget", [2048, 5])
def test_hybrid_prefix_hits_resume_from_checkpoints(budget: int) -> None:
    """Hybrid model, prefix caching on: hits end where the scheduler had states checkpointed,
    never at a checkpoint the same step is still writing, and every request's state is its
    context, through a checkpoint pool smaller than the prefixes (evictions), chunked prefill
    and preemption; outputs equal the run without prefix caching."""
    prompts = prompts_of(8, seed=3, shared_prefix=18) * 2
    kw = {"num_blocks": 24, "max_num_seqs": 4, "max_num_batched_tokens": budget}
    results = {}
    for caching in (0, 1):
        cfg, num_blocks = make_config(prefix_caching=caching, **kw)
        sched = Scheduler(cfg, num_blocks, 160, num_state_slots=4,
                          num_state_checkpoints=5, state_checkpoint_interval=8)  # fmt: skip
        model = HybridToyModel(num_blocks, 4, 4, 5)
        for i, p in enumerate(prompts):
            params = SamplingParams(max_tokens=10, seed=i, ignore_eos=True)
            sched.add_request(Request(f"r{i}", p, params))
        outputs: dict[str, list[int]] = {}
        for _ in range(2000):
            if not sched.has_requests:
                break
            step = sched.schedule()
            for r in step.requests:
                for offset, _ in r.save_checkpoints:
                    pos = r.start_pos + offset
                    assert pos % 8 == 0 or pos == (len(prompts[int(r.req_id[1:])]) - 1) // 4 * 4
            for out in sched.update_from_output(step, model.execute(step)):
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert not sched.has_requests
        results[caching] = outputs
        if caching:
            assert sched.kv.prefix_cache_hits > 0 and sched.num_preempted_total > 0
            assert sched.stats().num_used_state_checkpoints == 5
    assert results[1] == results[0]


def test_state_checkpoints_publish_after_their_step_and_evict_lru() -> None:
    from enginecore.state_checkpoints import StateCheckpoints

    cps = StateCheckpoints(2, 8)
    a, b, c = cps.reserve(b"a"), cps.reserve(b"b"), cps.reserve(b"c")
    assert {a, b} == {0, 1} and c is None  # both rows are being written this step
    assert not cps.is_ready(b"a") and cps.is_pending(b"a") and cps.lookup(b"a") is None
    cps.publish()
    assert cps.lookup(b"a") == a  # a is now the most recently used
    assert cps.reserve(b"c") == b and not cps.is_ready(b"b")
    cps.publish()
    assert cps.lookup(b"c") == b and cps.num_used == 2
    cps.clear()
    assert cps.num_used == 0 and not cps.is_ready(b"a")


def test_a_pinned_state_checkpoint_is_not_evicted_until_unpinned() -> None:
    """A producer's lease (prefill/decode disaggregation) pins the checkpoint its consumer
    pulls: eviction takes the least recently used unpinned one, or none."""
    from enginecore.state_checkpoints import StateCheckpoints

    cps = StateCheckpoints(2, 8)
    a, b = cps.reserve(b"a"), cps.reserve(b"b")
    cps.publish()
    assert cps.pin(b"a") == a and cps.pin(b"a") == a and cps.pin(b"nothing") is None
    assert cps.reserve(b"c") == b  # a is older, but pinned
    cps.publish()
    cps.pin(b"c")
    assert cps.reserve(b"d") is None  # every row pinned
    cps.unpin(b"a")
    assert cps.reserve(b"d") is None  # still held by the second lease
    cps.unpin(b"a")
    assert cps.reserve(b"d") == a and cps.lookup(b"c") == b


def test_cross_attention_rows_reach_the_frontend_once_per_output_position() -> None:
    """Word timestamps' rows (SamplingParams.cross_attention): the prompt's are dropped, each
    output position's row goes out once, the last token (never read) has none, a position
    recomputed after a preemption keeps the row it was generated with, and a rejected draft's
    row never goes out."""
    import numpy as np

    from enginecore.messages import CROSS_ATTENTION_FRAMES, CrossAttentionRows

    params = SamplingParams(max_tokens=8, cross_attention=CrossAttentionRows([(0, 1)]))
    request = Request("r", [1, 2, 3], params)

    def rows(start: int, n: int, mark: float = 0.0) -> bytes:
        values = np.arange(start, start + n, dtype=np.float32) + mark
        return np.repeat(values, CROSS_ATTENTION_FRAMES).tobytes()

    def positions(data: bytes) -> list[float]:
        return np.frombuffer(data, np.float32)[::CROSS_ATTENTION_FRAMES].tolist()

    request.append_output_token(10)  # the prompt's chunk sampled it
    assert request.take_cross_attention(0, rows(0, 3)) == b""
    request.append_output_token(11)  # a decode step read position 3 (token 10)
    assert positions(request.take_cross_attention(3, rows(3, 1))) == [3.0]
    request.append_output_token(12)
    assert positions(request.take_cross_attention(4, rows(4, 1))) == [4.0]
    # Preempted; recomputed from position 0 (tokens 1, 2, 3, 10, 11, 12), then 13 sampled:
    # positions 3 and 4 keep their rows, position 5 (token 12) is new.
    request.append_output_token(13)
    assert positions(request.take_cross_attention(0, rows(0, 6, mark=0.5))) == [5.5]
    # Drafts: positions 6 (13), 7 and 8 read; the draft at 7 accepted, 8's rejected.
    request.append_output_token(14)
    request.append_output_token(15)
    assert positions(request.take_cross_attention(6, rows(6, 3))) == [6.0, 7.0]
    assert request.num_cross_attention_rows == 5 == request.num_output_tokens - 1

"""KV-cache groups (workers/models/kv_cache_groups.py) and the scheduler's sliding-window block release.

`WindowedToyModel` is test_scheduler's paged toy model with one block table per KV-cache group: every
group stores every token, and the next token is derived from what each group *reads back* from its
blocks — all earlier tokens for a full-attention group, the last `window` for a sliding one. A block
given back while its window still sees it (and then reused by another request) changes the output, so
outputs must equal those of a single full-attention cache, with prefix caching, chunking and
preemption; and a long request's blocks must stay bounded by its windows.
"""

from __future__ import annotations

import hashlib
import random

import pytest

from enginecore.kv_cache_manager import servable_len
from enginecore.messages import ModelRunnerOutput, SamplingParams, SchedulerOutput
from enginecore.request import Request
from enginecore.scheduler import Scheduler
from tests.unit.test_scheduler import make_config
from workers.models.kv_cache_groups import KVCacheGroup, cache_slots, plan_kv_cache_groups

VOCAB = 1000
BLOCK = 4


class WindowedToyModel:
    def __init__(self, num_blocks: int, windows: list[int | None], read_windows: list[int | None]):
        """`windows`: the scheduler's groups; `read_windows`: what the model attends (a single
        full group can stand in for any windows: it holds every token)."""
        self.slots: list[list[int | None]] = [[None] * BLOCK for _ in range(num_blocks)]
        self.tables: dict[str, list[list[int]]] = {}
        self.windows = windows
        self.read_windows = read_windows

    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in step.finished_req_ids:
            self.tables.pop(req_id, None)
        for r in step.requests:
            if r.sampling_params is not None:
                self.tables[r.req_id] = [[] for _ in self.windows]
            for table, new in zip(
                self.tables[r.req_id], [r.new_block_ids, *r.other_group_block_ids]
            ):
                table.extend(new)
            for table in self.tables[r.req_id]:
                for i, tok in enumerate(r.token_ids):
                    pos = r.start_pos + i
                    self.slots[table[pos // BLOCK]][pos % BLOCK] = tok
        req_ids, sampled = [], []
        for r in step.requests:
            if r.sample_index < 0:
                continue
            end = r.start_pos + len(r.token_ids)
            seen = []
            for g, window in enumerate(self.read_windows):
                table = self.tables[r.req_id][g if len(self.windows) > 1 else 0]
                start = 0 if window is None else max(end - window, 0)
                seen.append([self.slots[table[p // BLOCK]][p % BLOCK] for p in range(start, end)])
            digest = hashlib.sha256(repr(seen).encode()).digest()
            req_ids.append(r.req_id)
            sampled.append(int.from_bytes(digest[:4], "little") % VOCAB)
        return ModelRunnerOutput(step.step_id, req_ids, [[t] for t in sampled])


def run(
    prompts: list[list[int]],
    windows: list[int | None],
    read_windows: list[int | None],
    max_tokens: int = 30,
    **kw: int,
) -> tuple[dict[str, list[int]], Scheduler, int]:
    """Outputs, the scheduler, and the most blocks in use at once."""
    cfg, num_blocks = make_config(**kw)
    sched = Scheduler(cfg, num_blocks, max_model_len=4096, kv_cache_windows=windows)
    model = WindowedToyModel(num_blocks, windows, read_windows)
    for i, p in enumerate(prompts):
        sched.add_request(
            Request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        )
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    peak = 0
    for _ in range(5000):
        if not sched.has_requests:
            break
        step = sched.schedule()
        peak = max(peak, num_blocks - sched.kv.num_free_blocks)
        for out in sched.update_from_output(step, model.execute(step)):
            outputs[out.request_id] += out.new_token_ids
    assert not sched.has_requests, "requests did not finish"
    assert sched.kv.num_free_blocks == num_blocks
    return outputs, sched, peak


def prompts_of(n: int, seed: int = 0, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(VOCAB) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))] for _ in range(n)]


@pytest.mark.parametrize(("windows", "few_blocks"), [([None, 6, 6], 40), ([5], 7), ([None, 9], 30)])
def test_outputs_equal_a_full_cache_whatever_the_scheduling(
    windows: list[int | None], few_blocks: int
) -> None:
    prompts = prompts_of(8, shared_prefix=13)
    ref, _, _ = run(prompts, [None], windows, prefix_caching=0)
    assert run(prompts, windows, windows, prefix_caching=0)[0] == ref
    out, sched, _ = run(prompts, windows, windows)  # shared prefixes hit the cache
    assert out == ref and sched.kv.prefix_cache_hits > 0
    assert run(prompts, windows, windows, max_num_batched_tokens=5)[0] == ref
    out, sched, _ = run(prompts, windows, windows, num_blocks=few_blocks, max_num_batched_tokens=7)
    assert sched.num_preempted_total > 0
    assert out == ref
    out, sched, _ = run(prompts, windows, windows, num_blocks=few_blocks, max_num_batched_tokens=7,
                        prefix_caching=0)  # fmt: skip
    assert sched.num_preempted_total > 0
    assert out == ref


def test_a_long_request_holds_its_windows_and_its_full_layers_blocks() -> None:
    prompt = prompts_of(1, seed=3)[0][:10]
    out_full, _, peak_full = run([prompt], [None], [None, 6, 6], max_tokens=200)
    out, _, peak = run([prompt], [None, 6, 6], [None, 6, 6], max_tokens=200)
    assert out == out_full
    length = len(prompt) + 200
    assert peak_full == -(-length // BLOCK)
    # The full group holds every block; each sliding group the 3 that 6 tokens can straddle.
    assert peak == -(-length // BLOCK) + 2 * 3
    out_full, _, _ = run([prompt], [None], [6], max_tokens=200)
    out, _, peak = run([prompt], [6], [6], max_tokens=200)
    assert out == out_full and peak == 3


def test_a_prefix_hit_on_a_sliding_model_needs_only_its_window() -> None:
    cfg, num_blocks = make_config()
    sched = Scheduler(cfg, num_blocks, max_model_len=1024, kv_cache_windows=[5])
    model = WindowedToyModel(num_blocks, [5], [5])
    prompt = list(range(1, 40))
    for i in range(2):
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=2)))
        steps = []
        while sched.has_requests:
            step = sched.schedule()
            steps.append(step)
            sched.update_from_output(step, model.execute(step))
    first = steps[0].requests[0]
    # 9 cached blocks (36 tokens): a query at 36 sees keys 32..36, so only block 8 is held; the
    # blocks before it are sent as 0 and never read.
    assert first.start_pos == 36
    assert first.new_block_ids[:8] == [0] * 8 and first.new_block_ids[8] != 0


def test_plans() -> None:
    gemma3 = {i: None if i % 6 == 5 else 512 for i in range(26)}  # 4 global, 22 local layers
    groups = plan_kv_cache_groups(gemma3)
    assert groups[0] == KVCacheGroup(None, (5, 11, 17, 23))
    assert [g.window for g in groups] == [None] + [512] * 6
    assert [len(g.layers) for g in groups[1:]] == [4, 4, 4, 4, 4, 2]
    assert sorted(x for g in groups for x in g.layers) == list(range(26))
    assert plan_kv_cache_groups({0: 4096, 1: 4096}) == [KVCacheGroup(4096, (0, 1))]
    assert plan_kv_cache_groups({}) == [KVCacheGroup(None, ())]
    # A stage of layers 0..12: each layer's slot is its rank among its group's layers there.
    slots = cache_slots(groups, range(13))
    assert slots[5] == (0, 0) and slots[11] == (0, 1) and slots[3] == (1, 3) and slots[4] == (2, 0)
    assert max(s for _, s in slots.values()) == 3


def test_servable_len() -> None:
    assert servable_len(10_000, 100, 16, [None], 2048) == 1600  # a full cache: every token
    assert servable_len(10_000, 100, 16, [512], 256) == 10_000  # window + step fit: any length
    # One full group beside two sliding ones that hold 512 + 256 tokens each at most.
    assert servable_len(10_000, 200, 16, [None, 512, 512], 256) == (200 - 2 * 49) * 16

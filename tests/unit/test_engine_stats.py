"""What the engine core reports for metrics and logs: token totals, first-output timestamps, the
periodic log line."""

from __future__ import annotations

import time

from enginecore.core_proc import StatsLogger
from enginecore.messages import SamplingParams, SchedulerStats
from enginecore.request import Request
from enginecore.scheduler import Scheduler
from tests.unit.test_scheduler import PagedToyModel, make_config


def test_token_totals_and_first_output_timestamps() -> None:
    cfg, num_blocks = make_config(max_num_batched_tokens=8)
    sched = Scheduler(cfg, num_blocks, max_model_len=256)
    model = PagedToyModel(num_blocks, 4)
    t0 = time.time()
    prompts = {"a": list(range(1, 21)), "b": list(range(50, 53))}
    for rid, prompt in prompts.items():
        sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=5, ignore_eos=True)))
    firsts, counts = {}, {"a": 0, "b": 0}
    while sched.has_requests:
        step = sched.schedule()
        for out in sched.update_from_output(step, model.execute(step)):
            counts[out.request_id] += len(out.new_token_ids)
            if out.queued_time is not None:
                assert out.request_id not in firsts, "timestamps come with the first output only"
                firsts[out.request_id] = out
    assert counts == {"a": 5, "b": 5}
    for out in firsts.values():
        assert t0 <= out.queued_time <= out.first_scheduled_time <= time.time()
    stats = sched.stats()
    # Every prompt token is prefilled once (no prefix hits here); each later token is a decode.
    assert stats.num_prefill_tokens_total == 20 + 3
    assert stats.num_generated_tokens_total == 10


def _stats(prefill: int, generated: int, queries: int, hits: int, running: int) -> SchedulerStats:
    return SchedulerStats(
        num_running_reqs=running,
        num_waiting_reqs=0,
        num_preempted_total=0,
        num_free_blocks=75,
        num_total_blocks=100,
        block_size=16,
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
        num_prefill_tokens_total=prefill,
        num_generated_tokens_total=generated,
    )


def test_stats_logger_reports_rates_over_the_interval() -> None:
    logger = StatsLogger(interval_s=0.05)
    assert logger.maybe_log(lambda: _stats(0, 0, 0, 0, 0)) is None  # too early
    time.sleep(0.06)
    line = logger.maybe_log(lambda: _stats(100, 10, 200, 50, 2))
    assert line is not None
    assert "running: 2 reqs" in line and "KV cache usage: 25.0%" in line
    assert "prefix cache hit rate: 25.0%" in line
    time.sleep(0.06)
    # Idle for a whole interval (no running request, no token): nothing is logged.
    assert logger.maybe_log(lambda: _stats(100, 10, 200, 50, 0)) is None
    time.sleep(0.06)
    line = logger.maybe_log(lambda: _stats(100, 30, 200, 50, 0))
    assert line is not None and "prefix cache hit rate: 0.0%" in line


def test_stats_logger_does_not_read_stats_between_intervals() -> None:
    logger = StatsLogger(interval_s=60.0)

    def fail() -> SchedulerStats:
        raise AssertionError("stats read before the interval passed")

    assert logger.maybe_log(fail) is None

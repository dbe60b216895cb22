"""Prometheus metrics of a tern server, served at GET /metrics (prometheus-client text format).

Names follow vLLM's with a `tern:` prefix, each labelled with the served model name:
- per request, measured here: time to first token, time per output token (mean over the request's
  decode), end-to-end latency, queue time (from the engine core's timestamps); prompt and generation
  token counters (the tokens served: what `usage` reports); successes by finish reason.
- engine state, from the engine core's last SchedulerStats (it sends them every ~0.5 s while busy
  and when it goes idle): running and waiting requests, preemptions, KV-cache usage, prefix-cache
  queries and hits (in tokens).
Each server has its own registry: nothing is global, so several apps can live in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from enginecore.messages import SchedulerStats

__all__ = ["CONTENT_TYPE_LATEST", "Metrics"]

# As vLLM: no `*_created` series (a timestamp per counter that no dashboard reads). Process-wide.
disable_created_metrics()

# vLLM's buckets, so that dashboards built for it read the same.
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_TPOT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort")


class Metrics:
    """The server's metrics; Generation objects report to it as their requests progress."""

    def __init__(self, model_name: str, engine_stats: Callable[[], SchedulerStats | None]) -> None:
        self.registry = CollectorRegistry()
        reg, labels = self.registry, ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=reg).labels(model_name)

        self.ttft = histogram(
            "tern:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS
        )
        self.tpot = histogram(
            "tern:time_per_output_token_seconds",
            "Mean time per output token after the first, one sample per request.",
            _TPOT_BUCKETS,
        )
        self.e2e = histogram(
            "tern:e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "tern:request_queue_time_seconds",
            "Time a request waited in the engine core before it was first scheduled.",
            _LATENCY_BUCKETS,
        )
        self.prompt_tokens = Counter(
            "tern:prompt_tokens", "Prompt tokens of requests that got a first token.", labels,
            registry=reg,
        ).labels(model_name)  # fmt: skip
        self.generation_tokens = Counter(
            "tern:generation_tokens", "Output tokens served (as counted in usage).", labels,
            registry=reg,
        ).labels(model_name)  # fmt: skip
        success = Counter(
            "tern:request_success",
            "Requests finished, by finish reason.",
            [*labels, "finished_reason"],
            registry=reg,
        )
        self.success = {r: success.labels(model_name, r) for r in FINISH_REASONS}
        reg.register(_EngineStatsCollector(model_name, engine_stats))

    def on_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        self.ttft.observe(ttft_s)
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_scheduled(self, queue_time_s: float) -> None:
        self.queue_time.observe(queue_time_s)

    def on_new_tokens(self, num_tokens: int) -> None:
        self.generation_tokens.inc(num_tokens)

    def on_finish(self, reason: str, e2e_s: float, time_per_output_token_s: float | None) -> None:
        self.success[reason].inc()
        self.e2e.observe(e2e_s)
        if time_per_output_token_s is not None:
            self.tpot.observe(time_per_output_token_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineStatsCollector(Collector):
    """Reads the engine core's last SchedulerStats at scrape time (zeros before the first)."""

    def __init__(self, model_name: str, engine_stats: Callable[[], SchedulerStats | None]) -> None:
        self.model_name = model_name
        self.engine_stats = engine_stats

    def collect(self) -> Iterator[Metric]:
        s = self.engine_stats()
        running = s.num_running_reqs if s else 0
        waiting = s.num_waiting_reqs if s else 0
        usage = 1.0 - s.num_free_blocks / s.num_total_blocks if s and s.num_total_blocks else 0.0
        yield self._gauge("num_requests_running", "Requests in the running batch.", running)
        yield self._gauge("num_requests_waiting", "Requests waiting to be scheduled.", waiting)
        yield self._gauge("kv_cache_usage_perc", "KV-cache usage (1 = full).", usage)
        yield self._counter(
            "num_preemptions", "Preemptions (a request's KV blocks freed for recomputation).",
            s.num_preempted_total if s else 0,
        )  # fmt: skip
        yield self._counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
            s.prefix_cache_queries if s else 0,
        )  # fmt: skip
        yield self._counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
            s.prefix_cache_hits if s else 0,
        )  # fmt: skip

    def _gauge(self, name: str, doc: str, value: float) -> Metric:
        family = GaugeMetricFamily(f"tern:{name}", doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> Metric:
        family = CounterMetricFamily(f"tern:{name}", doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

"""Prometheus metrics of a tern server, served at GET /metrics (prometheus-client text format).

Names follow vLLM's with a `tern:` prefix, each labelled with the served model name:
- per request, measured here: time to first token, time per output token (mean over the request's
  decode), end-to-end latency, queue time (from the engine core's timestamps); prompt and generation
  token counters (the tokens served: what `usage` reports); successes by finish reason.
- engine state, from the engine cores' last SchedulerStats (each sends them every ~0.5 s while busy
  and when it goes idle): running and waiting requests, preemptions, KV-cache usage, prefix-cache
  queries and hits (in tokens); with prefill/decode disaggregation, vLLM's external prefix cache
  (prompt tokens a consumer looked up at a producer and pulled), pulls, failures and bytes, and
  a producer's leases lent and held.
With --dp > 1 the engine-state series have one sample per replica (label `replica`), and
`tern:replica_*` families show each replica's health, the requests the balancer sent it (by reason:
`prefix` or `load`), and the tokens its engine computed and sampled.

Every family whose quantity vLLM also exports is served a second time under vLLM's name
(VLLM_NAMES: `vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, ...), so that the routers,
dashboards and autoscalers built for vLLM read tern unchanged; the engine-state twins carry vLLM's
`engine` label (the replica) as vLLM's data-parallel engines do.
Each server has its own registries: nothing is global, so several apps can live in one process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from frontend.engine.client import ReplicaSnapshot

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

# tern family -> the name vLLM exports the same quantity under (counters without `_total`).
# NOTE: tern's time per output token is one sample per request (the mean over its decode): vLLM's
# request_time_per_output_token_seconds, not its per-token inter_token_latency_seconds.
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "tern:time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "tern:time_per_output_token_seconds": ("vllm:request_time_per_output_token_seconds",),
    "tern:e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "tern:request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    "tern:prompt_tokens": ("vllm:prompt_tokens",),
    "tern:generation_tokens": ("vllm:generation_tokens",),
    "tern:request_success": ("vllm:request_success",),
    "tern:num_requests_running": ("vllm:num_requests_running",),
    "tern:num_requests_waiting": ("vllm:num_requests_waiting",),
    # gpu_cache_usage_perc: vLLM's name before v0.10, still what older autoscaler recipes read.
    "tern:kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "tern:num_preemptions": ("vllm:num_preemptions",),
    "tern:prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "tern:prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "tern:external_prefix_cache_queries": ("vllm:external_prefix_cache_queries",),
    "tern:external_prefix_cache_hits": ("vllm:external_prefix_cache_hits",),
    "tern:lora_requests_info": ("vllm:lora_requests_info",),
    "tern:spec_decode_num_drafts": ("vllm:spec_decode_num_drafts",),
    "tern:spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "tern:spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
    "tern:spec_decode_num_accepted_tokens_per_pos": (
        "vllm:spec_decode_num_accepted_tokens_per_pos",
    ),
}
# Families measured per engine core: vLLM labels them with `engine`.
_ENGINE_STATE = frozenset(
    {
        "tern:num_requests_running",
        "tern:num_requests_waiting",
        "tern:kv_cache_usage_perc",
        "tern:num_preemptions",
        "tern:prefix_cache_queries",
        "tern:prefix_cache_hits",
        "tern:external_prefix_cache_queries",
        "tern:external_prefix_cache_hits",
        "tern:spec_decode_num_drafts",
        "tern:spec_decode_num_draft_tokens",
        "tern:spec_decode_num_accepted_tokens",
        "tern:spec_decode_num_accepted_tokens_per_pos",
    }
)


class Metrics:
    """The server's metrics; Generation objects report to it as their requests progress."""

    def __init__(self, model_name: str, engine_stats: Callable[[], SchedulerStats | None]) -> None:
        # `tern` holds the tern: families; `registry` (what /metrics serves) them and their twins.
        tern = CollectorRegistry()
        self.registry = CollectorRegistry()
        self.registry.register(_VllmTwins(tern))
        # With --dp > 1 (set by build_app): each replica's state, for per-replica series.
        self.replicas: Callable[[], list[ReplicaSnapshot]] | None = None
        reg, labels = tern, ["model_name"]

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
        reg.register(_EngineStatsCollector(model_name, engine_stats, lambda: self.replicas))

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
    """Reads the engine cores' last SchedulerStats at scrape time (zeros before the first): the
    sum of every replica's (one sample each, labelled `replica`, when `replicas` is set)."""

    def __init__(
        self,
        model_name: str,
        engine_stats: Callable[[], SchedulerStats | None],
        replicas: Callable[[], Callable[[], list[ReplicaSnapshot]] | None],
    ) -> None:
        self.model_name = model_name
        self.engine_stats = engine_stats
        self.replicas = replicas

    def collect(self) -> Iterator[Metric]:
        source = self.replicas()
        if source is None:
            rows = [([self.model_name], self.engine_stats(), True)]
            label_names = ["model_name"]
        else:
            snapshots = source()
            rows = [([self.model_name, str(r.index)], r.stats, r.is_alive) for r in snapshots]
            label_names = ["model_name", "replica"]
            yield from _replica_families(self.model_name, snapshots)

        def family(kind: type, name: str, doc: str, value: Callable[..., float]) -> Metric:
            f = kind(f"tern:{name}", doc, labels=label_names)
            for labels, s, is_alive in rows:
                f.add_metric(labels, value(s, is_alive) if s else 0)
            return f

        G, C = GaugeMetricFamily, CounterMetricFamily  # noqa: N806
        yield family(G, "num_requests_running", "Requests in the running batch.",
                     lambda s, up: s.num_running_reqs if up else 0)  # fmt: skip
        yield family(G, "num_requests_waiting", "Requests waiting to be scheduled.",
                     lambda s, up: s.num_waiting_reqs if up else 0)  # fmt: skip
        yield from _cache_families(family)
        yield family(C, "num_preemptions",
                     "Preemptions (a request's KV blocks freed for recomputation).",
                     lambda s, up: s.num_preempted_total)  # fmt: skip
        yield family(C, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                     lambda s, up: s.prefix_cache_queries)  # fmt: skip
        yield family(C, "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                     lambda s, up: s.prefix_cache_hits)  # fmt: skip
        yield from _kv_transfer_families(family)
        yield from _spec_decode_families(family, rows, label_names)
        yield from _breakdown_families(rows, label_names)


def _cache_families(family: Callable[..., Metric]) -> Iterator[Metric]:
    """The KV cache's blocks and the linear-attention states' pools."""
    G = GaugeMetricFamily  # noqa: N806
    yield family(G, "kv_cache_usage_perc", "KV-cache usage (1 = full).",
                 lambda s, up: _kv_usage(s) if up else 0.0)  # fmt: skip
    yield family(G, "kv_cache_blocks_used",
                 "KV-cache blocks held by requests (sliding-window layers give back the "
                 "blocks out of their window).",
                 lambda s, up: s.num_total_blocks - s.num_free_blocks if up else 0)  # fmt: skip
    yield family(G, "kv_cache_blocks_total", "KV-cache blocks in the pool.",
                 lambda s, up: s.num_total_blocks)  # fmt: skip
    yield family(G, "linear_attention_states_used",
                 "Per-sequence linear-attention states held by running requests (hybrid "
                 "models such as Qwen3.5; counted in --kv-cache-memory).",
                 lambda s, up: s.num_state_slots - s.num_free_state_slots if up else 0)  # fmt: skip
    yield family(G, "linear_attention_states_total",
                 "Per-sequence linear-attention states in the pool (--max-num-seqs).",
                 lambda s, up: s.num_state_slots)  # fmt: skip
    yield family(G, "linear_attention_checkpoints_used",
                 "Linear-attention state checkpoints holding a cached prefix's states "
                 "(hybrid models with prefix caching).",
                 lambda s, up: s.num_used_state_checkpoints if up else 0)  # fmt: skip
    yield family(G, "linear_attention_checkpoints_total",
                 "Linear-attention state checkpoints kept for the prefix cache.",
                 lambda s, up: s.num_state_checkpoints)  # fmt: skip


def _spec_decode_families(
    family: Callable[..., Metric], rows: list[tuple], label_names: list[str]
) -> Iterator[Metric]:
    """Speculative decoding's counters (vLLM's names), the accepted drafts by draft position."""
    C = CounterMetricFamily  # noqa: N806
    yield family(C, "spec_decode_num_drafts",
                 "Speculative decoding: sequence-steps that verified drafts.",
                 lambda s, up: s.spec_num_drafts)  # fmt: skip
    yield family(C, "spec_decode_num_draft_tokens", "Speculative decoding: drafts verified.",
                 lambda s, up: s.spec_num_draft_tokens)  # fmt: skip
    yield family(C, "spec_decode_num_accepted_tokens",
                 "Speculative decoding: drafts accepted.",
                 lambda s, up: s.spec_num_accepted_tokens)  # fmt: skip
    per_pos = C("tern:spec_decode_num_accepted_tokens_per_pos",
                "Speculative decoding: drafts accepted at each draft position (0: first).",
                labels=[*label_names, "position"])  # fmt: skip
    for labels, s, _ in rows:
        for pos, n in enumerate(s.spec_accepted_per_pos if s is not None else []):
            per_pos.add_metric([*labels, str(pos)], n)
    yield per_pos


def _breakdown_families(rows: list[tuple], label_names: list[str]) -> Iterator[Metric]:
    """The families labelled beyond the replica: tokens per MoE expert, the LoRA adapters."""
    G, C = GaugeMetricFamily, CounterMetricFamily  # noqa: N806
    experts = C("tern:moe_expert_tokens",
                "Tokens routed to each expert of each mixture-of-experts layer (layer: its "
                "index among the MoE layers); a token counts once per expert of its top-k.",
                labels=[*label_names, "layer", "expert"])  # fmt: skip
    loras = G("tern:lora_requests_info",
              "LoRA adapters in use (vLLM's): --max-loras and the adapters of the running "
              "and the waiting requests, comma-separated; the value is the scrape time.",
              labels=[*label_names, "max_lora", "running_lora_adapters",
                      "waiting_lora_adapters"])  # fmt: skip
    for labels, s, _ in rows:
        if s is not None and s.max_lora:
            adapters = [",".join(s.running_lora_adapters), ",".join(s.waiting_lora_adapters)]
            loras.add_metric([*labels, str(s.max_lora), *adapters], time.time())
    yield loras
    for labels, s, _ in rows:
        if s is not None and s.num_experts:
            for i, n in enumerate(s.expert_tokens_total):
                layer, expert = divmod(i, s.num_experts)
                experts.add_metric([*labels, str(layer), str(expert)], n)
    yield experts


def _kv_transfer_families(family: Callable[..., Metric]) -> Iterator[Metric]:
    """Prefill/decode disaggregation: a consumer's pulls (vLLM's external prefix cache), a
    producer's leases."""
    G, C = GaugeMetricFamily, CounterMetricFamily  # noqa: N806
    yield family(C, "external_prefix_cache_queries",
                 "Prompt tokens a KV consumer looked up at a producer.",
                 lambda s, up: s.external_prefix_cache_queries)  # fmt: skip
    yield family(C, "external_prefix_cache_hits",
                 "Prompt tokens a KV consumer pulled from a producer.",
                 lambda s, up: s.external_prefix_cache_hits)  # fmt: skip
    yield family(C, "kv_pulls", "KV pulls from producers that succeeded.",
                 lambda s, up: s.kv_pulls_total)  # fmt: skip
    yield family(C, "kv_pull_failures", "KV pulls from producers that failed.",
                 lambda s, up: s.kv_pull_failures_total)  # fmt: skip
    yield family(C, "kv_pull_bytes", "Bytes of KV blocks pulled from producers.",
                 lambda s, up: s.kv_pull_bytes_total)  # fmt: skip
    yield family(C, "computed_prompt_tokens",
                 "Prompt tokens computed here (prefill; recomputation included): a consumer "
                 "computes what it did not pull.",
                 lambda s, up: s.num_prefill_tokens_total)  # fmt: skip
    yield family(C, "kv_leases", "A KV producer's prompts lent to consumers.",
                 lambda s, up: s.kv_leases_total)  # fmt: skip
    yield family(G, "kv_leases_held", "A KV producer's leases not yet released nor expired.",
                 lambda s, up: s.num_kv_leases if up else 0)  # fmt: skip


def _kv_usage(s: SchedulerStats) -> float:
    return 1.0 - s.num_free_blocks / s.num_total_blocks if s.num_total_blocks else 0.0


def _replica_families(model_name: str, replicas: list[ReplicaSnapshot]) -> Iterator[Metric]:
    labels = ["model_name", "replica"]
    up = GaugeMetricFamily(
        "tern:replica_up", "1 while the replica serves, 0 once it died.", labels=labels
    )
    in_flight = GaugeMetricFamily(
        "tern:replica_requests_in_flight",
        "Requests the frontend has on the replica.",
        labels=labels,
    )
    routed = CounterMetricFamily(
        "tern:replica_requests_routed",
        "Requests sent to the replica, by why: prefix (it holds the prompt's prefix) or load.",
        labels=[*labels, "reason"],
    )
    prefill = CounterMetricFamily(
        "tern:replica_prompt_tokens_computed",
        "Prompt tokens the replica computed (prefill; recomputation included).",
        labels=labels,
    )
    sampled = CounterMetricFamily(
        "tern:replica_generation_tokens_sampled", "Tokens the replica sampled.", labels=labels
    )
    for r in replicas:
        values = [model_name, str(r.index)]
        up.add_metric(values, 1 if r.is_alive else 0)
        in_flight.add_metric(values, r.num_in_flight)
        for reason, n in r.num_routed.items():
            routed.add_metric([*values, reason], n)
        prefill.add_metric(values, r.stats.num_prefill_tokens_total if r.stats else 0)
        sampled.add_metric(values, r.stats.num_generated_tokens_total if r.stats else 0)
    yield from (up, in_flight, routed, prefill, sampled)


class _VllmTwins(Collector):
    """Every family of `source`, then its twins under vLLM's names (VLLM_NAMES)."""

    def __init__(self, source: CollectorRegistry) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        families = list(self.source.collect())
        yield from families
        for family in families:
            for name in VLLM_NAMES.get(family.name, ()):
                yield _renamed(family, name, engine_label=family.name in _ENGINE_STATE)


def _renamed(family: Metric, name: str, engine_label: bool) -> Metric:
    twin = Metric(name, family.documentation, family.type)
    for s in family.samples:
        labels = dict(s.labels)
        if engine_label:
            labels["engine"] = labels.pop("replica", "0")
        twin.add_sample(name + s.name[len(family.name) :], labels, s.value, s.timestamp)
    return twin

"""/metrics serves every tern: family whose quantity vLLM exports under vLLM's name too, with the
same samples (engine-state twins labelled by `engine`), and one sample per replica with --dp > 1."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from enginecore.messages import SchedulerStats
from frontend.common.metrics import VLLM_NAMES, Metrics
from frontend.engine.client import ReplicaSnapshot


def samples(m: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_every_vllm_twin_carries_the_tern_samples() -> None:
    stats = SchedulerStats(2, 3, 1, 30, 40, 16, 100, 60, 500, 70, max_lora=4,
                           running_lora_adapters=["a", "b"], waiting_lora_adapters=["c"],
                           spec_num_drafts=9, spec_num_draft_tokens=30, spec_num_accepted_tokens=12,
                           spec_accepted_per_pos=[7, 4, 1])  # fmt: skip
    m = Metrics("tiny", lambda: stats)
    m.on_first_token(0.2, 11)
    m.on_new_tokens(5)
    m.on_scheduled(0.01)
    m.on_finish("length", 1.5, 0.05)
    got = samples(m)
    names = {name for name, _ in got}
    for tern, twins in VLLM_NAMES.items():
        for twin in twins:
            tern_samples = {(n, lab): v for (n, lab), v in got.items() if n.startswith(tern)}
            assert tern_samples, tern
            for (name, labels), value in tern_samples.items():
                twin_labels = dict(labels)
                per_engine = ("running", "waiting", "perc", "preemptions", "queries", "hits")
                if twin.endswith(per_engine) or "spec_decode" in twin:
                    twin_labels["engine"] = "0"
                key = (twin + name[len(tern) :], tuple(sorted(twin_labels.items())))
                assert got[key] == value, key
    assert {"vllm:num_requests_running", "vllm:prompt_tokens_total", "vllm:kv_cache_usage_perc",
            "vllm:time_to_first_token_seconds_count", "vllm:prefix_cache_hits_total",
            "vllm:request_success_total"} <= names  # fmt: skip
    assert got[("vllm:kv_cache_usage_perc", (("engine", "0"), ("model_name", "tiny")))] == 0.25
    lora = (("max_lora", "4"), ("model_name", "tiny"), ("running_lora_adapters", "a,b"),
            ("waiting_lora_adapters", "c"))  # fmt: skip
    assert ("vllm:lora_requests_info", lora) in got
    pos1 = (("engine", "0"), ("model_name", "tiny"), ("position", "1"))
    assert got[("vllm:spec_decode_num_accepted_tokens_per_pos_total", pos1)] == 4
    assert (
        got[("vllm:spec_decode_num_draft_tokens_total", (("engine", "0"), ("model_name", "tiny")))]
        == 30
    )


def test_replicas_get_a_sample_each() -> None:
    stats = [
        SchedulerStats(1, 0, 0, 8, 16, 16, 4, 2, 9, 3),
        SchedulerStats(0, 2, 0, 16, 16, 16, 0, 0),
    ]
    m = Metrics("tiny", lambda: None)
    m.replicas = lambda: [
        ReplicaSnapshot(i, i == 0, None if i == 0 else "died", s, 1 - i, {"prefix": i, "load": 3})
        for i, s in enumerate(stats)
    ]
    got = samples(m)

    def value(name: str, **labels: str) -> float:
        return got[(name, tuple(sorted({"model_name": "tiny", **labels}.items())))]

    assert value("tern:num_requests_running", replica="0") == 1
    assert value("tern:num_requests_waiting", replica="1") == 0  # dead: its queue is gone
    assert value("vllm:num_requests_running", engine="0") == 1
    assert value("tern:kv_cache_usage_perc", replica="0") == 0.5
    assert value("tern:replica_up", replica="1") == 0
    assert value("tern:replica_requests_routed_total", replica="1", reason="prefix") == 1
    assert value("tern:replica_generation_tokens_sampled_total", replica="0") == 3


def test_blocks_and_linear_attention_states() -> None:
    stats = SchedulerStats(
        2, 0, 0, 30, 40, 16, 0, 0, num_state_slots=8, num_free_state_slots=6,
        num_state_checkpoints=20, num_used_state_checkpoints=5,
    )  # fmt: skip
    got = samples(Metrics("tiny", lambda: stats))

    def value(name: str) -> float:
        return got[(name, (("model_name", "tiny"),))]

    assert value("tern:kv_cache_blocks_used") == 10 and value("tern:kv_cache_blocks_total") == 40
    assert value("tern:linear_attention_states_used") == 2
    assert value("tern:linear_attention_states_total") == 8
    assert value("tern:linear_attention_checkpoints_used") == 5
    assert value("tern:linear_attention_checkpoints_total") == 20

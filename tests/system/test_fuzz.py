"""schemathesis drives every route of /openapi.json with generated requests (a bounded number per
operation, derandomized so CI sees the same cases): no 5xx, every error in OpenAI's shape, and the
server answers a greedy request exactly as before the fuzzing.

Left out: the routes whose valid inputs legitimately stop serving (/sleep, /pause_generation: a
`keep` pause holds every later request) or reach other hosts (a weight-update group's
master_address); the routes that undo them are fuzzed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

pytestmark = pytest.mark.timeout(900)

EXCLUDED = (
    r"^/(sleep|release_memory_occupation|pause_generation|init_weights_update_group"
    r"|update_weights_from_distributed)$"
)
EXAMPLES = 6  # per operation, at most (hypothesis stops early on small input spaces)
GREEDY = {"prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def fuzz_server(module_server: Any, tiny_llama_with_tokenizer: Path) -> Any:
    return module_server(
        "--model", str(tiny_llama_with_tokenizer), "--dtype", "float32", "--max-model-len", "256",
        "--served-model-name", "tiny",
    )  # fmt: skip


def greedy(server: Any) -> list[str]:
    r = httpx.post(f"{server.base_url}/v1/completions", json=GREEDY, timeout=60)
    assert r.status_code == 200, r.text
    return [c["text"] for c in r.json()["choices"]]


def check_response(case: Any, response: Any) -> None:
    where = f"{case.method} {case.path}: {response.status_code} {response.text[:300]}"
    assert response.status_code < 500, where
    if response.status_code >= 400:
        body = response.json()
        error = body["error"]
        assert isinstance(error["message"], str) and isinstance(error["type"], str), where
        if case.path.startswith("/v1/messages"):  # Anthropic's shape
            assert body["type"] == "error", where
        else:
            assert "param" in error and "code" in error, where


def test_fuzz_every_route_then_greedy_is_unchanged(fuzz_server: Any) -> None:
    before = greedy(fuzz_server)
    schema = schemathesis.openapi.from_url(f"{fuzz_server.base_url}/openapi.json")
    operations = [
        result.ok() for result in schema.exclude(path_regex=EXCLUDED).get_all_operations()
    ]
    assert len(operations) >= 25
    statuses: list[int] = []
    for operation in operations:

        @settings(
            max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
            suppress_health_check=list(HealthCheck),
        )  # fmt: skip
        @given(case=operation.as_strategy())
        def fuzz(case: Any) -> None:
            response = case.call(base_url=fuzz_server.base_url, timeout=120)
            statuses.append(response.status_code)
            check_response(case, response)

        fuzz()
    # Both kinds were generated: valid requests served, invalid ones refused.
    assert len(statuses) > 60 and 200 in statuses and 400 in statuses, sorted(statuses)
    httpx.post(f"{fuzz_server.base_url}/resume_generation", timeout=60)
    assert greedy(fuzz_server) == before
    health = httpx.get(f"{fuzz_server.base_url}/health", timeout=30)
    assert health.status_code == 200

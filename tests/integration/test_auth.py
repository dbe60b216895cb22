"""Access control of a real server started with --api-key, --admin-api-key, --allowed-origins and a
small --max-request-body-bytes: 401 on every protected route without or with a wrong key (and the
engine never sees those requests), 200 with it; control routes open to the admin key alone; open
routes stay open; 413 for oversized bodies (by Content-Length and chunked); CORS preflights allowed
for the listed origin only. Control routes served to loopback clients only when no key is set: see
tests/unit/test_access_control.py (tests reach servers only through 127.0.0.1).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from frontend.server.middleware import CONTROL_PATHS

pytestmark = pytest.mark.timeout(600)

KEY = "test-key-123"
GOOD_ORIGIN = "http://good.example"
BODY_LIMIT = 65536
AUTH = {"Authorization": f"Bearer {KEY}"}
ADMIN_KEY = "admin-key-456"
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}

# (method, path, JSON body) of every protected route, each valid (200) once the key is right.
PROTECTED: list[tuple[str, str, dict[str, Any] | None]] = [
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/m2", None),
    ("POST", "/v1/completions", {"model": "m2", "prompt": "Hi", "max_tokens": 2}),
    (
        "POST",
        "/v1/chat/completions",
        {"model": "m1", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    ),
    ("POST", "/v1/responses", {"model": "m1", "input": "Hi", "max_output_tokens": 2}),
    ("POST", "/generate", {"prompt": "Hi", "max_tokens": 2}),
    ("POST", "/abort_request", {"abort_all": True}),
    ("POST", "/tokenize", {"prompt": "Hi"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("GET", "/server_info", None),
]
OPEN = ["/health", "/metrics", "/version", "/ping"]


@pytest.fixture(scope="module")
def server(module_server: Any, tiny_llama: Path, tokenizer_dir: Path | None) -> Any:
    if tokenizer_dir is None:
        pytest.skip("needs the default model's tokenizer (python -m frontend.model_prep)")
    return module_server(
        "--model", str(tiny_llama), "--dtype", "float32", "--max-model-len", "512",
        "--api-key", KEY, "--admin-api-key", ADMIN_KEY, "--served-model-name", "m1", "m2",
        "--allowed-origins", f'["{GOOD_ORIGIN}"]',
        "--max-request-body-bytes", str(BODY_LIMIT),
    )  # fmt: skip


def call(server: Any, method: str, path: str, body: Any = None, **kw: Any) -> httpx.Response:
    return httpx.request(method, f"{server.base_url}{path}", json=body, timeout=60, **kw)


def engine_counters(server: Any) -> tuple[int, int]:
    s = httpx.get(f"{server.base_url}/server_info", headers=AUTH, timeout=30).json()
    stats = s["scheduler_stats"]
    return stats["prefix_cache_queries"], stats["num_generated_tokens_total"]


def test_protected_routes_need_the_key(server: Any) -> None:
    before = engine_counters(server)
    for method, path, body in PROTECTED:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = call(server, method, path, body, headers=headers)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
    assert engine_counters(server) == before  # nothing reached the engine
    for method, path, body in PROTECTED:
        r = call(server, method, path, body, headers=AUTH)
        assert r.status_code == 200, (path, r.text)
    assert engine_counters(server) != before


def test_control_routes_need_the_admin_key(server: Any) -> None:
    for path in sorted(CONTROL_PATHS):
        for headers in ({}, AUTH, {"Authorization": "Bearer wrong"}):
            r = call(server, "POST", path, {}, headers=headers)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert "--admin-api-key" in r.json()["error"]["message"]
    admin_calls = [
        ("/reset_prefix_cache", None),
        ("/pause_generation", {"mode": "wait"}),
        ("/resume_generation", None),
    ]
    for path, body in admin_calls:
        r = call(server, "POST", path, body, headers=ADMIN_AUTH)
        assert r.status_code == 200 and r.json()["success"], (path, r.text)
    # The admin key opens the control routes only; the API key the rest, read-only control too.
    completion = {"model": "m1", "prompt": "Hi", "max_tokens": 2}
    assert (
        call(server, "POST", "/v1/completions", completion, headers=ADMIN_AUTH).status_code == 401
    )
    assert call(server, "POST", "/v1/completions", completion, headers=AUTH).status_code == 200
    for path in ("/weight_version", "/is_sleeping"):
        assert call(server, "GET", path, headers=ADMIN_AUTH).status_code == 401, path
        assert call(server, "GET", path, headers=AUTH).status_code == 200, path
    info = call(server, "GET", "/server_info", headers=AUTH).json()["frontend"]
    assert info["api_key_required"] and info["admin_api_key_required"]
    assert ADMIN_KEY not in repr(info)


def test_open_routes_need_no_key(server: Any) -> None:
    for path in OPEN:
        assert call(server, "GET", path).status_code == 200, path
    assert "tern:generation_tokens_total" in call(server, "GET", "/metrics").text


def test_openai_client_with_and_without_the_key(server: Any) -> None:
    def client(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)

    assert [m.id for m in client(KEY).models.list().data] == ["m1", "m2"]
    r = client(KEY).completions.create(model="m2", prompt="Hi", max_tokens=2)
    assert r.model == "m1" and r.usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        client("nope").completions.create(model="m1", prompt="Hi", max_tokens=2)


def test_oversized_bodies_are_413(server: Any) -> None:
    big = {"prompt": "x" * BODY_LIMIT, "max_tokens": 1}
    r = call(server, "POST", "/v1/completions", big, headers=AUTH)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    # Without a Content-Length (chunked upload) the limit holds too.
    payload = httpx.Request("POST", "/", json=big).read()

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(payload), 8192):
            yield payload[i : i + 8192]

    r = httpx.post(
        f"{server.base_url}/v1/completions",
        content=chunks(),
        headers={**AUTH, "content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 413, r.text
    # The key is checked first: an oversized request without it is a 401.
    assert call(server, "POST", "/v1/completions", big).status_code == 401
    # Just under the limit is served.
    ok = {"prompt": "x" * 100, "max_tokens": 1}
    assert call(server, "POST", "/v1/completions", ok, headers=AUTH).status_code == 200


def test_cors_preflight(server: Any) -> None:
    def preflight(origin: str) -> httpx.Response:
        headers = {
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        }
        return httpx.options(f"{server.base_url}/v1/chat/completions", headers=headers)

    ok = preflight(GOOD_ORIGIN)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == GOOD_ORIGIN
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    denied = preflight("http://evil.example")
    assert denied.status_code == 400 and "access-control-allow-origin" not in denied.headers
    r = call(server, "GET", "/v1/models", headers={**AUTH, "Origin": GOOD_ORIGIN})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == GOOD_ORIGIN

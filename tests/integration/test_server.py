"""End to end: the official `openai` client against a real `tern launch` (frontend, engine core,
workers) serving a tiny random Llama in float32, and the default model for one answer that must
be right. Also the server's life: client errors, aborts freeing KV blocks, SIGTERM, engine death,
start-up failure, and no process left behind.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
import tokenizers

pytestmark = pytest.mark.timeout(900)

MAX_MODEL_LEN = 2048


def client_for(server: Any) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def tiny_model(tiny_llama: Path, tokenizer_dir: Path | None) -> Path:
    if tokenizer_dir is None:
        pytest.skip("needs the default model's tokenizer (python -m frontend.model_prep)")
    return tiny_llama


@pytest.fixture(scope="module")
def server(shared_server: Any, tiny_model: Path) -> Any:
    return shared_server(
        "--model", str(tiny_model), "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN)
    )


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return client_for(server)


@pytest.fixture(scope="module")
def model_name(tiny_model: Path) -> str:
    return str(tiny_model)  # the default served name: --model as given


@pytest.fixture(scope="module")
def tok(tiny_model: Path) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(tiny_model / "tokenizer.json"))


def stats(server: Any) -> dict[str, Any]:
    return server.server_info()["scheduler_stats"]


def wait_idle(server: Any, num_free_blocks: int | None = None, timeout: float = 20.0) -> dict:
    """Waits until nothing runs (and, if given, the free-block count is back); returns the stats."""
    deadline = time.monotonic() + timeout
    while True:
        s = stats(server)
        idle = s["num_running_reqs"] == 0 and s["num_waiting_reqs"] == 0
        if idle and (num_free_blocks is None or s["num_free_blocks"] == num_free_blocks):
            return s
        if time.monotonic() > deadline:
            return s
        time.sleep(0.1)


# --------------------------------------------------------------------------- basic API


def test_models_health_version(server: Any, client: openai.OpenAI, model_name: str) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [model_name]
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/version").json()["version"]
    info = server.server_info()
    assert info["engine"]["max_model_len"] == MAX_MODEL_LEN
    s = info["scheduler_stats"]
    assert 0 < s["num_free_blocks"] <= s["num_total_blocks"] == info["engine"]["num_kv_blocks"]


def test_chat_completion(client: openai.OpenAI, model_name: str, tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "Tell me a story."}]
    r = client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=12, temperature=0
    )
    choice = r.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    hf = AutoTokenizer.from_pretrained(str(tiny_model))
    prompt_ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert r.usage.prompt_tokens == len(hf(prompt_ids, add_special_tokens=False).input_ids)
    assert 1 <= r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.id.startswith("chatcmpl-") and r.model == model_name


def test_chat_content_parts_and_template_options(
    server: Any, client: openai.OpenAI, model_name: str
) -> None:
    def create(messages: list[dict[str, Any]], **extra: Any) -> Any:
        return client.chat.completions.create(
            model=model_name, messages=messages, max_tokens=4, temperature=0, extra_body=extra
        )

    as_text = create([{"role": "user", "content": "Hello\nworld"}])
    as_parts = create(
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}],
            }
        ]
    )
    assert as_parts.usage.prompt_tokens == as_text.usage.prompt_tokens
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How"},
    ]
    cont = create(history, continue_final_message=True, add_generation_prompt=False)
    fresh = create(history)
    assert cont.usage.prompt_tokens < fresh.usage.prompt_tokens  # no end-of-turn, no new turn
    bad = {"model": model_name, "messages": history, "chat_template_kwargs": {"tools": []}}
    assert_error(post(server, "/v1/chat/completions", bad), 400, "chat_template_kwargs")


def test_chat_streaming_matches_non_streaming(client: openai.OpenAI, model_name: str) -> None:
    kwargs: dict[str, Any] = {
        "model": model_name,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi!"},
        ],
        "max_tokens": 20,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    full = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_text_and_token_ids(
    client: openai.OpenAI, model_name: str, tok: tokenizers.Tokenizer
) -> None:
    prompt = "The quick brown fox"
    ids = tok.encode(prompt).ids
    by_text = client.completions.create(
        model=model_name, prompt=prompt, max_tokens=10, temperature=0
    )
    by_ids = client.completions.create(model=model_name, prompt=ids, max_tokens=10, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert by_text.usage.prompt_tokens == by_ids.usage.prompt_tokens == len(ids)
    assert by_text.object == "text_completion" and by_text.id.startswith("cmpl-")


def test_completion_streaming(client: openai.OpenAI, model_name: str) -> None:
    kwargs: dict[str, Any] = {
        "model": model_name,
        "prompt": "Once upon a time",
        "max_tokens": 16,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    full = client.completions.create(**kwargs)
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 16
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 16 and chunks[-1].usage.prompt_tokens > 0


def test_continuous_usage_stats(server: Any, model_name: str) -> None:
    body = {
        "model": model_name,
        "prompt": "abc",
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    events = sse_events(server, "/v1/completions", body)
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == 5


def sse_events(server: Any, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    events = []
    with httpx.stream("POST", f"{server.base_url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        assert line.startswith("data: ")
        events.append(json.loads(line[len("data: ") :]))
    return events


def test_seeded_sampling_is_reproducible(client: openai.OpenAI, model_name: str) -> None:
    kwargs: dict[str, Any] = {
        "model": model_name,
        "prompt": "Random:",
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": 1234,
        "extra_body": {"ignore_eos": True},
    }
    a = client.completions.create(**kwargs).choices[0].text
    b = client.completions.create(**kwargs).choices[0].text
    assert a == b


# --------------------------------------------------------------------------- stopping


def test_stop_strings(server: Any, client: openai.OpenAI, model_name: str) -> None:
    start = wait_idle(server)["num_free_blocks"]
    kwargs: dict[str, Any] = {
        "model": model_name,
        "prompt": "Count with me:",
        "max_tokens": 40,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    text = client.completions.create(**kwargs).choices[0].text
    # A stop string from the middle of the greedy output, two characters long.
    i = next(i for i in range(len(text) // 3, len(text) - 2) if text[i : i + 2].strip())
    stop = text[i : i + 2]
    expected = text[: text.index(stop)]
    r = client.completions.create(**kwargs, stop=[stop])
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop" and r.choices[0].stop_reason == stop
    assert r.usage.completion_tokens < 40
    chunks = list(client.completions.create(**kwargs, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    # The engine was told to abort: the requests' blocks come back.
    assert wait_idle(server, start)["num_free_blocks"] == start


def test_stop_token_ids(client: openai.OpenAI, model_name: str, tok: tokenizers.Tokenizer) -> None:
    prompt = tok.encode("Hello there, my friend").ids
    first = (
        client.completions.create(
            model=model_name,
            prompt=prompt,
            max_tokens=1,
            temperature=0,
            extra_body={"ignore_eos": True, "skip_special_tokens": False},
        )
        .choices[0]
        .text
    )
    ids = tok.encode(first).ids
    if len(ids) != 1:
        pytest.skip(f"the first greedy token's text {first!r} does not re-encode to one token")
    r = client.completions.create(
        model=model_name,
        prompt=prompt,
        max_tokens=10,
        temperature=0,
        extra_body={"stop_token_ids": ids},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.stop_reason == ids[0]
    assert choice.text == "" and r.usage.completion_tokens == 1  # counted, not shown (as vLLM)


def test_max_tokens_fills_the_context(client: openai.OpenAI, model_name: str) -> None:
    # Without max_tokens the limit is what is left of the context.
    r = client.completions.create(
        model=model_name,
        prompt=[5] * (MAX_MODEL_LEN - 4),
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4


# --------------------------------------------------------------------------- client errors


def post(server: Any, path: str, body: bytes | dict[str, Any]) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        f"{server.base_url}{path}",
        content=content,
        headers={"content-type": "application/json"},
        timeout=60,
    )


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def test_client_errors_are_4xx_and_the_server_keeps_serving(
    server: Any, client: openai.OpenAI, model_name: str
) -> None:
    chat_ok = {"model": model_name, "messages": [{"role": "user", "content": "hi"}]}
    assert_error(post(server, "/v1/chat/completions", b'{"model": '), 400)
    assert_error(post(server, "/v1/chat/completions", b"[1, 2]"), 400)
    assert_error(
        post(server, "/v1/chat/completions", {**chat_ok, "temperature": "hot"}), 400, "temperature"
    )
    assert_error(
        post(server, "/v1/chat/completions", {**chat_ok, "max_tokens": -5}), 400, "max_tokens"
    )
    assert_error(
        post(server, "/v1/chat/completions", {**chat_ok, "use_beam_search": True}),
        400,
        "use_beam_search",
    )
    assert_error(
        post(server, "/v1/chat/completions", {**chat_ok, "frobnicate": 1}), 400, "frobnicate"
    )
    assert_error(post(server, "/v1/chat/completions", {"model": model_name}), 400, "messages")
    assert_error(
        post(server, "/v1/completions", {"model": model_name, "prompt": [10**9]}), 400, "prompt"
    )
    assert_error(post(server, "/v1/completions", {"prompt": ["a", [1]]}), 400, "prompt")
    long_prompt = {"model": model_name, "prompt": [7] * MAX_MODEL_LEN}
    assert_error(post(server, "/v1/completions", long_prompt), 400, "prompt")
    too_much = {"model": model_name, "prompt": [7] * 100, "max_tokens": MAX_MODEL_LEN}
    assert_error(post(server, "/v1/completions", too_much), 400, "max_tokens")
    err = assert_error(post(server, "/v1/completions", {"model": "gpt-9", "prompt": "x"}), 404)
    assert err["code"] == "model_not_found"
    assert httpx.get(f"{server.base_url}/v1/chat/completions").status_code == 405
    assert httpx.get(f"{server.base_url}/no/such/route").status_code == 404

    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_name, messages=[], max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    r = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "still there?"}], max_tokens=3
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    assert httpx.get(f"{server.base_url}/health").status_code == 200


# --------------------------------------------------------------------------- cache and load


def test_repeated_prompt_reports_cached_tokens(client: openai.OpenAI, model_name: str) -> None:
    prompt = "A long shared preamble about prefix caching. " * 12
    kwargs: dict[str, Any] = {
        "model": model_name,
        "prompt": prompt,
        "max_tokens": 2,
        "temperature": 0,
    }
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    n = second.usage.prompt_tokens
    assert n > 32
    assert first.usage.prompt_tokens_details.cached_tokens < n
    assert 0 < second.usage.prompt_tokens_details.cached_tokens < n


def test_32_concurrent_streams_complete(server: Any, model_name: str) -> None:
    start = wait_idle(server)["num_free_blocks"]

    async def one(aclient: openai.AsyncOpenAI, i: int) -> tuple[str, str | None, int]:
        stream = await aclient.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": f"Request number {i}."}],
            max_tokens=24,
            temperature=0.8,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, finish, n = "", None, 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                n = chunk.usage.completion_tokens
        return text, finish, n

    async def run_all() -> list[tuple[str, str | None, int]]:
        aclient = openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300
        )
        async with aclient:
            return await asyncio.wait_for(
                asyncio.gather(*(one(aclient, i) for i in range(32))), timeout=300
            )

    results = asyncio.run(run_all())
    assert len(results) == 32
    assert all(finish == "length" and n == 24 for _, finish, n in results), results
    assert sum(bool(text) for text, _, _ in results) >= 30
    assert wait_idle(server, start)["num_free_blocks"] == start


# --------------------------------------------------------------------------- aborts


def test_disconnected_requests_are_aborted(
    server: Any, client: openai.OpenAI, model_name: str
) -> None:
    start = wait_idle(server)["num_free_blocks"]
    # How long the requests below would run if they were not aborted.
    t0 = time.monotonic()
    client.completions.create(
        model=model_name,
        prompt="Warm up:",
        max_tokens=32,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    per_token = (time.monotonic() - t0) / 32
    max_tokens = MAX_MODEL_LEN - 16
    # The second client gives up after 0.5 s: from then on, a quarter of the requests' run.
    deadline_s = 0.5 + min(5.0, 0.25 * max_tokens * per_token)
    long_req = {
        "model": model_name,
        "prompt": "Go on forever:",
        "temperature": 0,
        "ignore_eos": True,
        "max_tokens": max_tokens,
    }
    # A stream the client drops after a few chunks.
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions", json={**long_req, "stream": True}, timeout=60
    ) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n >= 6:
                break
    # A non-streaming request whose client gives up.
    t0 = time.monotonic()
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.base_url}/v1/completions", json=long_req, timeout=0.5)
    # Both were aborted: nothing runs any more, long before they could have finished.
    s = wait_idle(server, start, timeout=30)
    elapsed = time.monotonic() - t0
    assert s["num_running_reqs"] == 0 and s["num_free_blocks"] == start, s
    assert elapsed < deadline_s, f"requests ran on after their clients left ({elapsed:.1f} s)"
    assert server.server_info()["num_requests_in_flight"] == 0


def test_bench_serving_script(server: Any, tmp_path: Path, tiny_model: Path) -> None:
    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_serving.py"
    out = tmp_path / "result.json"
    for endpoint in ("completions", "chat"):
        argv = [
            "--base-url",
            server.base_url,
            "--endpoint",
            endpoint,
            "--num-prompts",
            "4",
            "--input-len",
            "40",
            "--output-len",
            "8",
            "--concurrency",
            "2",
            "--tokenizer",
            str(tiny_model),
            "--result-file",
            str(out),
        ]
        proc = subprocess.run(
            [sys.executable, str(script), *argv],
            check=False,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "Output token throughput" in proc.stdout
        result = json.loads(out.read_text())
        assert result["completed"] == 4 and result["failed"] == 0
        assert result["total_output_tokens"] == 32
        if endpoint == "completions":
            assert result["total_input_tokens"] == 160  # prompts of exactly --input-len tokens
        assert result["ttft_ms"]["mean"] > 0 and result["tpot_ms"]["p99"] > 0
        assert result["output_throughput"] > 0


# --------------------------------------------------------------------------- process life


def stream_in_background(server: Any, model_name: str) -> tuple[threading.Thread, dict[str, Any]]:
    """A long streaming request in a thread; result["error"] / result["chunks"] when it ends."""
    result: dict[str, Any] = {"chunks": 0, "started": threading.Event()}

    def run() -> None:
        c = client_for(server)
        try:
            stream = c.completions.create(
                model=model_name,
                prompt="Keep going:",
                max_tokens=MAX_MODEL_LEN - 16,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                result["chunks"] += 1
                result["started"].set()
                result["finish"] = chunk.choices[0].finish_reason if chunk.choices else None
        except Exception as e:  # noqa: BLE001 - the test inspects it
            result["error"] = e
        finally:
            result["started"].set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert result["started"].wait(60)
    return thread, result


def test_sigterm_stops_everything(launch_server: Any, tiny_model: Path) -> None:
    server = launch_server(
        "--model", str(tiny_model), "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN)
    )
    ipc_dir = Path(server.server_info()["config"]["ipc_dir"])
    assert ipc_dir.is_dir()
    thread, result = stream_in_background(server, str(tiny_model))
    server.record_descendants()
    assert len(server.descendants) >= 2  # engine core and at least one worker
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=10) == 0
    assert time.monotonic() - t0 < 10
    thread.join(10)
    assert not thread.is_alive()
    assert "error" in result or result.get("finish") is not None  # the stream ended, not hung
    assert server.survivors(timeout=1.0) == []
    assert not ipc_dir.exists()
    assert "http://127.0.0.1:" in server.log and "KV cache:" in server.log


def test_engine_death_fails_requests_and_exits_1(launch_server: Any, tiny_model: Path) -> None:
    server = launch_server(
        "--model", str(tiny_model), "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN)
    )
    core_pid = server.server_info()["engine"]["engine_core_pid"]
    thread, result = stream_in_background(server, str(tiny_model))
    psutil.Process(core_pid).kill()
    thread.join(10)
    assert not thread.is_alive() and isinstance(result.get("error"), openai.APIError)
    health = []
    deadline = time.monotonic() + 10
    while server.proc.poll() is None and time.monotonic() < deadline:
        try:
            health.append(httpx.get(f"{server.base_url}/health", timeout=1).status_code)
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    assert server.proc.wait(timeout=10) == 1
    assert 503 in health and 200 not in health[health.index(503) :]
    assert server.survivors(timeout=5.0) == []


def test_startup_failure_is_one_clear_line(
    launch_server: Any, tiny_model: Path, tmp_path: Path
) -> None:
    bad = tmp_path / "bad_model"
    shutil.copytree(tiny_model, bad)
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (bad / "config.json").write_text(json.dumps(config))
    server = launch_server("--model", str(bad), wait=False)
    assert server.proc.wait(timeout=120) == 1
    errors = [line for line in server.log.splitlines() if line.startswith("tern: error:")]
    assert len(errors) == 1 and "NoSuchModelForCausalLM" in errors[0], server.log[-3000:]
    server.record_descendants()
    assert server.survivors(timeout=5.0) == []


def test_taken_port_fails_before_the_model_loads(launch_server: Any, tiny_model: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = launch_server("--model", str(tiny_model), wait=False, port=taken.getsockname()[1])
        assert server.proc.wait(timeout=120) == 1
    errors = [line for line in server.log.splitlines() if line.startswith("tern: error:")]
    assert len(errors) == 1 and "cannot listen on 127.0.0.1:" in errors[0], server.log[-3000:]
    assert "engine core" not in server.log  # failed before starting it


def test_bad_arguments_exit_2(launch_server: Any, tmp_path: Path) -> None:
    server = launch_server("--model", str(tmp_path / "missing"), wait=False)
    assert server.proc.wait(timeout=60) == 2
    assert "tern: error: --model" in server.log


# --------------------------------------------------------------------------- the default model


@pytest.fixture(scope="module")
def default_server(shared_server: Any) -> Any:
    return shared_server("--dtype", "float32")


def test_default_model_knows_the_capital_of_france(default_server: Any) -> None:
    client = client_for(default_server)
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_tokens=30, temperature=0
    )
    answer = r.choices[0].message.content
    assert "Paris" in answer, answer
    streamed = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_tokens=30, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == answer


def test_the_default_models_gguf_file_serves_as_its_float32_conversion(
    launch_server: Any, tokenizer_dir: Path | None
) -> None:
    """`--model FILE.gguf` on the Q4_1 file the default model ships in: through the openai client,
    greedy chat output equals Hugging Face's on the float32 model converted from the same file."""
    if tokenizer_dir is None:
        pytest.skip("needs the default model (python -m frontend.model_prep)")
    import torch
    import transformers

    from frontend.model_prep import find_gguf

    gguf = find_gguf()
    server = launch_server("--model", str(gguf), "--dtype", "float32", "--max-model-len", "512")
    messages = [{"role": "user", "content": "Name three birds that live by the sea."}]
    reply = client_for(server).chat.completions.create(
        model=str(gguf), messages=messages, max_tokens=24, temperature=0.0
    )
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tokenizer_dir, dtype=torch.float32)
    ids = hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=24, do_sample=False)
    expected = hf_tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens == ids.shape[1]

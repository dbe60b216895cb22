"""Soak test of a tern server: mixed traffic while a control loop pauses, swaps weights and sleeps.

Starts a tiny server (two random tiny Llama checkpoints A and B whose greedy outputs differ; A is
served first, with 64 KV blocks so that requests get preempted) or attaches to one (--base-url, then
--checkpoint-a/--checkpoint-b name two checkpoints the server can load). It first learns each
checkpoint's greedy answer to a few probe prompts from the server itself, one request at a time,
then sends N requests at concurrency C — chat, completions, /generate, streams, n > 1 with logprobs,
json_schema and regex structured output, clients that disconnect mid-stream, POST /abort_request,
malformed bodies, and greedy probes — while a control task loops: pause (abort|wait|keep) + resume,
a weight update to the other checkpoint (inside a pause, abort or wait: in-flight requests continue
with new weights by design when nothing pauses them), sleep level 1 + wake-up, reset the prefix cache.

Checks (exit 1 when one fails): every request ends (finish_reason stop/length, or an abort, an error
body or an SSE error event; a timeout, a 5xx other than 503, a missing finish_reason or a broken
structured output fails); each probe's tokens are the greedy output of the checkpoint its
`weight_version` names; every control call succeeds; the KV cache is empty at the end; the RSS of
the server's processes grows by at most --max-rss-growth-mib after the warm-up; no process of a
launched server survives its stop.

With --fault, a process of the launched server is killed (SIGKILL) or frozen (SIGSTOP: a hung rank)
--fault-after seconds into the traffic: a worker (the last rank; use --tp 2 for a rank whose peers
wait on it in a collective) or the engine core. Then the server must fail what is in flight with
clear errors (an SSE error event, or a 5xx OpenAI error body saying the engine died), refuse or close
what comes after (it is exiting), and exit with code 1 within --exit-within seconds, leaving no
process behind. No request may hang, end without a finish reason, or be cut without an error.

    scripts/soak --num-requests 1000 --concurrency 16 --result-file /tmp/soak.json
    scripts/soak --num-requests 200 --concurrency 8 --tp 2 --fault stop-worker
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from frontend.client.launched_server import LaunchedServer

ROOT = Path(__file__).resolve().parent.parent
PROBE_PROMPTS = [[101, 2024, 318, 257], [464, 3290, 286, 4881, 318, 6342, 11, 290], [40, 1101]]
PROBE_TOKENS = 8
WORDS = "the a cat dog runs jumps over under blue red green sky tree river stone fast slow".split()
JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 9},
        "b": {"type": "boolean"},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
REGEX = "[a-z]{3,8}"
KINDS = (
    "chat", "chat_stream", "completion", "completion_stream", "generate", "generate_stream",
    "n_logprobs", "json_schema", "regex", "disconnect", "abort_request", "malformed", "probe",
    "probe_stream",
)  # fmt: skip
OK, ABORTED, ERROR_BODY, SSE_ERROR, REJECTED, DISCONNECTED = (
    "ok", "aborted", "error_body", "sse_error", "rejected_400", "disconnected",
)  # fmt: skip
# Only after a --fault: a 5xx error body naming the dead engine, and a refused or closed connection.
ENGINE_FAILED, SERVER_GONE = "engine_failed", "server_gone"
FAULTS = ("kill-worker", "stop-worker", "kill-engine-core", "stop-engine-core")
FAULT_HEARTBEAT_TIMEOUT_S = 5.0  # TERN_ENGINE_HEARTBEAT_TIMEOUT for a launched server under --fault
# Control calls stop this long before a fault is due (a sleep-wake cycle takes at most ~0.6 s).
FAULT_QUIET_S = 0.7


@dataclass
class Result:
    kind: str
    outcome: str  # one of the constants above, or "FAIL: <why>"
    latency_s: float
    probe: tuple[int, list[int], str | None] | None = None  # (prompt index, tokens, version)


@dataclass
class Soak:
    base_url: str
    model: str
    ckpts: dict[str, str]  # weight version -> checkpoint path
    expected: dict[str, list[list[int]]] = field(default_factory=dict)  # version -> per prompt
    control: Counter = field(default_factory=Counter)
    control_failures: list[str] = field(default_factory=list)
    version: str = "default"  # the weights loaded last
    fault_at: float | None = None  # time.monotonic() of the injected fault
    # When the fault is due: control calls stop FAULT_QUIET_S before it, so that the server is
    # awake and serving (requests in flight) when it comes.
    fault_due: float | None = None
    control_after_fault: Counter = field(default_factory=Counter)


# ---------------------------------------------------------------------------------- the server


def launch(model: str, tp: int, env: dict[str, str]) -> LaunchedServer:
    """The soak's server: float32, a 64-block KV cache (so that requests get preempted)."""
    args = ["--model", model, "--dtype", "float32", "--max-model-len", "512",
            "--num-gpu-blocks-override", "64", "--tp", str(tp)]  # fmt: skip
    return LaunchedServer(args, env=env, log_prefix="tern-soak-")


def _cmdline(p: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return " ".join(p.cmdline())[:200]
    return "?"


def rss_mib(root_pid: int) -> float:
    """Resident memory of a process and all its descendants, in MiB."""
    root = psutil.Process(root_pid)
    total = 0
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total / 2**20


# ---------------------------------------------------------------------------------- requests


def _text(rng: random.Random, lo: int = 3, hi: int = 100) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _reasons(body: dict[str, Any]) -> list[str | None]:
    if "choices" in body:
        return [c.get("finish_reason") for c in body["choices"]]
    info = (body.get("meta_info") or {}).get("finish_reason")
    return [info.get("type") if info else None]


def _judge(reasons: list[str | None]) -> str:
    if not reasons or any(r is None for r in reasons):
        return f"FAIL: no finish_reason ({reasons})"
    if "abort" in reasons:
        return ABORTED
    bad = [r for r in reasons if r not in ("stop", "length")]
    return f"FAIL: finish_reason {bad}" if bad else OK


def _judge_error(status: int, text: str) -> str:
    """A non-200 answer to a valid request: a 503 (asleep) error body is clear, and so is a 5xx one
    saying the engine died (a failure unless a fault was injected); anything else fails."""
    try:
        error = json.loads(text).get("error")
    except (ValueError, AttributeError):
        error = None
    if isinstance(error, dict) and error.get("code") in ("engine_dead", "engine_error"):
        return ENGINE_FAILED
    if status == 503 and error:
        return ERROR_BODY
    return f"FAIL: status {status}: {text[:200]}"


async def _post(client: httpx.AsyncClient, path: str, body: dict, rid: str | None = None):
    headers = {"X-Request-Id": rid} if rid else None
    r = await client.post(path, json=body, headers=headers)
    if r.status_code != 200:
        return _judge_error(r.status_code, r.text), None
    data = r.json()
    return _judge(_reasons(data)), data


async def _stream(
    client: httpx.AsyncClient,
    path: str,
    body: dict,
    rid: str | None = None,
    stop_after: int | None = None,
    on_first: Any = None,
) -> tuple[str, list[dict]]:
    """Reads an SSE stream to [DONE] (or leaves after `stop_after` events); returns the outcome and
    the events."""
    headers = {"X-Request-Id": rid} if rid else None
    events: list[dict] = []
    reasons: dict[int, str | None] = {}
    async with client.stream("POST", path, json=body, headers=headers) as r:
        if r.status_code != 200:
            return _judge_error(r.status_code, (await r.aread()).decode(errors="replace")), []
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: ") :]
            if payload == "[DONE]":
                if any(e.get("error") for e in events):
                    return SSE_ERROR, events
                return _judge(list(reasons.values())), events
            event = json.loads(payload)
            events.append(event)
            if len(events) == 1 and on_first is not None:
                await on_first()
            for i, c in enumerate(event.get("choices") or []):
                reasons.setdefault(c.get("index", i), None)
                if c.get("finish_reason"):
                    reasons[c.get("index", i)] = c["finish_reason"]
            if "meta_info" in event:
                reasons[0] = _reasons(event)[0]
            if stop_after is not None and len(events) >= stop_after:
                return DISCONNECTED, events  # leaving the block closes the connection
    return "FAIL: stream ended without [DONE]", events


def _check_structured(kind: str, outcome: str, data: dict | None) -> str:
    if outcome != OK or data is None:
        return outcome
    for c in data["choices"]:
        if c["finish_reason"] != "stop":
            continue  # a length cut leaves the output unfinished
        text = c["message"]["content"] if "message" in c else c["text"]
        if kind == "regex" and not re.fullmatch(REGEX, text):
            return f"FAIL: regex output {text!r}"
        if kind == "json_schema":
            try:
                obj = json.loads(text)
                assert set(obj) == {"a", "b"} and 0 <= obj["a"] <= 9 and isinstance(obj["b"], bool)
            except (ValueError, AssertionError, TypeError):
                return f"FAIL: json_schema output {text!r}"
    return outcome


async def one_request(soak: Soak, client: httpx.AsyncClient, kind: str, i: int, seed: int):
    """Sends request i of `kind`; returns (outcome, probe or None)."""
    rng = random.Random(seed * 1_000_003 + i)
    m = soak.model
    msgs = [{"role": "user", "content": _text(rng)}]
    max_tokens = rng.randint(4, 96)
    sampling = {"temperature": 1.0, "seed": rng.randint(0, 2**31), "max_tokens": max_tokens}
    if kind == "chat":
        return (await _post(client, "/v1/chat/completions", {"model": m, "messages": msgs,
                                                             **sampling}))[0], None  # fmt: skip
    if kind == "chat_stream":
        body = {"model": m, "messages": msgs, "stream": True, **sampling}
        return (await _stream(client, "/v1/chat/completions", body))[0], None
    if kind == "completion":
        body = {"model": m, "prompt": _text(rng), **sampling}
        return (await _post(client, "/v1/completions", body))[0], None
    if kind == "completion_stream":
        body = {"model": m, "prompt": _text(rng), "stream": True, **sampling}
        return (await _stream(client, "/v1/completions", body))[0], None
    if kind in ("generate", "generate_stream"):
        body = {"prompt": _text(rng), "max_tokens": max_tokens, "temperature": 1.0}
        if kind == "generate_stream":
            return (await _stream(client, "/generate", {**body, "stream": True}))[0], None
        return (await _post(client, "/generate", body))[0], None
    if kind == "n_logprobs":
        if i % 2:
            body = {"model": m, "prompt": _text(rng), "n": 3, "logprobs": 2, **sampling}
            return (await _post(client, "/v1/completions", body))[0], None
        body = {"model": m, "messages": msgs, "n": 2, "logprobs": True, "top_logprobs": 2,
                **sampling}  # fmt: skip
        return (await _post(client, "/v1/chat/completions", body))[0], None
    if kind == "json_schema":
        fmt = {"type": "json_schema", "json_schema": {"name": "ab", "schema": JSON_SCHEMA}}
        body = {"model": m, "messages": msgs, "response_format": fmt, **sampling, "max_tokens": 64}
        outcome, data = await _post(client, "/v1/chat/completions", body)
        return _check_structured(kind, outcome, data), None
    if kind == "regex":
        body = {"model": m, "prompt": _text(rng), "structured_outputs": {"regex": REGEX},
                **sampling, "max_tokens": 16}  # fmt: skip
        outcome, data = await _post(client, "/v1/completions", body)
        return _check_structured(kind, outcome, data), None
    if kind == "disconnect":
        body = {"model": m, "messages": msgs, "stream": True, **sampling, "max_tokens": 200}
        return (await _stream(client, "/v1/chat/completions", body, stop_after=2))[0], None
    if kind == "abort_request":
        return await _abort_request(soak, client, rng, i), None
    if kind == "malformed":
        return await _malformed(client, m, i), None
    if kind in ("probe", "probe_stream"):
        return await _probe(soak, client, i % len(PROBE_PROMPTS), kind == "probe_stream")
    raise ValueError(kind)


async def _abort_request(soak: Soak, client: httpx.AsyncClient, rng: random.Random, i: int) -> str:
    rid = f"soak-abort-{i}-{rng.getrandbits(32):08x}"
    answers: list[int] = []

    async def abort() -> None:
        r = await client.post("/abort_request", json={"request_id": rid})
        answers.append(r.status_code)

    body = {"model": soak.model, "prompt": _text(rng), "stream": True, "max_tokens": 200,
            "ignore_eos": True}  # fmt: skip
    outcome, _ = await _stream(client, "/v1/completions", body, rid=rid, on_first=abort)
    if answers and answers[0] not in (200, 404):  # 404: it had already finished
        return f"FAIL: /abort_request answered {answers[0]}"
    return outcome


MALFORMED: list[tuple[str, bytes | dict]] = [
    ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", '),
    ("/v1/chat/completions", {"messages": "not a list"}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}),
    ("/generate", {"prompt": "hi", "no_such_field": 1}),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "([a-"}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": -1}),
]


async def _malformed(client: httpx.AsyncClient, model: str, i: int) -> str:
    path, body = MALFORMED[i % len(MALFORMED)]
    if isinstance(body, dict):
        r = await client.post(path, json={"model": model, **body})
    else:
        r = await client.post(path, content=body, headers={"content-type": "application/json"})
    if r.status_code == 400 and "error" in r.json():
        return REJECTED
    if r.status_code == 503:  # asleep: the gate answers before the body is read
        return _judge_error(r.status_code, r.text)
    return f"FAIL: malformed body to {path} answered {r.status_code}: {r.text[:200]}"


def _probe_body(model: str, k: int, stream: bool) -> dict:
    return {"model": model, "prompt": PROBE_PROMPTS[k], "max_tokens": PROBE_TOKENS,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True, "stream": stream}  # fmt: skip


async def _probe(soak: Soak, client: httpx.AsyncClient, k: int, stream: bool):
    body = _probe_body(soak.model, k, stream)
    if not stream:
        outcome, data = await _post(client, "/v1/completions", body)
        if data is None:
            return outcome, None
        c = data["choices"][0]
        return outcome, (k, c.get("token_ids") or [], data.get("weight_version"))
    outcome, events = await _stream(client, "/v1/completions", body)
    tokens: list[int] = []
    version = None
    for e in events:
        for c in e.get("choices") or []:
            tokens += c.get("token_ids") or []
        version = e.get("weight_version") or version
    return outcome, ((k, tokens, version) if events else None)


def check_probe(soak: Soak, probe: tuple[int, list[int], str | None], outcome: str) -> str:
    """ "ok" when the tokens are the greedy output (or, aborted, a prefix of it) of the named version."""
    k, tokens, version = probe
    if outcome == OK:
        want = soak.expected.get(version or "")
        if want is not None and tokens == want[k]:
            return "ok"
        proved = [v for v, exp in soak.expected.items() if exp[k] == tokens]
        return (
            f"FAIL: weight_version {version!r} but tokens {tokens} are those of {proved or 'none'}"
        )
    if outcome == ABORTED and version in soak.expected and tokens:
        if soak.expected[version][k][: len(tokens)] != tokens:
            return f"FAIL: aborted, weight_version {version!r}, tokens {tokens} not its prefix"
    return "ok"


# ---------------------------------------------------------------------------------- control


class ServerGone(Exception):
    """A control call failed after the injected fault: the control loop ends."""


async def control_call(soak: Soak, client: httpx.AsyncClient, name: str, path: str, body: dict):
    try:
        r = await client.post(path, json=body, timeout=300)
    except httpx.HTTPError as e:
        if soak.fault_at is None:
            raise
        soak.control_after_fault[f"{name}: {type(e).__name__}"] += 1
        raise ServerGone from e
    soak.control[name] += 1
    if r.status_code != 200:
        if soak.fault_at is not None and _judge_error(r.status_code, r.text) == ENGINE_FAILED:
            soak.control_after_fault[f"{name}: {r.status_code}"] += 1
            raise ServerGone
        soak.control_failures.append(f"{name}: {r.status_code} {r.text[:200]}")
    return r


async def update_weights(soak: Soak, client: httpx.AsyncClient, version: str) -> None:
    body = {"model_path": soak.ckpts[version], "weight_version": version}
    r = await control_call(soak, client, "update_weights", "/update_weights_from_disk", body)
    if r.status_code == 200:
        soak.version = version


async def control_loop(
    soak: Soak, client: httpx.AsyncClient, done: asyncio.Event, rng: random.Random,
    interval: float, max_cycles: int | None,
) -> None:  # fmt: skip
    """Cycles through the control actions until `done` (or max_cycles); leaves the server resumed
    and awake."""
    modes = ("abort", "wait", "keep")
    versions = sorted(soak.ckpts)
    cycle = 0

    async def gap() -> bool:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(done.wait(), rng.uniform(0.3, 1.0) * interval)
        return done.is_set()

    def quiet() -> bool:
        due = soak.fault_due
        return due is not None and time.monotonic() > due - FAULT_QUIET_S

    try:
        while max_cycles is None or cycle < max_cycles:
            if soak.fault_at is not None or quiet():
                break
            mode = modes[cycle % 3]
            await control_call(soak, client, f"pause_{mode}", "/pause_generation", {"mode": mode})
            await asyncio.sleep(rng.uniform(0.1, 0.5))
            await control_call(soak, client, "resume", "/resume_generation", {})
            if await gap() or quiet():
                break
            mode = modes[cycle % 2]  # updates pause with abort or wait, never keep
            await control_call(soak, client, f"pause_{mode}", "/pause_generation", {"mode": mode})
            other = versions[(versions.index(soak.version) + 1) % len(versions)]
            await update_weights(soak, client, other)
            await control_call(soak, client, "resume", "/resume_generation", {})
            if await gap() or quiet():
                break
            await control_call(soak, client, "sleep", "/sleep", {"level": 1})
            await asyncio.sleep(rng.uniform(0.1, 0.5))
            await control_call(soak, client, "wake_up", "/wake_up", {})
            if await gap() or quiet():
                break
            await control_call(soak, client, "reset_prefix_cache", "/reset_prefix_cache", {})
            cycle += 1
            if await gap():
                break
    except ServerGone:
        return
    finally:
        with contextlib.suppress(httpx.HTTPError):
            await client.post("/resume_generation", json={}, timeout=60)
            await client.post("/wake_up", json={}, timeout=60)


# ---------------------------------------------------------------------------------- the run


async def run_traffic(
    soak: Soak, client: httpx.AsyncClient, kinds: list[str], concurrency: int, seed: int,
    timeout: float, offset: int = 0,
) -> list[Result]:  # fmt: skip
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int, kind: str) -> Result:
        async with sem:
            t0 = time.perf_counter()
            try:
                outcome, probe = await asyncio.wait_for(
                    one_request(soak, client, kind, offset + i, seed), timeout
                )
            except asyncio.TimeoutError:
                outcome, probe = f"FAIL: timeout after {timeout} s", None
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as e:
                outcome = (
                    SERVER_GONE if soak.fault_at is not None else f"FAIL: {type(e).__name__}: {e}"
                )
                probe = None
            except (httpx.HTTPError, ValueError) as e:
                outcome, probe = f"FAIL: {type(e).__name__}: {e}", None
            result = Result(kind, outcome, time.perf_counter() - t0, probe)
            if outcome == ERROR_BODY:  # asleep: back off as a client would, keeping the slot
                await asyncio.sleep(0.25)
            return result

    return list(await asyncio.gather(*(one(i, k) for i, k in enumerate(kinds))))


async def learn_expected(soak: Soak, client: httpx.AsyncClient) -> None:
    """Each checkpoint's greedy probe outputs, from the server with nothing else running."""
    for version in sorted(soak.ckpts):
        await update_weights(soak, client, version)
        outs = []
        for k in range(len(PROBE_PROMPTS)):
            r = await client.post("/v1/completions", json=_probe_body(soak.model, k, False))
            r.raise_for_status()
            assert r.json()["weight_version"] == version, r.text
            outs.append(r.json()["choices"][0]["token_ids"])
        soak.expected[version] = outs
    a, b = soak.expected.values()
    assert a != b, f"the two checkpoints give the same greedy probe outputs: {a}"


async def drained_stats(client: httpx.AsyncClient, wait_s: float = 15.0) -> dict:
    deadline = time.monotonic() + wait_s
    while True:
        stats = (await client.get("/server_info")).json()["scheduler_stats"]
        empty = (
            stats["num_running_reqs"] == 0
            and stats["num_waiting_reqs"] == 0
            and stats["num_free_blocks"] == stats["num_total_blocks"]
        )
        if empty or time.monotonic() > deadline:
            return {**stats, "empty": empty}
        await asyncio.sleep(0.5)


async def inject_fault(soak: Soak, fault: str, after_s: float, core_pid: int) -> dict:
    """Kills or stops the engine core or its last worker `after_s` into the traffic."""
    await asyncio.sleep(after_s)
    core = psutil.Process(core_pid)
    target = core if fault.endswith("engine-core") else core.children()[-1]
    sig = signal.SIGKILL if fault.startswith("kill") else signal.SIGSTOP
    info = {"fault": fault, "pid": target.pid, "cmdline": _cmdline(target)}
    target.send_signal(sig)
    soak.fault_at = time.monotonic()
    return info


async def wait_exit(proc: subprocess.Popen, fault_at: float, within_s: float) -> dict:
    """The launched server's exit code and how long after the fault it came."""
    deadline = fault_at + within_s
    while proc.poll() is None and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    code = proc.poll()
    return {
        "exit_code": code,
        "exit_after_s": time.monotonic() - fault_at if code is not None else None,
    }


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


async def soak_async(
    args: argparse.Namespace,
    base_url: str,
    root_pid: int | None,
    proc: subprocess.Popen | None = None,
) -> dict:
    rng = random.Random(args.seed)
    t_start = time.perf_counter()
    timeout = httpx.Timeout(args.request_timeout, connect=10)
    limits = httpx.Limits(max_connections=args.concurrency + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        if root_pid is None:  # attached: the frontend is the engine core's parent
            core_pid = (await client.get("/server_info")).json()["engine"]["engine_core_pid"]
            root_pid = psutil.Process(core_pid).ppid()
        soak = Soak(base_url, model, {"A": args.checkpoint_a, "B": args.checkpoint_b})
        await learn_expected(soak, client)
        # Warm-up: every request kind at full concurrency, and one control cycle.
        warm = [KINDS[j % len(KINDS)] for j in range(max(2 * args.concurrency, len(KINDS)))]
        warm_results = await run_traffic(
            soak, client, warm, args.concurrency, args.seed, args.request_timeout, 10**6
        )
        await control_loop(soak, client, asyncio.Event(), rng, 0.2, 1)
        await drained_stats(client)
        rss_warm = rss_mib(root_pid)
        soak.control.clear()
        soak.control_failures.clear()

        kinds = [KINDS[j % len(KINDS)] for j in range(args.num_requests)]
        rng.shuffle(kinds)
        done = asyncio.Event()
        t0 = time.perf_counter()
        control = asyncio.create_task(
            control_loop(soak, client, done, rng, args.control_interval, args.max_control_cycles)
        )
        fault = None
        if args.fault:
            core_pid = (await client.get("/server_info")).json()["engine"]["engine_core_pid"]
            soak.fault_due = time.monotonic() + args.fault_after
            fault = asyncio.create_task(inject_fault(soak, args.fault, args.fault_after, core_pid))
        try:
            results = await run_traffic(
                soak, client, kinds, args.concurrency, args.seed, args.request_timeout
            )
        finally:
            done.set()
            await control
        soak_wall = time.perf_counter() - t0
        if fault is not None:
            assert proc is not None and fault.done(), "the traffic ended before the fault"
            info = fault.result()
            info.update(await wait_exit(proc, soak.fault_at, args.exit_within))
            return summarize(soak, args, results, warm_results, None, rss_warm, None, soak_wall,
                             t_start, info)  # fmt: skip
        kv = await drained_stats(client)
        rss_end = rss_mib(root_pid)
    return summarize(soak, args, results, warm_results, kv, rss_warm, rss_end, soak_wall, t_start)


def summarize(
    soak: Soak, args: argparse.Namespace, results: list[Result], warm_results: list[Result],
    kv: dict | None, rss_warm: float, rss_end: float | None, soak_wall: float, t_start: float,
    fault: dict | None = None,
) -> dict:  # fmt: skip
    """The report; with a fault, the KV and RSS checks give way to the server's exit."""
    by_kind: dict[str, Counter] = defaultdict(Counter)
    failures = []
    probes: Counter = Counter()
    for r in results:
        outcome = r.outcome
        if r.probe is not None:
            verdict = check_probe(soak, r.probe, outcome)
            if verdict != "ok":
                outcome = verdict
            elif outcome == OK:
                probes[f"checked_{r.probe[2]}"] += 1
        if outcome == ENGINE_FAILED and fault is None:
            outcome = "FAIL: a 5xx 'engine died' error without a fault"
        kind_outcome = "FAIL" if outcome.startswith("FAIL") else outcome
        by_kind[r.kind][kind_outcome] += 1
        if outcome.startswith("FAIL"):
            failures.append(f"{r.kind}: {outcome}")
    by_outcome = sum(by_kind.values(), Counter())
    warm_failures = [f"{r.kind}: {r.outcome}" for r in warm_results if r.outcome.startswith("FAIL")]
    latencies = [r.latency_s for r in results]
    rss_growth = rss_end - rss_warm if rss_end is not None else None
    checks = {
        "every request ended cleanly": not failures and not warm_failures,
        "no response mixed weight versions": not any("weight_version" in f for f in failures)
        and (sum(probes.values()) > 0 or fault is not None),
        "every control call succeeded": not soak.control_failures,
    }
    if fault is None:
        checks["KV cache empty at the end"] = kv["empty"]
        checks[f"RSS growth <= {args.max_rss_growth_mib} MiB"] = (
            rss_growth <= args.max_rss_growth_mib
        )
    else:
        checks[f"the server exited 1 within {args.exit_within:g} s of the fault"] = (
            fault["exit_code"] == 1
        )
    return {
        "fault": fault,
        "control_after_fault": dict(soak.control_after_fault),
        "num_requests": len(results),
        "concurrency": args.concurrency,
        "seed": args.seed,
        "requests_by_outcome": dict(by_outcome),
        "requests_by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "probes": dict(probes),
        "expected_probe_tokens": soak.expected,
        "failures": failures[:50] + warm_failures[:10],
        "num_failures": len(failures) + len(warm_failures),
        "control_actions": dict(soak.control),
        "control_failures": soak.control_failures,
        "latency_s": {
            "p50": percentile(latencies, 0.5),
            "p99": percentile(latencies, 0.99),
            "max": max(latencies, default=0.0),
        },  # fmt: skip
        "rss_mib": {"after_warmup": rss_warm, "end": rss_end, "growth": rss_growth},
        "kv_at_end": kv,
        "soak_wall_s": soak_wall,
        "total_wall_s": time.perf_counter() - t_start,
        "checks": checks,
    }


def print_report(res: dict) -> None:
    rows = [("requests", f"{res['num_requests']} at concurrency {res['concurrency']}")]
    rows += [(f"  {k}", str(v)) for k, v in sorted(res["requests_by_outcome"].items())]
    rows += [("probes checked", ", ".join(f"{k}: {v}" for k, v in sorted(res["probes"].items())))]
    rows += [("control actions", str(sum(res["control_actions"].values())))]
    rows += [(f"  {k}", str(v)) for k, v in sorted(res["control_actions"].items())]
    lat = res["latency_s"]
    rows += [
        ("latency p50 / p99 / max", f"{lat['p50']:.2f} / {lat['p99']:.2f} / {lat['max']:.2f} s")
    ]
    rss, kv, fault = res["rss_mib"], res["kv_at_end"], res["fault"]
    if fault is None:
        rows += [("RSS after warm-up / end", f"{rss['after_warmup']:.0f} / {rss['end']:.0f} MiB "
                  f"(growth {rss['growth']:+.1f} MiB)")]  # fmt: skip
        rows += [("KV at end", f"{kv['num_free_blocks']}/{kv['num_total_blocks']} blocks free, "
                  f"{kv['num_running_reqs']} running, {kv['num_waiting_reqs']} waiting, "
                  f"{kv['num_preempted_total']} preemptions in all")]  # fmt: skip
    else:
        after = fault["exit_after_s"]
        rows += [("fault", f"{fault['fault']} (pid {fault['pid']}: {fault['cmdline'][:60]})")]
        rows += [("server exit", f"code {fault['exit_code']}"
                  + (f", {after:.1f} s after the fault" if after is not None else ""))]  # fmt: skip
        rows += [("control calls after the fault", str(res["control_after_fault"]))]
    if "survivors" in res:
        rows += [("processes left after stop", str(len(res["survivors"])))]
    rows += [("soak / total wall time", f"{res['soak_wall_s']:.1f} / {res['total_wall_s']:.1f} s")]
    rows += [(f"check: {k}", "PASS" if v else "FAIL") for k, v in res["checks"].items()]
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    for f in res["failures"] + res["control_failures"]:
        print(f"  failure: {f}")


def _make_checkpoints(out: Path) -> tuple[str, str]:
    spec = importlib.util.spec_from_file_location(
        "make_tiny_model", ROOT / "scripts/make_tiny_model.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from frontend.model_prep import default_model_dir, is_complete

    tok = Path(default_model_dir())
    tok = tok if is_complete(tok) else None
    a = module.make_tiny_model("llama", out / "a", tok, 0)
    b = module.make_tiny_model("llama", out / "b", tok, 1)
    return str(a), str(b)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--base-url", help="attach to this server instead of launching one")
    p.add_argument("--checkpoint-a", help="checkpoint A (made with make_tiny_model when omitted)")
    p.add_argument("--checkpoint-b", help="checkpoint B (another seed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-file", type=Path, help="write the results here as JSON")
    p.add_argument("--request-timeout", type=float, default=120.0, help="per request, seconds")
    p.add_argument("--control-interval", type=float, default=1.0, help="mean gap, seconds")
    p.add_argument("--max-control-cycles", type=int, help="default: until the traffic ends")
    p.add_argument("--max-rss-growth-mib", type=float, default=64.0)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the launched server")
    p.add_argument("--fault", choices=FAULTS, help="kill or stop a process during the traffic")
    p.add_argument("--fault-after", type=float, default=3.0, help="seconds into the traffic")
    p.add_argument("--exit-within", type=float, default=30.0, help="seconds, after a --fault")
    args = p.parse_args(argv)
    if args.base_url and not (args.checkpoint_a and args.checkpoint_b):
        p.error("--base-url needs --checkpoint-a and --checkpoint-b (paths the server can load)")
    if args.base_url and args.fault:
        p.error("--fault needs a server the soak launches (no --base-url)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory(prefix="tern-soak-") as tmp:
        if not (args.checkpoint_a and args.checkpoint_b):
            args.checkpoint_a, args.checkpoint_b = _make_checkpoints(Path(tmp))
        server = None
        if args.base_url:
            res = asyncio.run(soak_async(args, args.base_url.rstrip("/"), None))
        else:
            env = (
                {"TERN_ENGINE_HEARTBEAT_TIMEOUT": str(FAULT_HEARTBEAT_TIMEOUT_S)}
                if args.fault
                else {}
            )
            server = launch(args.checkpoint_a, args.tp, env)
            try:
                server.wait_ready()
                res = asyncio.run(soak_async(args, server.base_url, server.proc.pid, server.proc))
            finally:
                survivors = [f"{p.pid} {_cmdline(p)}" for p in server.shut_down(30)]
            res["survivors"] = survivors
            res["checks"]["no process left after stop"] = not survivors
    res["passed"] = all(res["checks"].values())
    print_report(res)
    if args.result_file:
        args.result_file.write_text(json.dumps(res, indent=2))
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

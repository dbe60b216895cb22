"""Prefill/decode disaggregation (issue 47): short chats' inter-token latency next to long prompts.

Two setups on the same processes' worth of the machine, one run each, the same workload:
  plain: 2 plain tern servers behind `vllm-router --policy round_robin --worker-urls A B`;
  pd:    1 tern producer + 1 tern consumer (TernConnector) behind
         `vllm-router --vllm-pd-disaggregation --prefill P --decode D`.
Each server is pinned to one core with taskset (server i on core i mod cores), so both setups
split the cores the same way. The workload: short chats (~30-token prompts, 64 output tokens,
ignore_eos) arriving at a steady rate, and every --long-every seconds a 2,000-token prompt (16 output
tokens) made of random token ids (never a prefix-cache hit). Every request streams; inter-token
latency (ITL) is the gap between successive streamed chunks of one request.

The KV transfer's GB/s, on the idle pd setup after the load: a fresh 2,000-token prompt's TTFT
through the PD router minus the same-length prompt's time on the producer alone (max_tokens 1) is
the time the transfer, the router's second hop and the consumer's last block took; the consumer's
tern:kv_pull_bytes_total delta over that time is a lower bound on the transfer's GB/s. It is
compared with a torch copy of a 1 GiB tensor (read + write bytes / time).

    python scripts/bench_disagg.py                    # the default model, ~2 x 2 minutes
    python scripts/bench_disagg.py --duration 20      # a quicker look
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from enginecore.executor import free_port  # noqa: E402
from frontend.client.launched_server import LaunchedServer, is_alive  # noqa: E402
from frontend.model_prep import default_model_dir  # noqa: E402

SHORT_TEXT = "Give me one short tip about writing clear emails to a busy colleague at work, please."


def kv_config(role: str, **extra: object) -> str:
    return json.dumps({"kv_connector": "TernConnector", "kv_role": role,
                       "kv_connector_extra_config": extra})  # fmt: skip


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        float(v) for v in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    )


class RouterProc:
    """vllm-router on a free loopback port; every process of it is killed in stop()."""

    def __init__(self, args: list[str]) -> None:
        exe = shutil.which("vllm-router", path=str(Path(sys.executable).parent))
        if exe is None:
            raise SystemExit("vllm-router is not installed next to this python")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [exe, *args, "--host", "127.0.0.1", "--port", str(self.port),
               "--prometheus-port", str(free_port())]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited with {self.proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.3)
        raise TimeoutError("vllm-router was not healthy within 60 s")

    def stop(self) -> None:
        procs = [psutil.Process(self.proc.pid)]
        with contextlib.suppress(psutil.Error):
            procs += procs[0].children(recursive=True)
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        for p in procs:
            if is_alive(p):
                with contextlib.suppress(psutil.Error):
                    p.kill()


async def stream_one(client: httpx.AsyncClient, url: str, body: dict, endpoint: str) -> dict:
    """Streams one request; returns its chunk arrival times (from the send) or its error."""
    t0 = time.monotonic()
    times: list[float] = []
    try:
        async with client.stream("POST", f"{url}/v1/{endpoint}", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    return {"error": str(data["error"])[:300]}
                choice = (data.get("choices") or [{}])[0]
                piece = choice.get("text") or (choice.get("delta") or {}).get("content")
                if piece:
                    times.append(time.monotonic() - t0)
    except httpx.HTTPError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    if not times:
        return {"error": "no tokens streamed"}
    return {"times": times}


def long_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(length)]


async def run_load(url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    common = {"model": model, "stream": True, "temperature": 0, "ignore_eos": True}
    tasks: list[tuple[str, asyncio.Task]] = []
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits) as client:
        start = time.monotonic()
        next_short, next_long, i = start, start + args.long_every / 2, 0
        while time.monotonic() - start < args.duration:
            now = time.monotonic()
            if now >= next_short:
                body = {**common, "max_tokens": args.short_out,
                        "messages": [{"role": "user", "content": f"{i}. {SHORT_TEXT}"}]}  # fmt: skip
                tasks.append(("short", asyncio.create_task(
                    stream_one(client, url, body, "chat/completions"))))  # fmt: skip
                next_short += 1 / args.short_rate
                i += 1
            if now >= next_long:
                body = {**common, "max_tokens": args.long_out,
                        "prompt": long_prompt(rng, args.long_len)}  # fmt: skip
                tasks.append(
                    ("long", asyncio.create_task(stream_one(client, url, body, "completions")))
                )
                next_long += args.long_every
            await asyncio.sleep(max(0.0, min(next_short, next_long) - time.monotonic()))
        results = [(kind, await t) for kind, t in tasks]
        elapsed = time.monotonic() - start
    return summarize(results, elapsed)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return (
        ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))] if ordered else 0.0
    )


def summarize(results: list[tuple[str, dict]], elapsed: float) -> dict[str, Any]:
    errors = [r["error"] for _, r in results if "error" in r]
    short = [r["times"] for kind, r in results if kind == "short" and "times" in r]
    long_ = [r["times"] for kind, r in results if kind == "long" and "times" in r]
    itl = [b - a for t in short for a, b in zip(t, t[1:], strict=False)]
    tokens = sum(len(t) for t in short + long_)
    return {
        "short_done": len(short), "long_done": len(long_), "failed": len(errors),
        "errors": errors[:5], "itl_p50_ms": 1000 * pct(itl, 50), "itl_p99_ms": 1000 * pct(itl, 99),
        "ttft_short_p50_s": pct([t[0] for t in short], 50),
        "ttft_short_p99_s": pct([t[0] for t in short], 99),
        "ttft_long_p50_s": pct([t[0] for t in long_], 50),
        "tok_s": tokens / elapsed, "elapsed_s": elapsed,
    }  # fmt: skip


async def first_token_s(url: str, model: str, prompt: list[int], max_tokens: int) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    async with httpx.AsyncClient(timeout=httpx.Timeout(600)) as client:
        r = await stream_one(client, url, body, "completions")
    if "error" in r:
        raise RuntimeError(f"transfer probe failed: {r['error']}")
    return r["times"][0]


def transfer_probe(router: str, producer: str, consumer: str, model: str, args) -> dict[str, float]:
    """Lower bound on the KV transfer's GB/s (see the module docstring); best of 3."""
    rng = random.Random(args.seed + 1)
    best: dict[str, float] = {}
    for _ in range(3):
        prefill = asyncio.run(first_token_s(producer, model, long_prompt(rng, args.long_len), 1))
        bytes0, pulls0 = (
            metric(consumer, "tern:kv_pull_bytes_total"),
            metric(consumer, "tern:kv_pulls_total"),
        )
        pd = asyncio.run(first_token_s(router, model, long_prompt(rng, args.long_len), 2))
        nbytes = metric(consumer, "tern:kv_pull_bytes_total") - bytes0
        pulls = metric(consumer, "tern:kv_pulls_total") - pulls0
        extra = max(pd - prefill, 1e-6)
        row = {"prefill_s": prefill, "pd_ttft_s": pd, "extra_s": extra, "bytes": nbytes,
               "pulls": pulls, "gb_s": nbytes / extra / 1e9}  # fmt: skip
        if not best or row["gb_s"] > best["gb_s"]:
            best = row
    return best


def memory_bandwidth_gb_s() -> float:
    """torch copy of a 1 GiB float32 tensor: (read + write) bytes / best time of 5."""
    import torch

    src = torch.ones(1 << 28)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best / 1e9


def start_servers(args: argparse.Namespace, extra: list[list[str]]) -> list[LaunchedServer]:
    cores = os.cpu_count() or 1
    servers = []
    for i, flags in enumerate(extra):
        wrapper = ["taskset", "-c", str(i % cores)] if args.pin else []
        servers.append(LaunchedServer(
            ["--model", str(args.model), "--max-model-len", str(args.max_model_len), *flags],
            wrapper=wrapper, log_prefix="tern-bench-disagg-"))  # fmt: skip
    for s in servers:
        s.wait_ready(timeout=300)
    return servers


def stop_all(servers: list[LaunchedServer], router: RouterProc | None) -> None:
    if router is not None:
        router.stop()
    for s in servers:
        leftovers = s.shut_down()
        if leftovers:
            print(f"warning: killed survivors of {s.base_url}: {leftovers}", file=sys.stderr)
        elif s.proc.returncode not in (0, -15):
            print(f"warning: {s.base_url} exited with {s.proc.returncode}", file=sys.stderr)


def warm_up(url: str, model: str, args: argparse.Namespace) -> None:
    short = argparse.Namespace(**{**vars(args), "duration": 3, "long_every": 1000})
    asyncio.run(run_load(url, model, short))


def bench_plain(args: argparse.Namespace) -> dict[str, Any]:
    servers, router = [], None
    try:
        servers = start_servers(args, [[], []])
        urls = [s.base_url for s in servers]
        router = RouterProc(["--policy", "round_robin", "--worker-urls", *urls])
        model = httpx.get(f"{urls[0]}/v1/models", timeout=10).json()["data"][0]["id"]
        warm_up(router.url, model, args)
        return asyncio.run(run_load(router.url, model, args))
    finally:
        stop_all(servers, router)


def bench_pd(args: argparse.Namespace) -> dict[str, Any]:
    servers, router = [], None
    try:
        port = free_port()
        servers = start_servers(args, [
            ["--kv-transfer-config", kv_config("kv_producer", bootstrap_port=port)],
            ["--kv-transfer-config", kv_config("kv_consumer")]])  # fmt: skip
        producer, consumer = (s.base_url for s in servers)
        router = RouterProc(["--vllm-pd-disaggregation", "--policy", "round_robin",
                             "--prefill", producer, "--decode", consumer])  # fmt: skip
        model = httpx.get(f"{producer}/v1/models", timeout=10).json()["data"][0]["id"]
        warm_up(router.url, model, args)
        bytes0 = metric(consumer, "tern:kv_pull_bytes_total")
        out = asyncio.run(run_load(router.url, model, args))
        out["kv_pull_bytes"] = metric(consumer, "tern:kv_pull_bytes_total") - bytes0
        out["probe"] = transfer_probe(router.url, producer, consumer, model, args)
        out["pull_failures"] = metric(consumer, "tern:kv_pull_failures_total")
        return out
    finally:
        stop_all(servers, router)


def table(plain: dict, pd: dict) -> str:
    rows = [("short-chat ITL p50 (ms)", "itl_p50_ms", ".1f"), ("short-chat ITL p99 (ms)", "itl_p99_ms", ".1f"),
            ("short-chat TTFT p50 (s)", "ttft_short_p50_s", ".2f"),
            ("short-chat TTFT p99 (s)", "ttft_short_p99_s", ".2f"),
            ("long-prompt TTFT p50 (s)", "ttft_long_p50_s", ".2f"),
            ("output tokens/s (all requests)", "tok_s", ".1f"), ("short chats done", "short_done", "d"),
            ("long prompts done", "long_done", "d"), ("failed requests", "failed", "d")]  # fmt: skip
    lines = [
        "| | plain (2 servers) | PD (1 producer + 1 consumer) | PD / plain |",
        "|---|---|---|---|",
    ]
    for label, key, fmt in rows:
        ratio = f"{pd[key] / plain[key]:.2f}" if plain[key] else "-"
        lines.append(f"| {label} | {plain[key]:{fmt}} | {pd[key]:{fmt}} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="model directory (default: the default model)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--duration", type=float, default=60, help="seconds of arrivals per setup")
    p.add_argument("--short-rate", type=float, default=1.0, help="short chats per second")
    p.add_argument("--short-out", type=int, default=64)
    p.add_argument("--long-every", type=float, default=8.0, help="seconds between long prompts")
    p.add_argument("--long-len", type=int, default=2000)
    p.add_argument("--long-out", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-pin", dest="pin", action="store_false", help="do not taskset the servers")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args()
    # SIGTERM (timeout, a CI runner) unwinds like Ctrl-C: every server and router is stopped.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(1))
    args.model = args.model or default_model_dir()
    bandwidth = memory_bandwidth_gb_s()
    plain = bench_plain(args)
    pd = bench_pd(args)
    print(table(plain, pd))
    probe = pd["probe"]
    print(f"\nKV transfer probe (idle, {args.long_len}-token prompt): producer alone "
          f"{probe['prefill_s']:.2f} s to first token, through PD {probe['pd_ttft_s']:.2f} s; "
          f"{probe['bytes'] / 1e6:.1f} MB pulled in {probe['pulls']:.0f} pull(s) within "
          f"{probe['extra_s']:.3f} s -> >= {probe['gb_s']:.2f} GB/s; memory copy {bandwidth:.1f} GB/s "
          f"(ratio {probe['gb_s'] / bandwidth:.3f}). KV bytes pulled during the load: "
          f"{pd['kv_pull_bytes'] / 1e6:.1f} MB; pull failures: {pd['pull_failures']:.0f}")  # fmt: skip
    for name, r in (("plain", plain), ("pd", pd)):
        for e in r["errors"]:
            print(f"{name} error: {e}")
    if args.json:
        args.json.write_text(
            json.dumps({"plain": plain, "pd": pd, "memory_gb_s": bandwidth}, indent=1)
        )


if __name__ == "__main__":
    main()

"""Speculative decoding against plain decode, beside llama.cpp's llama-server with its own drafters,
on the same model: decode time per output token at c=1 and c=8 on three workloads; and the cost of
--batch-invariant.

    python scripts/bench_spec.py [--llama-server BIN --gguf-dir DIR] [--rounds 2] [--out FILE.json]
                                 [--configs plain,ngram,suffix,ngram-k5,f32,f32-invariant,llama,...]
                                 [--workloads edit,random,rl,prefill] [--hog N]

--hog N keeps N busy-looping processes running beside the servers while the workloads run (a
loaded machine: speculation must still pay there).

Workloads (chat completions, streamed):
- edit: fix the typos of a given paragraph and return it (the output copies the prompt);
  temperature 0, up to 256 tokens;
- random: a prompt of random words, 128 tokens forced (ignore_eos), temperature 0 (little to draft:
  the worst case);
- rl: the RL example's prompts (examples/rl/task.py), 8 samples each at temperature 1.0 and up to
  64 tokens, as GRPO rollouts sample them (c=1: one after the other; c=8: a group at once);
- prefill (the --batch-invariant configs only): a 1,000-token prompt, its TTFT.
Per request, decode time per token = (end - first token) / (tokens - 1); the table gives its
median over the workload's requests (the median over rounds), the ratio to tern's plain decode,
and for tern the share of drafts accepted (its /metrics).

Every server starts first and idles while another runs; each round runs every workload on every
server in turn, so that the machine's drift (tens of percent over minutes here) hits them alike.
tern runs the default model (`tern launch`, default dtype: bfloat16 where the CPU has AVX512-BF16,
else float32; "f32" and "f32-invariant" at --dtype float32 without and with --batch-invariant);
llama-server the GGUF of the same weights in the same dtype (smollm2-BF16.gguf or
smollm2-F32.gguf from ../shared/tools/build-llama-server), with 2 threads and 8 slots, plain and
with each of its model-free drafters (--spec-type), whose best is reported as "llama.cpp best".
The CPU's name and flags are printed first: every table must say which CPU it ran on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from examples.rl.task import sample_prompts  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
PARAGRAPHS = [
    "The commitee met on Tuesday to reveiw the budget for the new library. After a long "
    "discusion, members agreed to fund the reading room, the childrens corner and a small cafe, "
    "and to delay the roof repairs untill the spring.",
    "Our team has shiped the new release of the mobile app. It fixes the crash on start-up that "
    "some users saw on older phones, makes the search page load twice as fast, and adds a dark "
    "mode that folows the system setting.",
    "The museum will be closed on Monday for maintanance. Visitors who booked tickets for that "
    "day can use them on any other day this month, or ask for a refund at the front desk before "
    "the end of the week.",
    "Please remember that the quarterly reports are due on Friday. Each departement should send "
    "its figures to the finance office, together with a short note that explains any large "
    "changes since the last quater.",
    "The recipe calls for two cups of flour, one cup of sugar, three eggs and a pinch of salt. "
    "Mix the dry ingredients first, then add the eggs one at a time and bake for fourty minutes.",
    "Heavy rain is expected across the region tomorow, with strong winds along the coast. Drivers "
    "are advised to take extra care on the roads and to check for updates before they set off.",
    "The garden club will hold its anual plant sale on Saturday morning in the school hall. All "
    "the money raised will go towards new benches and a water tank for the comunity garden.",
    "Thank you for your order. Your package was dispatched this morning and should arrive within "
    "three working days. You can track its progres with the link in the confirmation email.",
]
WORDS = ("time person year way day thing man world life hand part child eye woman place work "
         "week case point number group problem fact river stone light music table garden letter "
         "window market city road paper money story water family night").split()  # fmt: skip
LLAMA_SPEC = {  # llama-server's model-free drafters
    "llama-ngram-simple": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                           "--spec-ngram-simple-size-m", "16"],
    "llama-ngram-map-k": ["--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", "3",
                          "--spec-ngram-map-k-size-m", "16"],
    "llama-ngram-mod": ["--spec-type", "ngram-mod"],
    "llama-ngram-cache": ["--spec-type", "ngram-cache"],
}  # fmt: skip
TERN_SPEC = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 16},
    "suffix": {"method": "suffix", "num_speculative_tokens": 16},
    "ngram-k5": {"method": "ngram", "num_speculative_tokens": 5},  # what vLLM users set
}
# --batch-invariant's cost: float32 with and without it, on the random and prefill workloads.
TERN_F32 = {
    "f32": ["--dtype", "float32"],
    "f32-invariant": ["--dtype", "float32", "--batch-invariant"],
}


def cpu_summary() -> str:
    flags, name = set(), "?"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and name == "?":
            name = line.split(":", 1)[1].strip()
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
    wanted = ["avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8"]
    return f"{name}, {os.cpu_count()} cores, flags: {' '.join(f for f in wanted if f in flags)}"


def workloads(concurrency: int) -> dict[str, list[dict[str, Any]]]:
    """Each workload's request bodies (without model and stream options)."""
    rng = random.Random(concurrency)
    n = 8 if concurrency == 1 else 16
    edit = [
        {"messages": [{"role": "user", "content": "Fix the spelling mistakes in this text. Reply "
                       f"with the corrected text only.\n\n{PARAGRAPHS[i % len(PARAGRAPHS)]}"}],
         "max_tokens": 256, "temperature": 0}
        for i in range(n)
    ]  # fmt: skip
    rand = [
        {"messages": [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(60))}],
         "max_tokens": 128, "temperature": 0, "ignore_eos": True}
        for _ in range(n)
    ]  # fmt: skip
    prompts = sample_prompts(random.Random(7), 2)
    rl = [
        {"messages": p.messages, "max_tokens": 64, "temperature": 1.0, "seed": 1000 * i + j}
        for i, p in enumerate(prompts)
        for j in range(8)
    ]
    # a long prompt (about 1,000 tokens), 2 tokens out: the prefill's time (TTFT)
    long = [
        {"messages": [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(900))}],
         "max_tokens": 2, "temperature": 0, "ignore_eos": True}
        for _ in range(max(2, n // 4))
    ]  # fmt: skip
    return {"edit": edit, "random": rand, "rl": rl, "prefill": long}


def workloads_of(name: str) -> list[str]:
    return ["random", "prefill"] if name in TERN_F32 else ["edit", "random", "rl"]


async def one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, float]:
    body = {**body, "model": MODEL, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = end = None
    tokens = chunks = 0
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    chunks += 1
                    first = first or time.perf_counter()
                    end = time.perf_counter()
    tokens = tokens or chunks
    if first is None or tokens < 2:
        raise RuntimeError(f"a request produced {tokens} tokens")
    assert end is not None
    return {"ttft": first - start, "tpot": (end - first) / (tokens - 1), "tokens": tokens}


async def run_workload(port: int, bodies: list[dict[str, Any]], concurrency: int) -> dict:
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    limit = asyncio.Semaphore(concurrency)
    # NOTE: no keep-alive: llama-server may close a connection the pool would reuse.
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def bounded(body: dict[str, Any]) -> dict[str, float]:
            async with limit:
                return await one(client, url, body)

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(b) for b in bodies))
        wall = time.perf_counter() - start
    return {
        "tpot_ms": 1000 * statistics.median(r["tpot"] for r in results),
        "ttft_ms": 1000 * statistics.median(r["ttft"] for r in results),
        "output_tok_s": sum(r["tokens"] for r in results) / wall,
        "requests": len(results),
    }


def spec_counters(port: int) -> tuple[float, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    values = {"draft": 0.0, "accepted": 0.0}
    for line in text.splitlines():
        if line.startswith("tern:spec_decode_num_draft_tokens_total"):
            values["draft"] += float(line.rsplit(" ", 1)[1])
        if line.startswith("tern:spec_decode_num_accepted_tokens_total"):
            values["accepted"] += float(line.rsplit(" ", 1)[1])
    return values["draft"], values["accepted"]


def launch(cmd: list[str], port: int, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited ({proc.returncode}), see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    stop(proc)
    raise RuntimeError(f"{cmd[0]} not healthy after 600 s, see {log}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def tern_dtype() -> str:
    import torch

    from workers.runner.loading import resolve_dtypes

    return (
        "bfloat16"
        if resolve_dtypes("auto", torch.device("cpu"))[0] == torch.bfloat16
        else "float32"
    )


def command(name: str, port: int, args: argparse.Namespace) -> list[str]:
    if name in TERN_F32:
        return [str(ROOT / ".venv/bin/tern"), "launch", "--port", str(port), *TERN_F32[name]]
    if name.startswith("llama"):
        gguf = args.gguf_dir / (
            "smollm2-BF16.gguf" if tern_dtype() == "bfloat16" else "smollm2-F32.gguf"
        )
        return [str(args.llama_server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                "-t", "2", "-tb", "2", "-np", "8", "-c", "16384", "--alias", MODEL,
                *LLAMA_SPEC.get(name, [])]  # fmt: skip
    cmd = [str(ROOT / ".venv/bin/tern"), "launch", "--port", str(port)]
    if name in TERN_SPEC:
        cmd += ["--speculative-config", json.dumps(TERN_SPEC[name])]
    return cmd


def measure(name: str, port: int, workload: str, c: int) -> dict:
    before = spec_counters(port) if not name.startswith("llama") else (0.0, 0.0)
    result = asyncio.run(run_workload(port, workloads(c)[workload], c))
    if not name.startswith("llama"):
        after = spec_counters(port)
        drafted = after[0] - before[0]
        result["acceptance"] = (after[1] - before[1]) / drafted if drafted else None
    return result


def run_all(names: list[str], args: argparse.Namespace) -> dict[str, dict[str, dict]]:
    """Every server started at once (idle ones cost nothing); each round runs every workload on
    every server in turn, so that a drift of the machine hits them alike; medians over rounds."""
    procs, ports = {}, {}
    try:
        for i, name in enumerate(list(names)):
            ports[name] = args.port + i
            try:
                procs[name] = launch(command(name, ports[name], args), ports[name],
                                     args.log_dir / f"{name}.log")  # fmt: skip
                asyncio.run(run_workload(ports[name], [workloads(1)["edit"][0]], 1))  # warm up
            except (RuntimeError, httpx.HTTPError) as e:  # a peer's drafter may not start
                print(f"== {name}: skipped ({e})", flush=True)
                names.remove(name)
        runs: dict[str, dict[str, list[dict]]] = {n: {} for n in names}
        # A loaded machine: processes that keep cores busy while every workload runs.
        procs.update({f"hog-{i}": subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                                   start_new_session=True)
                      for i in range(args.hog)})  # fmt: skip
        for r in range(args.rounds):
            for c in args.concurrency:
                for workload in args.workloads.split(","):
                    order = names[r % len(names) :] + names[: r % len(names)]
                    for name in order:
                        if workload not in workloads_of(name):
                            continue
                        result = measure(name, ports[name], workload, c)
                        runs[name].setdefault(f"{workload}/c{c}", []).append(result)
                        print(f"  round {r} {name:20s} {workload:7s} c={c}: "
                              + json.dumps(result), flush=True)  # fmt: skip
    finally:
        for proc in procs.values():
            stop(proc)
    out: dict[str, dict[str, dict]] = {}
    for name, by_key in runs.items():
        out[name] = {}
        for key, results in by_key.items():
            merged = {k: statistics.median(r[k] for r in results) for k in
                      ("tpot_ms", "ttft_ms", "output_tok_s")}  # fmt: skip
            acc = [r["acceptance"] for r in results if r.get("acceptance") is not None]
            merged["acceptance"] = statistics.median(acc) if acc else None
            out[name][key] = merged
    return out


def print_table(results: dict[str, dict], cpu: str, hog: int) -> None:
    busy = f"; beside {hog} busy-looping processes" if hog else ""
    print(f"\nCPU: {cpu}; tern dtype {tern_dtype()}{busy}")
    llama_spec = [n for n in results if n in LLAMA_SPEC]
    print("| workload | c | tern plain TPOT | tern ngram | tern suffix | tern ngram k=5 | "
          "llama.cpp plain | llama.cpp best spec |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for key in results.get("plain", {}):
        workload, c = key.split("/")
        if workload == "prefill":
            continue
        plain = results["plain"][key]["tpot_ms"]
        cells = [f"{plain:.2f} ms"]
        for name in TERN_SPEC:
            r = results.get(name, {}).get(key)
            cells.append("-" if r is None else f"{r['tpot_ms']:.2f} ms ({r['tpot_ms'] / plain:.2f}x, "
                         f"acc {100 * (r['acceptance'] or 0):.0f}%)")  # fmt: skip
        llama = results.get("llama", {}).get(key)
        cells.append("-" if llama is None else f"{llama['tpot_ms']:.2f} ms")
        best = min(((results[n][key]["tpot_ms"], n) for n in llama_spec if key in results[n]),
                   default=None)  # fmt: skip
        cells.append(
            "-" if best is None else f"{best[0]:.2f} ms ({best[1].removeprefix('llama-')})"
        )
        print(f"| {workload} | {c.removeprefix('c')} | " + " | ".join(cells) + " |")
    if "f32" in results and "f32-invariant" in results:
        print("\n| --batch-invariant (float32) | off | on | ratio |\n|---|---|---|---|")
        for key, off in results["f32"].items():
            on = results["f32-invariant"].get(key)
            if on is None:
                continue
            metric = "ttft_ms" if key.startswith("prefill") else "tpot_ms"
            print(f"| {key} {metric} | {off[metric]:.2f} | {on[metric]:.2f} | "
                  f"{on[metric] / off[metric]:.2f}x |")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--configs", default=None, help="comma-separated (default: all available)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--llama-server", type=Path, default=None)
    p.add_argument("--gguf-dir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/tern-bench-spec"))
    p.add_argument("--port", type=int, default=8391)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--workloads", default="edit,random,rl,prefill")
    p.add_argument(
        "--hog",
        type=int,
        default=0,
        help="busy-looping processes kept running while the workloads run",
    )
    args = p.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    names = ["plain", *TERN_SPEC, *TERN_F32]
    if args.llama_server and args.gguf_dir:
        names += ["llama", *LLAMA_SPEC]
    if args.configs:
        names = [n for n in args.configs.split(",") if n]
    cpu = cpu_summary()
    print(f"CPU: {cpu}", flush=True)
    results = run_all(names, args)
    print_table(results, cpu, args.hog)
    if args.out:
        args.out.write_text(json.dumps(
            {"cpu": cpu, "dtype": tern_dtype(), "hog": args.hog, "results": results}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()

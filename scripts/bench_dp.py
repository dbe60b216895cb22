"""Data-parallel throughput: `tern launch --dp N` for each N of --dp, at --concurrency requests.

For each N this script starts tern (the default model unless --model; the other launch options
follow `--`), runs scripts/bench_serving.py's load (random prompts of --input-len tokens, --output-len
tokens each, streaming, ignore_eos, greedy) twice after a warm-up, and stops it. Reported per N:
output tokens/s (the better of the two rounds), TTFT and TPOT p50, and from /metrics each replica's
share of the requests and tokens it sampled, so that an imbalance shows. The ratio to the first N
is the data-parallel speed-up: on a machine whose cores the replicas split (CPU), it measures what
running N smaller batches side by side gains or loses against one bigger batch.

--shared-prefix P measures the balancer's prefix affinity: every prompt then starts with the same
P tokens, and the table adds the prefix-cache hit rate over all replicas (the share of prompt
tokens served from cache); with affinity working it approaches P / (P + --input-len).

    python scripts/bench_dp.py                          # --dp 1 2, concurrency 32
    python scripts/bench_dp.py --shared-prefix 512 --num-prompts 128
    python scripts/bench_dp.py --num-prompts 8 --input-len 16 --output-len 8 --rounds 1 \\
        --model tiny_model_dir                          # a quick check that it runs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import httpx
import tokenizers

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_serving  # noqa: E402

from frontend.client.launched_server import LaunchedServer  # noqa: E402


def scrape(base_url: str) -> dict[tuple[str, str], float]:
    """(family sample name, replica) -> value, for the per-replica and prefix-cache samples."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    out: dict[tuple[str, str], float] = {}
    for name, labels, value in re.findall(r"^(tern:[a-z_]+)\{([^}]*)\} (\S+)$", text, re.M):
        replica = dict(re.findall(r'(\w+)="([^"]*)"', labels)).get("replica", "0")
        out[(name, replica)] = out.get((name, replica), 0.0) + float(value)
    return out


def per_replica(before: dict, after: dict, name: str, num_replicas: int) -> list[float]:
    return [after.get((name, str(i)), 0.0) - before.get((name, str(i)), 0.0)
            for i in range(num_replicas)]  # fmt: skip


def bench_one(args: argparse.Namespace, dp: int, prompts: list[tuple[str, int]]) -> dict[str, Any]:
    model_args = ["--model", str(args.model)] if args.model else []
    server = LaunchedServer([*model_args, "--dp", str(dp), *args.launch_args])
    try:
        server.wait_ready(timeout=args.startup_timeout)
        load = argparse.Namespace(**{**vars(args), "base_url": server.base_url, "label": f"dp{dp}"})
        model = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
        asyncio.run(bench_serving.run(load, model, prompts[: max(2, len(prompts) // 8)]))
        httpx.post(f"{server.base_url}/reset_prefix_cache", timeout=60)  # warm-up left prefixes
        before = scrape(server.base_url)
        rounds = [asyncio.run(bench_serving.run(load, model, prompts)) for _ in range(args.rounds)]
        after = scrape(server.base_url)
    finally:
        leftovers = server.shut_down()
        if leftovers:
            print(f"warning: processes survived --dp {dp}: {leftovers}", file=sys.stderr)
    best = max(rounds, key=lambda s: s["output_throughput"])
    queries = sum(
        per_replica(before, after, "tern:prefix_cache_queries_total", 1 if dp == 1 else dp)
    )
    hits = sum(per_replica(before, after, "tern:prefix_cache_hits_total", 1 if dp == 1 else dp))
    return {
        "dp": dp,
        "output_throughput": best["output_throughput"],
        "rounds_output_throughput": [s["output_throughput"] for s in rounds],
        "ttft_p50_ms": best["ttft_ms"]["p50"],
        "tpot_p50_ms": best["tpot_ms"]["p50"],
        "failed": sum(s["failed"] for s in rounds),
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "requests_per_replica": per_replica(before, after, "tern:replica_requests_routed_total", dp)
        if dp > 1
        else [float(sum(s["completed"] for s in rounds))],
        "tokens_sampled_per_replica": per_replica(
            before, after, "tern:replica_generation_tokens_sampled_total", dp
        )
        if dp > 1
        else [float(sum(s["total_output_tokens"] for s in rounds))],
    }


def shared_prefix_prompts(
    tok: tokenizers.Tokenizer, prompts: list[tuple[str, int]], prefix_len: int, seed: int
) -> list[tuple[str, int]]:
    ((prefix, _),) = bench_serving.random_prompts(tok, 1, prefix_len, seed + 1)
    out = []
    for text, _ in prompts:
        joined = prefix + text
        out.append((joined, len(tok.encode(joined, add_special_tokens=False).ids)))
    return out


def print_table(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\nconcurrency {args.concurrency}, {args.num_prompts} prompts x {args.input_len} in / "
          f"{args.output_len} out, shared prefix {args.shared_prefix}, {os.cpu_count()} cores")  # fmt: skip
    base = results[0]["output_throughput"]
    print(f"{'dp':>3} {'out tok/s':>10} {'ratio':>6} {'TTFT p50':>9} {'TPOT p50':>9} "
          f"{'prefix hit':>10} {'failed':>6}  requests / tokens per replica")  # fmt: skip
    for r in results:
        shares = "/".join(f"{x:.0f}" for x in r["requests_per_replica"])
        tokens = "/".join(f"{x:.0f}" for x in r["tokens_sampled_per_replica"])
        print(f"{r['dp']:>3} {r['output_throughput']:>10.1f} {r['output_throughput'] / base:>6.2f} "
              f"{r['ttft_p50_ms']:>7.0f}ms {r['tpot_p50_ms']:>7.1f}ms "
              f"{100 * r['prefix_cache_hit_rate']:>9.1f}% {r['failed']:>6}  {shares}  {tokens}")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--shared-prefix", type=int, default=0, metavar="P")
    return bench_serving.parse_launching_args(p, argv, num_prompts=96, output_len=128)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tok, prompts = bench_serving.launching_prompts(args)
    if args.shared_prefix:
        prompts = shared_prefix_prompts(tok, prompts, args.shared_prefix, args.seed)
    results = [bench_one(args, dp, prompts) for dp in args.dp]
    print_table(results, args)
    if args.result_file is not None:
        args.result_file.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(r["failed"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

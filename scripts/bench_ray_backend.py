"""The Ray executor backend against mp: `tern launch --tp 2` with --distributed-executor-backend mp
and ray on one host (the default model unless --model; other launch options follow `--`).

For each backend: seconds from the launch to /health's first 200 (the ray backend starts a local
Ray instance unless RAY_ADDRESS names one, and that counts), then scripts/bench_serving.py's load
(random prompts of --input-len tokens, --output-len tokens each, streaming, ignore_eos, greedy) at
concurrency 1 (TPOT p50) and at --concurrency (output tokens/s), the better of --rounds rounds
after a warm-up. Target (issue 48): the ray backend within 5% of mp.

    python scripts/bench_ray_backend.py
    python scripts/bench_ray_backend.py --num-prompts 8 --input-len 16 --output-len 8 \\
        --rounds 1 --model tiny_model_dir              # a quick check that it runs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_serving  # noqa: E402

from frontend.client.launched_server import LaunchedServer  # noqa: E402


def cpu_flags() -> str:
    """The CPU and its vector extensions (lscpu), for the table's header."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    wanted = [f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "fma")]
    return f"{fields.get('Model name', '?').strip()} ({' '.join(wanted)})"


def best_of(args: argparse.Namespace, load: argparse.Namespace, model: str, prompts: list) -> dict:
    rounds = [asyncio.run(bench_serving.run(load, model, prompts)) for _ in range(args.rounds)]
    return max(rounds, key=lambda s: s["output_throughput"])


def bench_one(args: argparse.Namespace, backend: str, prompts: list) -> dict[str, Any]:
    model_args = ["--model", str(args.model)] if args.model else []
    launch = [*model_args, "--tp", "2", "--distributed-executor-backend", backend]
    started = time.monotonic()
    server = LaunchedServer([*launch, *args.launch_args])
    try:
        server.wait_ready(timeout=args.startup_timeout)
        startup_s = time.monotonic() - started
        model = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
        base = {**vars(args), "base_url": server.base_url, "label": backend}
        single = argparse.Namespace(**{**base, "concurrency": 1})
        many = argparse.Namespace(**base)
        asyncio.run(bench_serving.run(many, model, prompts[: max(2, len(prompts) // 8)]))
        c1 = best_of(args, single, model, prompts[: max(4, len(prompts) // 8)])
        cn = best_of(args, many, model, prompts)
    finally:
        leftovers = server.shut_down()
        if leftovers:
            print(f"warning: processes survived the {backend} server: {leftovers}", file=sys.stderr)
    return {
        "backend": backend,
        "startup_s": startup_s,
        "c1_tpot_p50_ms": c1["tpot_ms"]["p50"],
        "output_throughput": cn["output_throughput"],
        "failed": c1["failed"] + cn["failed"],
    }


def print_table(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\n--tp 2 on one host, {cpu_flags()}; {args.num_prompts} prompts x {args.input_len} in "
          f"/ {args.output_len} out, c={args.concurrency}")  # fmt: skip
    mp = results[0]
    print(f"{'backend':>8} {'start-up':>9} {'c=1 TPOT p50':>13} {'ratio':>6} "
          f"{f'c={args.concurrency} tok/s':>12} {'ratio':>6} {'failed':>6}")  # fmt: skip
    for r in results:
        print(f"{r['backend']:>8} {r['startup_s']:>8.1f}s {r['c1_tpot_p50_ms']:>11.1f}ms "
              f"{r['c1_tpot_p50_ms'] / mp['c1_tpot_p50_ms']:>6.2f} {r['output_throughput']:>12.1f} "
              f"{r['output_throughput'] / mp['output_throughput']:>6.2f} {r['failed']:>6}")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    return bench_serving.parse_launching_args(p, argv, num_prompts=64, output_len=64)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _, prompts = bench_serving.launching_prompts(args)
    results = [bench_one(args, backend, prompts) for backend in ("mp", "ray")]
    print_table(results, args)
    if args.result_file is not None:
        args.result_file.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(r["failed"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

"""GGUF files through HTTP: `tern serve FILE` beside llama.cpp's llama-server on the same files,
both driven by the same client (scripts/bench_serving.py: streamed completions, ignore_eos).

Per file and round, one server at a time (the other is stopped: they share 2 cores), the servers
alternating: after an untimed pass of both loads, c=1 (8 prompts one after another) TPOT / TTFT,
then c=32 (32 prompts at once) output tokens per second. Reported: per file the median over the rounds of each server's p50 TPOT, p50
TTFT and c=32 tok/s, the ratios, and every failed request. Where `bench_gguf.py` times each
server's own step, this times what a client sees: tern's three processes (frontend, engine core,
worker) and the client share the machine with the model's threads.

    python scripts/bench_gguf_http.py --llama-server PATH [--files A.gguf ...] [--out FILE.json]

The default model's own Q4_1 file is always first. The CPU's name and flags are printed first.
Held to AVX2: run it with the environment `run_benchmarks --machine-kind avx2` sets (TERN_KERNELS=avx2
ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2; tern's server
inherits it) and a llama-server built for AVX2 only (GGML_NATIVE=OFF GGML_AVX2=ON
GGML_AVX512=OFF); the output records TERN_KERNELS.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_models  # noqa: E402
import bench_serving  # noqa: E402

from frontend.client.launched_server import LaunchedServer  # noqa: E402

ROUNDS = 2
# name: (concurrency, prompts, seed of its prompts); the untimed pass takes seed + 100. Each load
# its own prompts: another load's would be prefix-cache hits.
LOADS = {"c1": (1, 8, 0), "c32": (32, 32, 1)}


def _load(
    base_url: str, args: argparse.Namespace, concurrency: int, prompts: int, seed: int
) -> dict:
    with_args = [
        "--base-url", base_url, "--concurrency", str(concurrency), "--num-prompts", str(prompts),
        "--input-len", str(args.input_len), "--output-len", str(args.output_len),
        "--seed", str(seed),
    ]  # fmt: skip
    if args.tokenizer is not None:
        with_args += ["--tokenizer", str(args.tokenizer)]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "summary.json"
        with contextlib.redirect_stdout(io.StringIO()):  # its table: the summary below has it
            bench_serving.main([*with_args, "--result-file", str(out)])
        summary = json.loads(out.read_text())
    return {
        "completed": summary["completed"],
        "failed": summary["failed"],
        "errors": summary["errors"],
        "tpot_p50_ms": summary["tpot_ms"]["p50"],
        "itl_p50_ms": summary["itl_ms"]["p50"],
        "ttft_p50_ms": summary["ttft_ms"]["p50"],
        "output_tok_s": summary["output_throughput"],
    }


def _measure(base_url: str, args: argparse.Namespace) -> dict:
    # Warm-up: each load once, untimed, on other prompts (the same ones would be prefix-cache
    # hits: a repeated wave of 32 ran 1.3x faster, its prompts never computed).
    for c, n, seed in LOADS.values():
        _load(base_url, args, c, n, seed + 100)
    return {name: _load(base_url, args, c, n, seed) for name, (c, n, seed) in LOADS.items()}


def run_tern(gguf: Path, args: argparse.Namespace) -> dict:
    server = LaunchedServer(["--model", str(gguf)])
    try:
        server.wait_ready()
        return _measure(server.base_url, args)
    finally:
        server.shut_down()


def run_llamacpp(gguf: Path, args: argparse.Namespace) -> dict:
    proc, base_url = bench_models.launch_llamacpp(gguf, args.llama_server)
    try:
        return _measure(base_url, args)
    finally:
        bench_models.stop_llamacpp(proc)


def _median(rounds: list[dict], load: str, key: str) -> float:
    return statistics.median(r[load][key] for r in rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", nargs="*", type=Path, default=[])
    parser.add_argument("--llama-server", type=Path, required=True)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--tokenizer", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    cpu = bench_models.cpu_description()
    print(f"CPU: {cpu}", flush=True)
    from frontend.model_prep import find_gguf

    files = [find_gguf(), *args.files]
    results = []
    for f in files:
        runs: dict[str, list[dict]] = {"tern": [], "llama.cpp": []}
        for _ in range(args.rounds):
            runs["llama.cpp"].append(run_llamacpp(f, args))
            runs["tern"].append(run_tern(f, args))
        summary = {"file": f.name, "runs": runs}
        for server, rounds in runs.items():
            summary[server] = {
                "c1_tpot_ms": _median(rounds, "c1", "tpot_p50_ms"),
                "c1_ttft_ms": _median(rounds, "c1", "ttft_p50_ms"),
                "c32_tok_s": _median(rounds, "c32", "output_tok_s"),
                "failed": sum(r[load]["failed"] for r in rounds for load in LOADS),
            }
        results.append(summary)
        print(json.dumps({k: v for k, v in summary.items() if k != "runs"}), flush=True)
    print(
        "\n| file | tern c=1 TPOT ms | llama.cpp | ratio | tern TTFT ms | llama.cpp "
        "| tern c=32 tok/s | llama.cpp | ratio | failed |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    for r in results:
        t, ll = r["tern"], r["llama.cpp"]
        print(
            f"| {r['file']} | {t['c1_tpot_ms']:.2f} | {ll['c1_tpot_ms']:.2f} "
            f"| {t['c1_tpot_ms'] / ll['c1_tpot_ms']:.2f}x | {t['c1_ttft_ms']:.1f} "
            f"| {ll['c1_ttft_ms']:.1f} | {t['c32_tok_s']:.0f} | {ll['c32_tok_s']:.0f} "
            f"| {t['c32_tok_s'] / ll['c32_tok_s']:.2f}x | {t['failed'] + ll['failed']} |"
        )
    if args.out is not None:
        tier = os.environ.get("TERN_KERNELS", "best")
        args.out.write_text(
            json.dumps({"cpu": cpu, "tern_kernels": tier, "results": results}, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()

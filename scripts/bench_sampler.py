"""The sampler's cost per step, in process (workers/sample/sampler.py's Sampler.sample): rows of
--vocab logits (the default model's 49152) at temperature 0, 1, and with top-p / min-p / top-k,
for 1 and 32 rows, with a lone worker's torch threads (all cores) and its malloc settings.

Two kinds of logits: `peaked`, each row's probabilities falling as the default model's do on
natural text (top-p 0.9 keeps a few dozen tokens), and `flat` (standard normal times 3, what a
random-token prompt gives: top-p 0.95 keeps thousands of tokens, past the first candidates, so
those rows are sorted whole). Prints a table of median milliseconds and writes it as JSON.

    python scripts/bench_sampler.py --result-file sampler.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from enginecore.messages import SamplingParams  # noqa: E402
from workers.sample.sampler import Sampler, SamplingTensors  # noqa: E402
from workers.worker_control import reuse_heap_for_activations  # noqa: E402

CASES = {
    "greedy": dict(temperature=0.0),
    "temperature 1": dict(temperature=1.0),
    "top-p 0.9": dict(temperature=0.7, top_p=0.9),
    "top-p 0.95": dict(temperature=1.0, top_p=0.95),
    "min-p 0.05": dict(temperature=0.7, min_p=0.05),
    "top-k 50": dict(temperature=0.7, top_k=50),
}


def make_logits(kind: str, rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "flat":
        return torch.randn(rows, vocab, generator=gen) * 3
    # peaked: log-probabilities falling like a Zipf law over a random order of the vocabulary
    ranks = torch.stack([torch.randperm(vocab, generator=gen) for _ in range(rows)]) + 1
    return -1.6 * ranks.float().log() + torch.randn(rows, vocab, generator=gen) * 0.3


def time_case(logits: torch.Tensor, case: dict, repeats: int) -> float:
    rows, vocab = logits.shape
    batch = [SamplingParams(seed=i, **case) for i in range(rows)]
    tensors = SamplingTensors.from_params(batch, list(range(rows)), vocab, torch.device("cpu"))
    sampler = Sampler()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sampler.sample(logits, tensors)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e3  # the first two warm the allocator


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    p.add_argument("--repeats", type=int, default=25)
    p.add_argument("--result-file", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    reuse_heap_for_activations()  # as a worker does: else page faults weigh more than the sampler
    gen = torch.Generator().manual_seed(0)
    results = []
    print(f"{'logits':8s} {'case':14s} " + " ".join(f"{n:>4d} rows ms" for n in args.rows))
    for kind in ("peaked", "flat"):
        logits = {n: make_logits(kind, n, args.vocab, gen) for n in args.rows}
        for name, case in CASES.items():
            ms = {n: time_case(logits[n], case, args.repeats) for n in args.rows}
            results.append({"logits": kind, "case": name, "ms": ms})
            print(f"{kind:8s} {name:14s} " + " ".join(f"{ms[n]:12.2f}" for n in args.rows))
    if args.result_file:
        args.result_file.write_text(json.dumps({"vocab": args.vocab, "results": results}, indent=1))


if __name__ == "__main__":
    main()

"""What verifying drafts costs per family: the best case of speculative decoding, measured.

For each family (default: Llama and the hybrid Qwen3.5, whose linear-attention layers step a
verifying sequence's tokens one at a time and keep each state), scripts/bench_models.py's random
checkpoint of about 100M parameters is served in process (EngineCore on an InProcExecutor,
float32 unless --dtype): --concurrency sequences of --input-len random prompt tokens, --output-len
greedy tokens each, first plainly, then with an oracle drafter that proposes the plain run's own
continuation, K tokens a step, with a share --noise of them corrupted (every draft is verified).
Reported: the median decode step (plain: one token per sequence; drafted: K + 1 rows per
sequence), the decode time per output token, and its ratio to plain: what the drafts of an
accurate drafter (a trained MTP or EAGLE-3 head, a copying workload's n-grams) can reach. The
outputs are checked equal to plain's.

    python scripts/bench_spec_oracle.py [--families llama qwen3_5] [--k 4] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_models import cpu_description, make_checkpoint  # noqa: E402

from enginecore.config import (  # noqa: E402
    CacheConfig,
    Config,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from enginecore.core import EngineCore  # noqa: E402
from enginecore.executor import InProcExecutor  # noqa: E402
from enginecore.messages import EngineCoreRequest, SamplingParams  # noqa: E402


def make_core(model_dir: Path, dtype: str, concurrency: int, k: int) -> EngineCore:
    config = Config(
        model=ModelConfig(path=str(model_dir), dtype=dtype),
        cache=CacheConfig(kv_cache_memory_gib=2.0),
        scheduler=SchedulerConfig(max_num_seqs=concurrency),
        speculative=SpeculativeConfig("ngram", k, disable_by_batch_size=64)
        if k
        else SpeculativeConfig(),
    )
    return EngineCore(config, InProcExecutor(config))


def serve(core: EngineCore, prompts: list[list[int]], n: int) -> tuple[dict, list[float]]:
    """Each request's tokens, and the seconds of every step that decoded only."""
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"p{i}", p, params))
    outs: dict[str, list[int]] = {f"p{i}": [] for i in range(len(prompts))}
    decode_steps: list[float] = []
    for _ in range(100_000):
        if not core.scheduler.has_requests:
            break
        prefilling = any(
            r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running
        )
        t0 = time.perf_counter()
        results = core.step()
        seconds = time.perf_counter() - t0
        if not prefilling and not core.scheduler.waiting:
            decode_steps.append(seconds)
        for out in results:
            outs[out.request_id] += out.new_token_ids
    return outs, decode_steps


def oracle(core: EngineCore, plain: dict, prompts: list[list[int]], noise: float) -> None:
    """The drafter proposes plain decoding's continuation (a share `noise` corrupted), and every
    draft is verified."""
    rng = random.Random(0)
    lens = {f"p{i}": len(p) for i, p in enumerate(prompts)}
    drafter = core.scheduler.drafter
    assert drafter is not None

    def draft(request_id: str, tokens: list[int], limit: int) -> list[int]:
        done = len(tokens) - lens[request_id]
        drafts = list(plain[request_id][done : done + min(limit, drafter.max_k)])
        return [t + 1 if rng.random() < noise else t for t in drafts]

    drafter.draft = draft
    drafter.plan = lambda proposals, _: {r: len(d) for r, d in proposals.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="+", default=["llama", "qwen3_5"])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--noise", type=float, default=0.0)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    print(cpu_description(), flush=True)
    results: dict = {"cpu": cpu_description(), "args": vars(args), "families": {}}
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 32000) for _ in range(args.input_len)]
               for _ in range(args.concurrency)]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.families:
            model_dir = make_checkpoint(arch, Path(tmp) / arch)
            runs: dict[str, list[float]] = {"plain": [], "drafted": []}
            accepted = drafted_tokens = 0
            for _ in range(args.rounds):  # interleaved: the machine drifts
                core = make_core(model_dir, args.dtype, args.concurrency, 0)
                plain, steps = serve(core, prompts, args.output_len)
                core.shutdown()
                runs["plain"] += steps
                core = make_core(model_dir, args.dtype, args.concurrency, args.k)
                oracle(core, plain, prompts, args.noise)
                outs, steps = serve(core, prompts, args.output_len)
                stats = core.stats()
                core.shutdown()
                if outs != plain:
                    raise SystemExit(f"{arch}: the drafted run's tokens differ from plain's")
                runs["drafted"] += steps
                accepted += stats.spec_num_accepted_tokens
                drafted_tokens += stats.spec_num_draft_tokens
            tokens = args.concurrency * (args.output_len - 1)
            plain_step = statistics.median(runs["plain"])
            drafted_step = statistics.median(runs["drafted"])
            per_round = len(runs["drafted"]) / args.rounds
            row = {
                "plain_step_ms": 1e3 * plain_step,
                "drafted_step_ms": 1e3 * drafted_step,
                "plain_tpot_ms": 1e3 * sum(runs["plain"]) / args.rounds / tokens,
                "drafted_tpot_ms": 1e3 * sum(runs["drafted"]) / args.rounds / tokens,
                "drafted_steps_per_run": per_round,
                "acceptance": accepted / max(drafted_tokens, 1),
            }
            row["tpot_ratio"] = row["drafted_tpot_ms"] / row["plain_tpot_ms"]
            results["families"][arch] = row
            print(
                f"{arch}: step {row['plain_step_ms']:.2f} ms plain, {row['drafted_step_ms']:.2f} "
                f"ms with {args.k} drafts; TPOT {row['plain_tpot_ms']:.2f} -> "
                f"{row['drafted_tpot_ms']:.2f} ms = {row['tpot_ratio']:.2f}x "
                f"(acceptance {row['acceptance']:.2f})",
                flush=True,
            )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

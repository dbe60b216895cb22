"""Where the time of one engine step goes: an in-process EngineCore run, phase by phase.

Serves random prompts of --input-len tokens for --output-len tokens each (ignore_eos, temperature 0)
with --max-num-seqs = concurrency, on the default model unless --model is given, through the real
Scheduler and an InProcExecutor, and times every step in phases:

  schedule    Scheduler.schedule()
  broadcast   msgpack encode + decode of the step and of the reply (the in-process stand-in for the
              shared-memory broadcast and the reply socket)
  prepare     ModelRunner: block tables, input ids, attention metadata
  forward     the decoder layers
  lm_head     logits of the rows that sample
  sample      sampling tensors, the sampler, tokens to a list
  output      Scheduler.update_from_output()
  detokenize  frontend IncrementalDetokenizer over the new tokens

It prints, per concurrency, the median ms per step and each phase's share of the total for decode-only
steps (they set TPOT) and for steps that hold prefill chunks, plus the wall-clock output rate; first,
the kernel tier and the decode floor (workers/kernels/memory_floor.py: the weights a step reads over
the measured streaming-read bandwidth), and at concurrency 1 the decode step's ratio to it.

    python scripts/bench_step.py --concurrency 1 32
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import tokenizers  # noqa: E402
import torch  # noqa: E402

from enginecore.config import CacheConfig, Config, ModelConfig, SchedulerConfig  # noqa: E402
from enginecore.core import EngineCore  # noqa: E402
from enginecore.executor import InProcExecutor  # noqa: E402
from enginecore.messages import (  # noqa: E402
    Codec,
    EngineCoreRequest,
    ExecuteModel,
    SamplingParams,
    WorkerCall,
    WorkerReply,
    WorkerResult,
)
from frontend.text.detokenizer import IncrementalDetokenizer  # noqa: E402

PHASES = (
    "schedule",
    "broadcast",
    "prepare",
    "forward",
    "lm_head",
    "sample",
    "output",
    "detokenize",
)


def random_prompts(vocab_size: int, num: int, input_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Ids below 3 are special tokens in the default model; the rest are ordinary text pieces.
    return [[rng.randrange(3, vocab_size) for _ in range(input_len)] for _ in range(num)]


class StepTimer:
    """EngineCore.step() spelled out, with a clock around each phase."""

    def __init__(self, core: EngineCore, tokenizer: tokenizers.Tokenizer | None) -> None:
        self.core = core
        self.runner = core.executor.runner
        self.tokenizer = tokenizer
        self.call_codec = Codec(WorkerCall)
        self.reply_codec = Codec(WorkerReply)
        self.detoks: dict[str, IncrementalDetokenizer] = {}
        self.prompts: dict[str, list[int]] = {}

    def add(self, req_id: str, prompt: list[int], max_tokens: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        assert not self.core.add_request(EngineCoreRequest(req_id, prompt, params))
        self.prompts[req_id] = prompt

    def step(self) -> tuple[dict[str, float], bool, int, list[Any]]:
        """One step -> (seconds per phase, is decode-only, tokens sampled, engine outputs)."""
        t: dict[str, float] = {}
        scheduler = self.core.scheduler
        c0 = time.perf_counter()
        step = scheduler.schedule()
        c1 = time.perf_counter()
        t["schedule"] = c1 - c0
        wire = self.call_codec.decode(self.call_codec.encode(ExecuteModel(step)))
        c2 = time.perf_counter()
        out = self.runner.execute_model(wire.step)
        c3 = time.perf_counter()
        reply = self.reply_codec.decode(self.reply_codec.encode(WorkerResult(0, output=out)))
        c4 = time.perf_counter()
        t["broadcast"] = (c2 - c1) + (c4 - c3)
        inner = self.runner.last_step_timings
        for phase in ("prepare", "forward", "lm_head", "sample"):
            t[phase] = inner.get(phase, 0.0)
        outputs = scheduler.update_from_output(step, reply.output)
        c5 = time.perf_counter()
        t["output"] = c5 - c4
        if self.tokenizer is not None:
            for o in outputs:
                detok = self.detoks.get(o.request_id)
                if detok is None:
                    detok = IncrementalDetokenizer(self.tokenizer, self.prompts[o.request_id])
                    self.detoks[o.request_id] = detok
                detok.update(o.new_token_ids)
                detok.take_new_text(final=o.finish_reason is not None)
        t["detokenize"] = time.perf_counter() - c5
        is_decode = all(len(r.token_ids) == 1 for r in step.requests)
        return t, is_decode, sum(map(len, out.sampled_token_ids)), outputs


def run_point(timer: StepTimer, prompts: list[list[int]], output_len: int, tag: str) -> dict:
    for i, prompt in enumerate(prompts):
        timer.add(f"{tag}-{i}", prompt, output_len)
    decode_steps: list[dict[str, float]] = []
    prefill_steps: list[dict[str, float]] = []
    num_out = 0
    start = time.perf_counter()
    while timer.core.scheduler.has_requests:
        t, is_decode, sampled, _ = timer.step()
        (decode_steps if is_decode else prefill_steps).append(t)
        num_out += sampled
    wall = time.perf_counter() - start
    return {
        "num_prompts": len(prompts),
        "wall_s": wall,
        "output_tokens": num_out,
        "output_tok_per_s": num_out / wall,
        "decode": summarize(decode_steps),
        "prefill": summarize(prefill_steps),
    }


def summarize(steps: list[dict[str, float]]) -> dict[str, Any]:
    if not steps:
        return {"num_steps": 0}
    totals = [sum(s.values()) for s in steps]
    grand = sum(totals)
    return {
        "num_steps": len(steps),
        "median_ms": statistics.median(totals) * 1e3,
        "phases": {
            p: {
                "median_ms": statistics.median(s[p] for s in steps) * 1e3,
                "share": sum(s[p] for s in steps) / grand,
            }
            for p in PHASES
        },
    }


def print_point(concurrency: int, r: dict) -> None:
    print(
        f"\n== concurrency {concurrency}: {r['num_prompts']} prompts, {r['output_tokens']} output "
        f"tokens in {r['wall_s']:.1f} s = {r['output_tok_per_s']:.1f} tok/s"
    )
    for kind in ("decode", "prefill"):
        s = r[kind]
        if not s["num_steps"]:
            continue
        print(f"  {kind} steps: {s['num_steps']}, median {s['median_ms']:.2f} ms per step")
        for p in PHASES:
            ph = s["phases"][p]
            print(f"    {p:<11} {ph['median_ms']:9.3f} ms  {ph['share'] * 100:5.1f}%")


def build_core(args: argparse.Namespace, concurrency: int) -> EngineCore:
    extra = {"quantization": args.quantization} if args.quantization else {}
    config = Config(
        model=ModelConfig(path=str(args.model), dtype=args.dtype, **extra),
        cache=CacheConfig(
            kv_cache_memory_gib=args.kv_cache_memory, kv_cache_dtype=args.kv_cache_dtype
        ),
        scheduler=SchedulerConfig(max_num_seqs=concurrency),
    )
    return EngineCore(config, InProcExecutor(config))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="default: the default model")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default=None, help="e.g. int8")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--prompts-per-seq", type=int, default=2, help="prompts = this x concurrency")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--kv-cache-memory", type=float, default=1.0, help="GiB")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto or int8")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-file", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model is None:
        from frontend.model_prep import ensure_default_model

        args.model = ensure_default_model()
    import os

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    tok_file = Path(args.model) / "tokenizer.json"
    tokenizer = tokenizers.Tokenizer.from_file(str(tok_file)) if tok_file.is_file() else None
    results = {}
    for concurrency in args.concurrency:
        core = build_core(args, concurrency)
        timer = StepTimer(core, tokenizer)
        vocab = core.executor.vocab_size
        if concurrency == args.concurrency[0]:
            print(core.executor.model_summary, f"torch threads {torch.get_num_threads()}")
            print(core.executor.runner.kernel_report())
            floor = core.executor.runner.decode_floor(remembered=False)
            assert floor is not None, "bench_step runs on the CPU"
            print(floor)
        # Warm-up: one short request through prefill and decode (allocators, kernel selection).
        run_point(timer, random_prompts(vocab, 1, args.input_len, seed=-1), 8, "warmup")
        prompts = random_prompts(
            vocab, concurrency * args.prompts_per_seq, args.input_len, args.seed
        )
        r = run_point(timer, prompts, args.output_len, f"c{concurrency}")
        print_point(concurrency, r)
        if concurrency == 1 and r["decode"]["num_steps"]:
            r["floor_ms"] = floor.seconds * 1e3
            print(f"  decode step / floor: {r['decode']['median_ms'] / r['floor_ms']:.2f}x")
        results[concurrency] = r
        core.shutdown()
    if args.result_file is not None:
        args.result_file.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

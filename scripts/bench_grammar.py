"""Structured output's own costs, in process, through the engine core's compiler and matcher
(enginecore/structured_output.py, xgrammar): grammar compile time and the per-token cost.

1. First call: loads the tokenizer and builds xgrammar's tokenizer info, once per engine. Measured
   as a warm-up compile of a tiny schema (which costs next to nothing itself).
2. Cold compile of a 30-field JSON schema (integer ranges, enums, patterned strings, strings with
   maxLength, a nested object), as the server compiles it (the spec of the frontend's
   json_schema_spec, through json_schema_grammar): the median over --num-cold schemas that differ
   in field names and values, so none is cached. The first compile is also reported alone:
   xgrammar pays a one-time cost the first time it meets some constructs, which only a server's
   first such request sees.
3. Cached: the same schema again, the median of --num-cached (xgrammar's compile cache).
4. Per token, what the engine core pays for a constrained request: RequestGrammar.bitmask() (while
   the workers run the step's forward pass) and .accept(token) (after the step), along a valid
   output (greedy: the lowest allowed token id), for the 30-field schema and each of
   bench_serving.py's --structured constraints (built from its request body by the frontend's own
   code: the server's grammar) and two variants of its regex. Also the worker's side, per step:
   LogitsProcessorTensors.build and apply_logits_processors with the rows' bitmasks (xgrammar's
   apply_token_bitmask_inplace), with a lone worker's torch threads (all cores).

    python scripts/bench_grammar.py --result-file grammar.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from enginecore.messages import (  # noqa: E402
    SamplingParams,
    StructuredOutputKind,
    StructuredOutputSpec,
)
from enginecore.structured_output import GrammarCompiler, RequestGrammar  # noqa: E402

NUM_FIELDS = 30
BATCH_SIZES = (1, 8)  # constrained rows per step, for the worker's side
# Variants of bench_serving.py's regex, to tell which of its parts the per-token cost comes from.
REGEX_VARIANTS = ("([a-z]{3,10} )*", "([a-z]+ )*")


def big_schema(n: int) -> dict[str, Any]:
    """Schema number `n`: a 30-field object of integer ranges, enums, patterned strings, numbers,
    booleans and a nested object. Field names, ranges, enum values and lengths depend on `n`, so
    no two are alike. Every string is bounded (enum, pattern or maxLength): a greedy walk ends."""
    kinds: list[dict[str, Any]] = [
        {"type": "integer", "minimum": 0, "maximum": 120 + n},
        {"type": "string", "enum": [f"draft{n}", "review", "approved", "rejected"]},
        {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
        {"type": "integer", "minimum": -500 - n, "maximum": 99999},
        {"type": "string", "enum": ["low", "medium", f"high{n}"]},
        {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        {"type": "boolean"},
        {"type": "number"},
        {"type": "string", "maxLength": 16 + n},
    ]
    properties: dict[str, Any] = {}
    for i in range(NUM_FIELDS - 1):
        properties[f"s{n}_f{i}"] = kinds[i % len(kinds)]
    properties[f"s{n}_address"] = {
        "type": "object",
        "properties": {
            "street": {"type": "string", "maxLength": 24},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "country": {"type": "string", "enum": ["FR", "DE", "US", "JP"]},
            "floor": {"type": "integer", "minimum": 0, "maximum": 40 + n},
        },
        "required": ["street", "zip", "country", "floor"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def json_spec(schema: dict[str, Any]) -> StructuredOutputSpec:
    """The spec the server makes of a JSON schema (checked by the frontend, as a request's)."""
    from frontend.text.structured_outputs import json_schema_spec

    return json_schema_spec(schema, "response_format")


def serving_specs(model: str) -> dict[str, StructuredOutputSpec]:
    """bench_serving.py's --structured constraints, as the server turns its requests into specs."""
    import bench_serving

    from frontend.common.decoding import decode_request
    from frontend.openai.protocol import ChatCompletionRequest
    from frontend.text.chat_options import ChatOptions
    from frontend.text.tool_calling import plan_tools

    specs = {}
    for kind in ("json_schema", "regex", "tools"):
        args = argparse.Namespace(
            output_len=128, endpoint="chat", structured=kind, regex=bench_serving.REGEX
        )
        body = bench_serving.request_body(args, model, "hello")
        req = decode_request(json.dumps(body).encode(), ChatCompletionRequest)
        constraint = plan_tools(req, ChatOptions()).constraint
        assert constraint is not None, kind
        specs[f"regex {args.regex}" if kind == "regex" else kind] = constraint
    return specs


def timed(fn: Any, *args: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def walk(
    compiled: Any, compiler: GrammarCompiler, vocab_size: int, eos: list[int], max_tokens: int
) -> dict[str, Any]:
    """bitmask() + accept() per token along the greedy walk: the lowest allowed id, EOS only when
    nothing else is allowed (as with ignore_eos; else a grammar that may end at once would)."""
    grammar = RequestGrammar(compiled, compiler, [])
    bitmask_s, accept_s, masks = [], [], []
    while len(accept_s) < max_tokens and not grammar.is_terminated:
        mask, dt = timed(grammar.bitmask)
        bitmask_s.append(dt)
        assert mask is not None
        masks.append(mask)
        bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[:vocab_size]
        allowed = np.flatnonzero(bits)
        assert allowed.size > 0, "the grammar allows no token"
        not_eos = allowed[~np.isin(allowed, eos)]
        token = int(not_eos[0] if not_eos.size else allowed[0])
        ok, dt = timed(grammar.accept, token)
        accept_s.append(dt)
        assert ok, f"token {token} was refused"
    bitmask_us = statistics.median(bitmask_s) * 1e6
    accept_us = statistics.median(accept_s) * 1e6
    return {
        "num_tokens": len(accept_s),
        "is_terminated": grammar.is_terminated,
        "bitmask_us_p50": bitmask_us,
        "accept_us_p50": accept_us,
        "per_token_us_p50": bitmask_us + accept_us,
        "per_token_us_mean": (sum(bitmask_s) + sum(accept_s)) / len(accept_s) * 1e6,
        "masks": masks,
    }


def worker_apply_us(masks: list[bytes], vocab_size: int, repeats: int) -> dict[int, float]:
    """The worker's per-step cost of `rows` constrained rows: their bitmasks to a tensor and onto
    the logits (LogitsProcessorTensors.build + apply_logits_processors), median µs per step."""
    from workers.sample.logits_processors import LogitsProcessorTensors, apply_logits_processors

    device = torch.device("cpu")
    # NOTE: GrammarCompiler set this process to one torch thread; a lone worker has all cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    out = {}
    for rows in BATCH_SIZES:
        params = [SamplingParams(temperature=0.0, seed=0)] * rows
        logits = torch.randn(rows, vocab_size)
        times = []
        for i in range(repeats):
            bitmasks: list[bytes | None] = [masks[(i + r) % len(masks)] for r in range(rows)]
            t0 = time.perf_counter()
            t = LogitsProcessorTensors.build(
                params, [1] * rows, [None] * rows, vocab_size, device, bitmasks
            )
            assert t is not None
            apply_logits_processors(logits, t)
            times.append(time.perf_counter() - t0)
        out[rows] = statistics.median(times) * 1e6
    torch.set_num_threads(threads)
    return out


def compile_times(
    compile_now: Any, args: argparse.Namespace
) -> tuple[dict[str, Any], StructuredOutputSpec]:
    """Cold compiles of --num-cold distinct 30-field schemas, then the last one --num-cached times
    again; returns the times and that last schema."""
    # NOTE: built before the timing: the frontend's check of a schema is not the engine's work.
    cold_specs = [json_spec(big_schema(i)) for i in range(args.num_cold)]
    cold_s = [timed(compile_now, spec)[1] for spec in cold_specs]
    cached_s = [timed(compile_now, cold_specs[-1])[1] for _ in range(args.num_cached)]
    times = {
        "schema_chars": len(cold_specs[-1].spec),
        "cold_ms_first": cold_s[0] * 1e3,
        "cold_ms_p50": statistics.median(cold_s) * 1e3,
        "cold_ms_min": min(cold_s) * 1e3,
        "cold_ms_max": max(cold_s) * 1e3,
        "cold_ms": [t * 1e3 for t in cold_s],
        "cached_ms_p50": statistics.median(cached_s) * 1e3,
    }
    return times, cold_specs[-1]


def eos_token_ids(model: Path) -> list[int]:
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = model / name
        value = json.loads(path.read_text()).get("eos_token_id") if path.exists() else None
        ids += value if isinstance(value, list) else [] if value is None else [value]
    return list(dict.fromkeys(ids))


def default_model() -> Path:
    from frontend.model_prep import default_model_dir

    return Path(default_model_dir())


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = args.model or default_model()
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    eos = eos_token_ids(model)
    compiler = GrammarCompiler(model, vocab_size)

    def compile_now(spec: StructuredOutputSpec) -> Any:
        return compiler.submit(spec, eos).result()

    # NOTE: not json_spec: the frontend's check would import xgrammar before the timing.
    tiny = StructuredOutputSpec(StructuredOutputKind.JSON, '{"type": "boolean"}')
    _, first_s = timed(compile_now, tiny)
    compiles, big = compile_times(compile_now, args)
    specs = {f"{NUM_FIELDS}-field schema": big, **serving_specs(model.name)}
    for regex in REGEX_VARIANTS:
        specs[f"regex {regex}"] = StructuredOutputSpec(StructuredOutputKind.REGEX, regex)
    walks: dict[str, dict[str, Any]] = {}
    for name, s in specs.items():
        walks[name] = walk(compile_now(s), compiler, vocab_size, eos, args.max_tokens)
    masks = walks[f"{NUM_FIELDS}-field schema"]["masks"]
    worker = worker_apply_us(masks, vocab_size, args.num_cached * 10)
    compiler.shutdown()
    for w in walks.values():
        del w["masks"]
    return {
        "model": str(model),
        "vocab_size": vocab_size,
        "eos_token_ids": eos,
        "schema_fields": NUM_FIELDS,
        "first_call_ms": first_s * 1e3,
        "num_cold": args.num_cold,
        "num_cached": args.num_cached,
        "compile": compiles,
        "per_token": walks,
        "worker_apply_us_p50": {str(k): v for k, v in worker.items()},
    }


def print_tables(r: dict[str, Any]) -> None:
    print(f"model {r['model']} (vocab {r['vocab_size']}), xgrammar via enginecore")
    n = r["schema_fields"]
    print(f"{'grammar compile':<60}{'ms':>10}")
    c = r["compile"]
    rows = [
        ("first call (tokenizer info build + tiny schema)", r["first_call_ms"]),
        (f"cold, first {n}-field schema", c["cold_ms_first"]),
        (f"cold, {n}-field schema (median of {r['num_cold']})", c["cold_ms_p50"]),
        (f"cached, same schema (median of {r['num_cached']})", c["cached_ms_p50"]),
    ]
    for name, ms in rows:
        print(f"{name:<60}{ms:>10.3f}")
    print()
    print(f"{'per token (engine core)':<32}{'tokens':>7}{'bitmask us':>12}{'accept us':>11}"
          f"{'sum us':>9}{'mean us':>9}")  # fmt: skip
    for name, w in r["per_token"].items():
        print(
            f"{name:<32}{w['num_tokens']:>7}{w['bitmask_us_p50']:>12.1f}{w['accept_us_p50']:>11.1f}"
            f"{w['per_token_us_p50']:>9.1f}{w['per_token_us_mean']:>9.1f}"
        )
    print("(bitmask, accept, sum: medians; mean: of bitmask + accept over the walk)")
    print()
    for rows_, us in r["worker_apply_us_p50"].items():
        print(f"worker: bitmasks of {rows_} constrained row(s) per step: {us:.1f} us (median)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="default: frontend.model_prep's")
    p.add_argument("--num-cold", type=int, default=10, help="distinct schemas compiled cold")
    p.add_argument("--num-cached", type=int, default=20, help="compiles of a cached schema")
    p.add_argument("--max-tokens", type=int, default=1024, help="longest walk per grammar")
    p.add_argument("--result-file", type=Path, default=None)
    args = p.parse_args(argv)
    if min(args.num_cold, args.num_cached, args.max_tokens) < 1:
        p.error("--num-cold, --num-cached and --max-tokens must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    print_tables(result)
    if args.result_file is not None:
        args.result_file.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

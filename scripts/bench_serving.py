"""Load generator for any OpenAI-compatible server (tern, vLLM, ...): latency and throughput.

Sends --num-prompts streaming requests of random-token prompts of exactly --input-len tokens
(random ids decoded, re-encoded and fixed up, like vLLM's random dataset), each asking for
--output-len tokens with ignore_eos and temperature 0 (or --temperature / --top-p: sampled),
either --concurrency at a time or arriving as a Poisson process of --request-rate per second.
Measures per request TTFT (first chunk with text), TPOT ((e2e - ttft) / (n_out - 1)), ITL (gaps
between text chunks) and end-to-end latency; prints a table and writes the summary as JSON
(--result-file). Output tokens come from the usage of the last chunk
(stream_options.include_usage), else from the number of text chunks. The metrics are those of
`vllm bench serve` (same definitions), so results of both tools can sit side by side.

--structured adds one output constraint to every request: `json_schema` (response_format, chat),
`regex` (vLLM's structured_outputs, either endpoint; --regex PATTERN replaces the default) or
`tools` (two functions, tool_choice "required", chat). Each allows outputs longer than 128
tokens, so TPOT is measured over long outputs; a request still ends early ("stop") if the model
completes the grammar's output. With `tools` the calls arrive whole, one chunk per closed call:
TTFT is the first chunk of the reply (its role, sent with the first token) and ITL is the gap
between calls.

`plot` draws summaries (of one or more servers, told apart by --label) against concurrency:
output throughput, TTFT p50 and TPOT p50, one line per label (needs matplotlib).

    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --concurrency 8 --label tern
    python scripts/bench_serving.py plot --out bench.png results/*.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import tokenizers

ROOT = Path(__file__).resolve().parent.parent

# --structured: constraints that allow long outputs (up to 64 short strings, 200 words).
_WORDS = {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 64}
JSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "count": {"type": "integer", "minimum": 0, "maximum": 1000},
        "score": {"type": "number"},
        "done": {"type": "boolean"},
        "tags": _WORDS,
    },
    "required": ["title", "count", "score", "done", "tags"],
    "additionalProperties": False,
}
REGEX = "([a-z]{3,10} ){0,200}"
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Searches documents for keywords.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "maxLength": 40}, "keywords": _WORDS},
                "required": ["query", "keywords"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "tag_items",
            "description": "Tags items with labels.",
            "parameters": {
                "type": "object",
                "properties": {"labels": _WORDS, "limit": {"type": "integer", "minimum": 1}},
                "required": ["labels", "limit"],
            },
        },
    },
]
CHAT_ONLY = ("json_schema", "tools")


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    finish_reason: str = ""
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def default_tokenizer_dir() -> Path:
    sys.path.insert(0, str(ROOT))
    from frontend.model_prep import default_model_dir

    return Path(default_model_dir())


def random_prompts(
    tok: tokenizers.Tokenizer, num: int, input_len: int, seed: int
) -> list[tuple[str, int]]:
    """`num` texts of exactly `input_len` tokens where possible, with their token counts."""
    rng = random.Random(seed)
    specials = set(tok.get_added_tokens_decoder())
    normal = [i for i in range(tok.get_vocab_size()) if i not in specials]
    prompts = []
    for _ in range(num):
        ids = [rng.choice(normal) for _ in range(input_len)]
        for _ in range(10):  # decode -> re-encode may merge or split tokens: fix up and retry
            text = tok.decode(ids)
            ids = tok.encode(text, add_special_tokens=False).ids
            if len(ids) == input_len:
                break
            ids = ids[:input_len] + [rng.choice(normal) for _ in range(input_len - len(ids))]
        text = tok.decode(ids)
        prompts.append((text, len(tok.encode(text, add_special_tokens=False).ids)))
    return prompts


def request_body(args: argparse.Namespace, model: str, prompt: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": args.output_len,
        "temperature": args.temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.top_p is not None:
        body["top_p"] = args.top_p
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if args.structured == "json_schema":
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "record", "schema": JSON_SCHEMA},
        }
    elif args.structured == "regex":
        body["structured_outputs"] = {"regex": args.regex}
    elif args.structured == "tools":
        body["tools"] = TOOLS
        body["tool_choice"] = "required"
    return body


def chunk_text(endpoint: str, chunk: dict[str, Any]) -> str:
    """The chunk's output text: content, or the arguments of the tool calls it carries."""
    choice = chunk["choices"][0]
    if endpoint == "chat":
        delta = choice.get("delta", {})
        calls = delta.get("tool_calls") or []
        return (delta.get("content") or "") + "".join(
            c.get("function", {}).get("arguments") or "" for c in calls
        )
    return choice.get("text") or ""


async def one_request(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    endpoint: str,
    prompt_len: int,
    ttft_on_role: bool = False,
) -> RequestResult:
    """`ttft_on_role`: the first token is the chunk with the reply's role (tool calls, which arrive
    whole, only when they close)."""
    res = RequestResult(prompt_len=prompt_len)
    n_chunks = 0
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message", chunk["error"]))
                    return res
                now = time.perf_counter()
                choice = (chunk.get("choices") or [{}])[0]
                res.finish_reason = choice.get("finish_reason") or res.finish_reason
                is_role = ttft_on_role and n_chunks == 0 and "role" in choice.get("delta", {})
                if choice and (is_role or chunk_text(endpoint, chunk)):
                    if n_chunks == 0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    n_chunks += 1
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
        res.e2e = time.perf_counter() - start
        res.output_tokens = res.output_tokens or n_chunks
        res.ok = n_chunks > 0
        if not res.ok:
            res.error = "no text in the response"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run(args: argparse.Namespace, model: str, prompts: list[tuple[str, int]]) -> dict:
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    url = args.base_url.rstrip("/") + path
    limit = args.concurrency or len(prompts)
    sem = asyncio.Semaphore(limit)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    rng = np.random.default_rng(args.seed)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:

        async def limited(prompt: str, n: int) -> RequestResult:
            async with sem:
                body = request_body(args, model, prompt)
                is_tools = args.structured == "tools"
                return await one_request(client, url, body, args.endpoint, n, is_tools)

        start = time.perf_counter()
        tasks = []
        for prompt, n in prompts:
            tasks.append(asyncio.create_task(limited(prompt, n)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(args, model, results, duration)


def parse_launching_args(
    p: argparse.ArgumentParser, argv: list[str] | None, num_prompts: int, output_len: int
) -> argparse.Namespace:
    """For scripts that launch tern and load it with run(): the load's flags added to `p`, the
    `tern launch` flags after `--` (args.launch_args), and what run() reads fixed: streaming
    greedy completions, all sent at once."""
    argv = sys.argv[1:] if argv is None else argv
    launch_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, launch_args = argv[:i], argv[i + 1 :]
    p.add_argument("--model", type=Path, default=None, help="default: the default model")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=num_prompts)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=output_len)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--result-file", type=Path, default=None)
    args = p.parse_args(argv)
    args.launch_args = launch_args
    args.endpoint, args.structured, args.regex = "completions", None, None
    args.request_rate, args.timeout = float("inf"), 1800.0
    args.temperature, args.top_p = 0.0, None
    return args


def launching_prompts(
    args: argparse.Namespace,
) -> tuple[tokenizers.Tokenizer, list[tuple[str, int]]]:
    """The tokenizer (the --model's, else the default model's) and the random prompts of a
    launching script's load."""
    tok_dir = args.model if args.model and (args.model / "tokenizer.json").is_file() else None
    tok_dir = tok_dir or default_tokenizer_dir()
    tok = tokenizers.Tokenizer.from_file(str(Path(tok_dir) / "tokenizer.json"))
    return tok, random_prompts(tok, args.num_prompts, args.input_len, args.seed)


def _stats_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p99": float("nan")}
    a = np.asarray(values) * 1000.0
    return {
        "mean": float(a.mean()),
        "p50": float(np.percentile(a, 50)),
        "p99": float(np.percentile(a, 99)),
    }


def summarize(
    args: argparse.Namespace, model: str, results: list[RequestResult], duration: float
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    n_in = sum(r.prompt_len for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    errors = sorted({r.error for r in results if not r.ok})
    finish_reasons: dict[str, int] = {}
    for r in ok:
        finish_reasons[r.finish_reason or "?"] = finish_reasons.get(r.finish_reason or "?", 0) + 1
    return {
        "label": args.label or model,
        "base_url": args.base_url,
        "model": model,
        "endpoint": args.endpoint,
        "structured": args.structured,
        "regex": args.regex,
        "num_prompts": len(results),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "seed": args.seed,
        "concurrency": args.concurrency,
        "request_rate": args.request_rate,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors[:5],
        "finish_reasons": dict(sorted(finish_reasons.items())),
        "duration_s": duration,
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": n_out / duration,
        "total_token_throughput": (n_in + n_out) / duration,
        "ttft_ms": _stats_ms([r.ttft for r in ok]),
        "tpot_ms": _stats_ms([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": _stats_ms([x for r in ok for x in r.itl]),
        "e2e_ms": _stats_ms([r.e2e for r in ok]),
    }


def print_table(s: dict[str, Any]) -> None:
    rows = [
        ("Model", s["model"]),
        ("Endpoint", s["endpoint"]),
        ("Structured output", s.get("structured") or "none"),
        *([("Regex", s["regex"])] if s.get("regex") else []),
        ("Successful requests", s["completed"]),
        ("Failed requests", s["failed"]),
        ("Finish reasons", ", ".join(f"{k} {v}" for k, v in s["finish_reasons"].items()) or "-"),
        ("Duration (s)", f"{s['duration_s']:.2f}"),
        ("Total input tokens", s["total_input_tokens"]),
        ("Total output tokens", s["total_output_tokens"]),
        ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}"),
    ]
    for key, name in (
        ("ttft_ms", "TTFT"),
        ("tpot_ms", "TPOT"),
        ("itl_ms", "ITL"),
        ("e2e_ms", "E2E"),
    ):
        for stat in ("mean", "p50", "p99"):
            rows.append((f"{stat.capitalize()} {name} (ms)", f"{s[key][stat]:.2f}"))
    width = max(len(k) for k, _ in rows) + 2
    vwidth = max(16, *(len(str(v)) for _, v in rows))
    print("=" * (width + vwidth))
    for k, v in rows:
        print(f"{k:<{width}}{v!s:>{vwidth}}")
    print("=" * (width + vwidth))
    for e in s["errors"]:
        print(f"error: {e}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the first of /v1/models")
    p.add_argument(
        "--endpoint",
        choices=["completions", "chat"],
        default=None,
        help="default: chat with --structured json_schema or tools, else completions",
    )
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrivals per second (default: all at once)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=None, help="sent when given")
    p.add_argument("--tokenizer", type=Path, default=None, help="HF model dir with tokenizer.json")
    p.add_argument("--timeout", type=float, default=1800.0, help="per request, in seconds")
    p.add_argument("--result-file", type=Path, default=None)
    p.add_argument("--label", default=None, help="name of this server in plots (default: model)")
    p.add_argument(
        "--structured",
        choices=["json_schema", "regex", "tools"],
        default=None,
        help="constrain every request's output (json_schema and tools: chat endpoint only)",
    )
    p.add_argument(
        "--regex",
        default=None,
        metavar="PATTERN",
        help=f"the pattern of --structured regex (default: {REGEX.replace('%', '%%')})",
    )
    args = p.parse_args(argv)
    if args.structured in CHAT_ONLY and args.endpoint == "completions":
        p.error(f"--structured {args.structured} needs the chat endpoint (--endpoint chat)")
    if args.regex is not None and args.structured != "regex":
        p.error("--regex needs --structured regex")
    if args.structured == "regex" and args.regex is None:
        args.regex = REGEX
    if args.endpoint is None:
        args.endpoint = "chat" if args.structured in CHAT_ONLY else "completions"
    if args.concurrency is not None and args.concurrency < 1:
        p.error("--concurrency must be positive")
    if args.request_rate <= 0:
        p.error("--request-rate must be positive")
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        p.error("--num-prompts, --input-len and --output-len must be positive")
    return args


def plot(summaries: list[dict[str, Any]], out: Path, title: str = "") -> None:
    """Throughput, TTFT p50 and TPOT p50 against concurrency, one line per label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("output_throughput", "output tokens/s", lambda s: s["output_throughput"]),
        ("ttft", "TTFT p50 (ms)", lambda s: s["ttft_ms"]["p50"]),
        ("tpot", "TPOT p50 (ms)", lambda s: s["tpot_ms"]["p50"]),
    ]
    labels = list(dict.fromkeys(s["label"] for s in summaries))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for ax, (_, ylabel, value) in zip(axes, panels):
        for label in labels:
            points = sorted((s["concurrency"], value(s)) for s in summaries if s["label"] == label)
            ax.plot([c for c, _ in points], [v for _, v in points], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="bench_serving.py plot", description=plot.__doc__)
    p.add_argument("results", type=Path, nargs="+", help="summary JSON files (or lists of them)")
    p.add_argument("--out", type=Path, required=True, help="PNG to write")
    p.add_argument("--title", default="")
    args = p.parse_args(argv)
    summaries: list[dict[str, Any]] = []
    for path in args.results:
        data = json.loads(path.read_text())
        summaries += data if isinstance(data, list) else [data]
    if any(s.get("concurrency") is None for s in summaries):
        p.error("every summary needs a concurrency (run with --concurrency)")
    plot(summaries, args.out, args.title)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plot"]:
        return plot_main(argv[1:])
    args = parse_args(argv)
    tok_dir = args.tokenizer or default_tokenizer_dir()
    tok = tokenizers.Tokenizer.from_file(str(Path(tok_dir) / "tokenizer.json"))
    model = args.model
    if model is None:
        r = httpx.get(args.base_url.rstrip("/") + "/v1/models", timeout=30)
        r.raise_for_status()
        model = r.json()["data"][0]["id"]
    prompts = random_prompts(tok, args.num_prompts, args.input_len, args.seed)
    summary = asyncio.run(run(args, model, prompts))
    print_table(summary)
    if args.result_file is not None:
        args.result_file.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

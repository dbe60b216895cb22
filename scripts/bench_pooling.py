"""Pooling throughput: tern's /pooling against Hugging Face's AutoModelForSequenceClassification.

The model is a reward model made from the default model's weights (SmolLM2-135M-Instruct, a
Llama): its decoder with a random one-output score head, saved once as
LlamaForSequenceClassification (num_labels 1) in $TERN_HOME/models/SmolLM2-135M-Instruct-reward.

- Hugging Face: --num-inputs random-token inputs of --input-len tokens in batches of
  --batch-size (equal lengths: no padding), under torch.inference_mode, with as many torch threads
  as tern's worker uses (the machine's cores);
- tern: `tern launch --task reward --no-prefix-caching` on the same checkpoint (started and
  stopped by this script; each repeat sends the same inputs, which the prefix cache would serve);
  the same inputs, one per POST /pooling, --concurrency at a time.
Both in --dtype (float32 by default). After a warm-up, --repeats rounds of one pass of each, the
two alternating (load from other processes then falls on both); sequences/s is inputs / wall time. The table shows the CPU and its vector flags, the medians, their ratio, the
requests that failed, and the largest difference between the two sides' scores (both compute the
same function, so it is float noise). The load average says whether other processes were running.

    python scripts/bench_pooling.py                      # 256 inputs x 256 tokens, concurrency 32
    python scripts/bench_pooling.py --num-inputs 32 --repeats 1   # a quick check
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from enginecore.config import tern_home  # noqa: E402
from frontend.client.launched_server import LaunchedServer  # noqa: E402

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def reward_checkpoint(base: Path, out: Path, seed: int = 0) -> Path:
    """`base`'s decoder with a random score head (one output), saved once as
    LlamaForSequenceClassification."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoConfig, LlamaForSequenceClassification

    config = AutoConfig.from_pretrained(base)
    config.architectures = ["LlamaForSequenceClassification"]
    config.num_labels = 1
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification.from_pretrained(base, config=config, dtype=torch.float32)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for name in TOKENIZER_FILES:
        if (base / name).is_file():
            shutil.copy(base / name, tmp / name)
    tmp.rename(out)  # NOTE: whole or absent: an interrupted run leaves only the .tmp directory
    return out


def random_inputs(num: int, length: int, vocab: int, pad_id: int, seed: int) -> list[list[int]]:
    """Random token ids, never the pad id (HF's classifier pools at the last non-pad token)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(100, vocab - 100, size=(num, length))
    ids[ids == pad_id] = pad_id + 1
    return ids.tolist()


def cpu_info() -> tuple[str, str]:
    """(model name, which of CPU_FLAGS the CPU has)."""
    name, flags = "unknown", set()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name == "unknown":
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    present = " ".join(f for f in CPU_FLAGS if f in flags) or "none of " + ", ".join(CPU_FLAGS)
    return name, present


# --------------------------------------------------------------------------- Hugging Face


class HFModel:
    """AutoModelForSequenceClassification on the inputs, in batches."""

    def __init__(self, path: Path, dtype: str, batch_size: int) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification

        torch.set_num_threads(os.cpu_count() or 1)  # what tern's worker uses at --tp 1
        self.torch = torch
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=getattr(torch, dtype)
        ).eval()
        self.batch_size = batch_size

    def run(self, inputs: list[list[int]]) -> tuple[float, list[float]]:
        """(sequences/s, each input's score)."""
        torch, scores = self.torch, []
        start = time.perf_counter()
        with torch.inference_mode():
            for i in range(0, len(inputs), self.batch_size):
                ids = torch.tensor(inputs[i : i + self.batch_size])
                logits = self.model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
                scores += logits[:, 0].float().tolist()
        return len(inputs) / (time.perf_counter() - start), scores


# --------------------------------------------------------------------------- tern


async def tern_pass(
    url: str, inputs: list[list[int]], concurrency: int
) -> tuple[float, list[float | None]]:
    """(sequences/s, each input's score or None if its request failed)."""
    scores: list[float | None] = [None] * len(inputs)
    pending = iter(range(len(inputs)))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def worker() -> None:
            for i in pending:  # NOTE: one shared iterator: each input is sent once
                with contextlib.suppress(httpx.HTTPError):
                    r = await client.post("/pooling", json={"input": inputs[i]})
                    if r.status_code == 200:
                        scores[i] = r.json()["data"][0]["data"][0]

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return len(inputs) / elapsed, scores


def run_both(
    path: Path, inputs: list[list[int]], args: argparse.Namespace
) -> tuple[list[float], list[float], list[float], list[float | None], int]:
    """Repeats of (a Hugging Face pass, then a tern pass): the two sides alternate, so that load
    from other processes that comes and goes falls on both (tern idles at ~0% CPU meanwhile).

    Returns (HF sequences/s per repeat, tern's, HF's scores, tern's scores (None: failed), failed
    requests over all repeats)."""
    # NOTE: without prefix caching: the repeats send the same inputs, which a cache would serve.
    launch = [
        "--model",
        str(path),
        "--task",
        "reward",
        "--dtype",
        args.dtype,
        "--no-prefix-caching",
    ]
    launch += args.tern_args
    hf = HFModel(path, args.dtype, args.batch_size)
    tern = LaunchedServer(launch, log_prefix="bench-pooling-")
    try:
        tern.wait_ready(600.0)
        warm_up = inputs[: args.concurrency]
        hf.run(warm_up)
        asyncio.run(tern_pass(tern.base_url, warm_up, args.concurrency))
        hf_rates, tern_rates, failed = [], [], 0
        hf_scores: list[float] = []
        tern_scores: list[float | None] = []
        for _ in range(args.repeats):
            rate, hf_scores = hf.run(inputs)
            hf_rates.append(rate)
            rate, tern_scores = asyncio.run(tern_pass(tern.base_url, inputs, args.concurrency))
            tern_rates.append(rate)
            failed += sum(s is None for s in tern_scores)
    finally:
        tern.shut_down(30)
    return hf_rates, tern_rates, hf_scores, tern_scores, failed


# --------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-inputs", type=int, default=256)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=32, help="tern: requests in flight")
    p.add_argument("--batch-size", type=int, default=32, help="Hugging Face: inputs per forward")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tern-args", nargs=argparse.REMAINDER, default=[], help="more launch flags")
    args = p.parse_args()

    from frontend.model_prep import default_model_dir

    base = Path(default_model_dir())
    path = reward_checkpoint(base, tern_home() / "models" / f"{base.name}-reward")
    config = json.loads((path / "config.json").read_text())
    pad_id = config.get("pad_token_id")
    pad_id = pad_id if isinstance(pad_id, int) else -1
    inputs = random_inputs(args.num_inputs, args.input_len, config["vocab_size"], pad_id, args.seed)
    load_before = os.getloadavg()
    hf_rates, tern_rates, hf_scores, tern_scores, failed = run_both(path, inputs, args)
    load_after = os.getloadavg()

    both = [(t, h) for t, h in zip(tern_scores, hf_scores) if t is not None]
    max_diff = max((abs(t - h) for t, h in both), default=float("nan"))
    name, flags = cpu_info()
    tern_median, hf_median = statistics.median(tern_rates), statistics.median(hf_rates)
    print(f"\nCPU: {name} ({os.cpu_count()} cores); flags: {flags}")
    print(
        f"{args.num_inputs} inputs x {args.input_len} tokens, {args.dtype}, {args.repeats} repeats; "
        f"tern at concurrency {args.concurrency}, Hugging Face in batches of {args.batch_size}, "
        f"{os.cpu_count()} torch threads each"
    )
    print(
        f"load average (1 min) before {load_before[0]:.1f}, after {load_after[0]:.1f}: above "
        f"{os.cpu_count()} means other processes shared the cores\n"
    )
    print("| | sequences/s (median) | runs | failed requests |")
    print("| --- | --- | --- | --- |")
    print(
        f"| tern /pooling | {tern_median:.2f} | {', '.join(f'{r:.2f}' for r in tern_rates)} | {failed} |"
    )
    print(
        f"| HF AutoModelForSequenceClassification | {hf_median:.2f} | {', '.join(f'{r:.2f}' for r in hf_rates)} | - |"
    )
    ratios = [t / h for t, h in zip(tern_rates, hf_rates)]
    print(
        f"\ntern / HF: {tern_median / hf_median:.2f}x (medians); per repeat "
        f"{', '.join(f'{r:.2f}' for r in ratios)}; largest score difference: {max_diff:.2e}"
    )


if __name__ == "__main__":
    main()

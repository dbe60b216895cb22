"""tern's attention kernels against torch's, one layer at a time, at the default model's heads
(9 query heads, 3 KV heads, 64 features, blocks of 16):

  prefill   csrc/prefill_attention.c (a fresh prompt, causal, straight from the paged cache)
            against F.scaled_dot_product_attention (is_causal, enable_gqa) on the same tensors
  decode    csrc/attention.c, one sequence's query over --contexts tokens of 30 layers' caches
            (more than the caches fit: read from memory, as in a decode step)

Medians of --repeats calls; the kernel tier is TERN_KERNELS' (default: this CPU's best), torch's
ATEN_CPU_CAPABILITY's. Prints the tier and the CPU's flags first.

    python scripts/bench_attention.py --dtype bfloat16 --lengths 256 1000 2000
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from workers.kernels import attention_ops, kernel_library  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
LAYERS = 30


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def prefill_point(length: int, dtype: torch.dtype, repeats: int) -> dict:
    blocks = -(-length // BLOCK)
    k = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM).to(dtype)
    v = torch.randn_like(k)
    q = torch.randn(length, HEADS, HEAD_DIM).to(dtype)
    out = torch.empty_like(q)
    tables = torch.arange(blocks, dtype=torch.int32).view(1, blocks)
    one = torch.tensor([length], dtype=torch.int32)
    zero = torch.tensor([0], dtype=torch.int32)
    scale = HEAD_DIM**-0.5

    def kernel() -> None:
        attention_ops.prefill_attention(q, k, v, tables, zero, one, zero, scale, None, out)

    def sdpa() -> None:
        keys = k.flatten(0, 1)[:length].transpose(0, 1)[None]
        values = v.flatten(0, 1)[:length].transpose(0, 1)[None]
        F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys, values, is_causal=True, scale=scale, enable_gqa=True
        )

    flops = 4 * HEADS * HEAD_DIM * length * (length + 1) / 2
    point = {"tokens": length, "sdpa_ms": median_ms(sdpa, repeats)}
    if attention_ops.supports_prefill(dtype, HEADS, KV_HEADS, HEAD_DIM):
        point["kernel_ms"] = median_ms(kernel, repeats)
        point["kernel_gflops"] = flops / point["kernel_ms"] / 1e6
        point["ratio"] = point["kernel_ms"] / point["sdpa_ms"]
    point["sdpa_gflops"] = flops / point["sdpa_ms"] / 1e6
    return point


def decode_point(context: int, dtype: torch.dtype, repeats: int) -> dict:
    blocks = -(-context // BLOCK)
    caches = [
        (torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM).to(dtype),
         torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM).to(dtype))
        for _ in range(LAYERS)
    ]  # fmt: skip
    q = torch.randn(1, HEADS, HEAD_DIM).to(dtype)
    tables = torch.randperm(blocks, dtype=torch.int32).view(1, blocks)
    lens = torch.tensor([context], dtype=torch.int32)

    def step() -> None:
        for k, v in caches:
            attention_ops.paged_decode_attention(q, k, v, tables, lens, HEAD_DIM**-0.5)

    return {"context": context, "ms_per_layer": median_ms(step, repeats) / LAYERS}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1000, 2000])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 4096])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--result-file", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if kernel_library.load() is None:
        print("the kernels are not built (no C compiler?)")
        return 1
    dtype = getattr(torch, args.dtype)
    flags = sorted(f for f in kernel_library.cpu_features() if f.startswith(("avx", "amx")))
    print(f"kernels: {kernel_library.active_tier_name()}; CPU flags: {' '.join(flags)}")
    print(f"torch threads {torch.get_num_threads()}, {args.dtype}")
    results = {"tier": kernel_library.active_tier_name(), "dtype": args.dtype,
               "prefill": [], "decode": []}  # fmt: skip
    for length in args.lengths:
        r = prefill_point(length, dtype, args.repeats)
        results["prefill"].append(r)
        kernel = f"{r['kernel_ms']:.2f} ms ({r['ratio']:.2f}x)" if "kernel_ms" in r else "n/a"
        print(f"prefill {length:5d} tokens: SDPA {r['sdpa_ms']:.2f} ms, kernel {kernel}")
    for context in args.contexts:
        r = decode_point(context, dtype, args.repeats)
        results["decode"].append(r)
        print(f"decode  {context:5d} context: {r['ms_per_layer'] * 1e3:.1f} us per layer")
    if args.result_file is not None:
        args.result_file.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

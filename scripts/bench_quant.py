"""A candidate model (int8 weights, or bfloat16) against the float32 reference: top-1 agreement and
single-sequence decode speed.

    python scripts/bench_quant.py --candidate-dtype bfloat16 --quantization int8   # int8 as served
    python scripts/bench_quant.py --candidate-dtype bfloat16 --quantization none   # bf16 vs fp32

1. Agreement: 8 chat prompts, 64 greedy tokens each from the reference (fp32 by default). The
   candidate model then reads each reference sequence (teacher forcing) and we count the positions
   where its argmax is the reference token: the top-1 agreement rate. Also reported: the free-running
   greedy outputs of the quantized model, as the share of tokens before the first divergence.
2. Speed: one request (a random --input-len prompt, --output-len tokens, ignore_eos) through an
   in-process EngineCore; the median decode step is the TPOT floor of a server at concurrency 1.
3. --kernels: the int8 matmul backends and tern's float32 kernel against BLAS on the model's
   shapes, per batch size (this chose quantization.DEQUANT_MIN_ROWS and linear.NATIVE_F32_MAX_ROWS).

    python scripts/bench_quant.py            # the default model, float32 vs int8
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from enginecore.config import CacheConfig, Config, ModelConfig, SchedulerConfig  # noqa: E402
from enginecore.core import EngineCore  # noqa: E402
from enginecore.executor import InProcExecutor  # noqa: E402
from enginecore.messages import EngineCoreRequest, SamplingParams  # noqa: E402
from workers.layers.attention import build_attention_metadata  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for learning a new language.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet.",
    "How do I boil an egg?",
    "List five prime numbers and explain why they are prime.",
]


def make_core(model: Path, dtype: str, quantization: str | None) -> EngineCore:
    config = Config(
        model=ModelConfig(path=str(model), dtype=dtype, quantization=quantization),
        cache=CacheConfig(kv_cache_memory_gib=0.25),
        scheduler=SchedulerConfig(max_num_seqs=64),
    )
    return EngineCore(config, InProcExecutor(config))


def chat_prompts(model: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in PROMPTS
    ]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def generate(core: EngineCore, prompts: list[list[int]], n: int) -> list[list[int]]:
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        assert not core.add_request(EngineCoreRequest(f"g{i}", p, params))
        out[f"g{i}"] = []
    while core.scheduler.has_requests:
        for o in core.step():
            out[o.request_id] += o.new_token_ids
    return [out[f"g{i}"] for i in range(len(prompts))]


@torch.inference_mode()
def teacher_forced_argmax(core: EngineCore, seq: list[int], start: int) -> list[int]:
    """The model's argmax after each of seq[start - 1:-1]: the prompt seq[:start] in one prefill,
    then one decode step per token of seq[start:] (the kernels a served request runs)."""
    runner = core.executor.runner
    bs = runner.block_size
    table = list(range(-(-len(seq) // bs)))  # nothing else runs: any blocks will do
    out = []
    pos, n = 0, start
    while pos < len(seq):
        meta = build_attention_metadata([pos], [n], [table], bs, runner.device)
        hidden = runner.model(torch.tensor(seq[pos : pos + n], device=runner.device), meta)
        out.append(int(runner.model.compute_logits(hidden[-1:]).argmax(dim=-1)))
        pos, n = pos + n, 1
    return out[: len(seq) - start]


def agreement(model: Path, args: argparse.Namespace) -> dict:
    prompts = chat_prompts(model)
    ref_core = make_core(model, args.dtype, None)
    refs = generate(ref_core, prompts, args.num_tokens)
    ref_core.shutdown()
    del ref_core
    q_core = make_core(model, args.candidate_dtype, args.quantization)
    outs = generate(q_core, prompts, args.num_tokens)
    agree = total = prefix = 0
    for prompt, ref, out in zip(prompts, refs, outs):
        forced = teacher_forced_argmax(q_core, prompt + ref, len(prompt))
        agree += sum(a == b for a, b in zip(forced, ref))
        total += len(ref)
        prefix += next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), len(ref))
    q_core.shutdown()
    return {
        "top1_agreement": agree / total,
        "free_running_prefix_share": prefix / total,
        "tokens": total,
    }


def decode_tpot(
    model: Path, args: argparse.Namespace, dtype: str, quantization: str | None
) -> float:
    core = make_core(model, dtype, quantization)
    rng = random.Random(0)
    vocab = core.executor.vocab_size
    prompt = [rng.randrange(3, vocab) for _ in range(args.input_len)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    assert not core.add_request(EngineCoreRequest("tpot", prompt, params))
    times = []
    while core.scheduler.has_requests:
        t = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t)
    core.shutdown()
    return statistics.median(times[1:]) * 1e3  # the first step is the prefill


def kernel_sweep(threads: int) -> None:
    from workers.kernels import kernel_library, linear_ops
    from workers.quant import quantization as q

    def best_ms(fn, reps: int = 5, n: int = 5) -> float:
        fn()
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            for _ in range(n):
                fn()
            best = min(best, (time.perf_counter() - t) / n)
        return best * 1e3

    backends = ["native", "dequant"] + (["torch"] if q._cpu_has_avx512() else [])
    print(
        f"matmul per call (ms), {threads} threads: fp32 = F.linear (BLAS), fp32-native = tern's "
        "float32 kernel, then the int8 backends"
    )
    for n_out, n_in in ((960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)):
        w = torch.randn(n_out, n_in)
        wq, scale = q.quantize_rows(w)
        for rows in (1, 8, 32, 64, 128, 256):
            x = torch.randn(rows, n_in)
            fp32 = best_ms(lambda x=x, w=w: torch.nn.functional.linear(x, w))
            cells = [f"fp32 {fp32:7.3f}"]
            if kernel_library.load() is not None:
                ms = best_ms(lambda x=x, w=w: linear_ops.f32_linear(x, w, None))
                cells.append(f"fp32-native {ms:7.3f}")
            for b in backends:
                if b == "native" and kernel_library.load() is None:
                    continue
                if b == "native":  # the kernel itself, whatever DEQUANT_MIN_ROWS says
                    fn = lambda x=x, wq=wq, s=scale: linear_ops.int8_linear(x, wq, s, None)  # noqa: E731
                else:
                    fn = lambda b=b, x=x, wq=wq, s=scale: q.int8_matmul(x, wq, s, None, b)  # noqa: E731
                ms = best_ms(fn)
                cells.append(f"{b} {ms:7.3f}")
            print(f"  ({n_out:5d}, {n_in:4d}) x {rows:3d} rows: " + "  ".join(cells))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="default: the default model")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--candidate-dtype", default=None, help="dtype of the compared model (--dtype)")
    p.add_argument("--quantization", default="int8", help="int8, or none")
    p.add_argument("--num-tokens", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: cores)")
    p.add_argument("--kernels", action="store_true", help="also sweep the int8 matmul backends")
    p.add_argument("--result-file", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import os

    args = parse_args(argv)
    args.candidate_dtype = args.candidate_dtype or args.dtype
    args.quantization = None if args.quantization == "none" else args.quantization
    candidate = f"{args.candidate_dtype}{' + ' + args.quantization if args.quantization else ''}"
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    if args.model is None:
        from frontend.model_prep import ensure_default_model

        args.model = ensure_default_model()
    if args.kernels:
        kernel_sweep(torch.get_num_threads())
    result = agreement(args.model, args)
    print(
        f"top-1 agreement of {candidate} with {args.dtype} over {len(PROMPTS)} prompts x "
        f"{args.num_tokens} tokens: {result['top1_agreement'] * 100:.1f}% "
        f"(free-running: {result['free_running_prefix_share'] * 100:.1f}% of tokens before the "
        "first divergence)"
    )
    result["reference"], result["candidate"] = args.dtype, candidate
    for key, dtype, quant in (
        ("reference", args.dtype, None),
        ("candidate", args.candidate_dtype, args.quantization),
    ):
        ms = decode_tpot(args.model, args, dtype, quant)
        result[f"tpot_ms_{key}"] = ms
        print(f"decode step at concurrency 1, {result[key]}: median {ms:.2f} ms")
    if args.result_file is not None:
        args.result_file.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

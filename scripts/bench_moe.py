"""Mixture-of-experts decode speed: a random ~1B-parameter Qwen3-MoE with ~150M active parameters
beside a dense Qwen3 of the same active size, and beside llama.cpp on the same MoE weights.

The MoE: hidden 1024, 12 layers, 16 heads / 4 KV heads of 64, 32 experts of 704 intermediate
features, top 4 (0.93B parameters, 0.17B active per token with the embedding and LM head); the
dense model: the same with one MLP of 4 x 704 = 2816 features (what a token's experts add up to).
Both are served in process through the real scheduler and model runner (an EngineCore on an
InProcExecutor): --input-len random prompt tokens, --output-len tokens each, greedy, ignore_eos.
Reported: c=1 TPOT (the median decode step with one sequence) and c=32 output tokens per second
(32 prompts at once, wall clock), the median of 3 rounds that alternate the two models, and the
MoE's ratios to the dense model's.

With --llama-server (llama.cpp's, as ../shared/tools/build-llama-server builds it), the MoE
checkpoint is also converted by llama.cpp's own convert_hf_to_gguf.py (float32 GGUF, with the
default model's tokenizer) and served by llama-server -t 2 -np 32 on the same token ids (needs
`sentencepiece` in this Python, as scripts/bench_models.py).

    python scripts/bench_moe.py [--dtype auto] [--out FILE.json] [--llama-server PATH]

The CPU's name and flags are printed first: every table must say which CPU it ran on.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_models  # noqa: E402
import torch  # noqa: E402

COMMON = {
    "vocab_size": 32000, "hidden_size": 1024, "num_attention_heads": 16,
    "num_key_value_heads": 4, "head_dim": 64, "num_hidden_layers": 12,
    "max_position_embeddings": 4096, "tie_word_embeddings": False, "initializer_range": 0.02,
}  # fmt: skip
EXPERTS, TOP_K, EXPERT_SIZE = 32, 4, 704
ROUNDS = 3


def make_checkpoint(kind: str, out_dir: Path, tokenizer_dir: Path | None) -> Path:
    import transformers

    kwargs = dict(COMMON)
    if tokenizer_dir is not None:
        kwargs["vocab_size"] = len(transformers.AutoTokenizer.from_pretrained(tokenizer_dir))
    if kind == "moe":
        config = transformers.Qwen3MoeConfig(
            **kwargs, intermediate_size=TOP_K * EXPERT_SIZE, num_experts=EXPERTS,
            num_experts_per_tok=TOP_K, moe_intermediate_size=EXPERT_SIZE, norm_topk_prob=True,
        )  # fmt: skip
        model_class = transformers.Qwen3MoeForCausalLM
    else:
        config = transformers.Qwen3Config(**kwargs, intermediate_size=TOP_K * EXPERT_SIZE)
        model_class = transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    model = model_class(config).to(torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    bench_models.copy_tokenizer(tokenizer_dir, out_dir)
    params = sum(p.numel() for p in model.parameters())
    del model
    print(f"{kind}: {params / 1e9:.2f}B parameters", flush=True)
    return out_dir


def bench(work: Path, args: argparse.Namespace, tokenizer_dir: Path | None) -> list[dict]:
    """Both models in one process, measured in alternation (ROUNDS times each, the median kept):
    this machine's step times drift by tens of percent over minutes."""
    dirs = {kind: make_checkpoint(kind, work / kind, tokenizer_dir) for kind in ("moe", "dense")}
    cores = {kind: bench_models.make_core(d, args.dtype) for kind, d in dirs.items()}
    rng = random.Random(0)
    vocab = json.loads((dirs["moe"] / "config.json").read_text())["vocab_size"]
    prompts = [[rng.randrange(3, vocab) for _ in range(args.input_len)] for _ in range(32)]
    measured = bench_models.alternate(cores, prompts, args.output_len, ROUNDS)
    results = [{"model": kind, **m} for kind, m in measured.items()]
    del cores
    if args.llama_server is not None:
        results[0].update(
            bench_models.bench_llamacpp(dirs["moe"], args.llama_server, prompts, args.output_len)
        )
    for r in results:
        print(json.dumps(r), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--llama-server", type=Path, default=None)
    args = parser.parse_args()
    cpu = bench_models.cpu_description()
    print(f"CPU: {cpu}", flush=True)
    tokenizer_dir = None
    if args.llama_server is not None:
        from frontend.model_prep import default_model_dir

        tokenizer_dir = Path(default_model_dir())
    with tempfile.TemporaryDirectory() as work:
        moe, dense = bench(Path(work), args, tokenizer_dir)
    print(
        f"\n| model | c=1 TPOT ms | c=32 tok/s |{' llama.cpp c=1 ms | llama.cpp c=32 tok/s |' if args.llama_server else ''}"
    )
    print(f"|---|---|---|{'---|---|' if args.llama_server else ''}")
    for r in (moe, dense):
        cells = bench_models._llamacpp_cells(r) if args.llama_server and r is moe else ""
        print(f"| {r['model']} | {r['tpot_ms']:.2f} | {r['c32_tok_s']:.0f} | {cells}")
    print(f"\nMoE / dense-active: TPOT {moe['tpot_ms'] / dense['tpot_ms']:.2f}x, "
          f"c=32 throughput {moe['c32_tok_s'] / dense['c32_tok_s']:.2f}x")  # fmt: skip
    if args.out is not None:
        args.out.write_text(
            json.dumps({"cpu": cpu, "dtype": args.dtype, "results": [moe, dense]}, indent=2)
        )


if __name__ == "__main__":
    main()

"""How closely an int8 KV cache (--kv-cache-dtype int8) follows the float one on a trained model.

The default model (SmolLM2-135M-Instruct, float32) serves 64 prompts of 1,000 to 1,189 tokens of
real text (the Python standard library's sources, a different file each), prefilled in chunks,
then --output-len greedy tokens each, through an in-process EngineCore with the int8 cache (and,
as the control, with the float cache). Hugging Face's float32 model, teacher-forced on each
prompt + output, is the reference: the share of output tokens that are its top-1 (greedy
agreement), the chosen tokens' mean |logprob difference|, and how close the reference's top two
were where they differ. tests/unit/test_kv_int8.py checks the same on a tiny random model, whose
near-ties are far more frequent than a trained model's.

    python scripts/bench_kv_agreement.py [--output-len 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402
import transformers  # noqa: E402
from bench_models import cpu_description  # noqa: E402

from enginecore.config import CacheConfig, Config, ModelConfig, SchedulerConfig  # noqa: E402
from enginecore.core import EngineCore  # noqa: E402
from enginecore.executor import InProcExecutor  # noqa: E402
from enginecore.messages import EngineCoreRequest, SamplingParams  # noqa: E402
from frontend.model_prep import default_model_dir  # noqa: E402

NUM_PROMPTS = 64


def text_prompts(tokenizer: transformers.PreTrainedTokenizerBase) -> list[list[int]]:
    """Prompt i: the first 1,000 + 3 i tokens of the i-th standard-library source file long
    enough (sorted by name, so every run reads the same files)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    prompts: list[list[int]] = []
    for file in files:
        n = 1000 + 3 * len(prompts)
        ids = tokenizer.encode(file.read_text(errors="replace"))
        if len(ids) >= n:
            prompts.append(ids[:n])
        if len(prompts) == NUM_PROMPTS:
            return prompts
    raise SystemExit(f"only {len(prompts)} standard-library files of 1,000+ tokens")


def serve(model_dir: Path, kv_cache_dtype: str, prompts: list[list[int]], n: int) -> dict:
    config = Config(
        model=ModelConfig(path=str(model_dir), dtype="float32"),
        cache=CacheConfig(block_size=16, kv_cache_memory_gib=4.0, kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512),
    )
    core = EngineCore(config, InProcExecutor(config))
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"p{i}", p, params))
    outs: dict[str, list[int]] = {f"p{i}": [] for i in range(len(prompts))}
    lps: dict[str, list[float]] = {f"p{i}": [] for i in range(len(prompts))}
    for _ in range(100_000):
        if not core.scheduler.has_requests:
            break
        for out in core.step():
            outs[out.request_id] += out.new_token_ids
            if out.new_logprobs is not None:
                lps[out.request_id] += out.new_logprobs.logprobs
    core.shutdown()
    return {"tokens": outs, "logprobs": lps}


def compare(hf: torch.nn.Module, prompts: list[list[int]], run: dict) -> dict:
    agree = total = 0
    gaps, diffs = [], []
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            out = run["tokens"][f"p{i}"]
            ids = torch.tensor([prompt + out])
            ref = hf(ids).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
            top2 = ref.topk(2, -1).values
            for pos, (a, b) in enumerate(zip(ref.argmax(-1).tolist(), out)):
                agree += a == b
                if a != b:
                    gaps.append(round(float(top2[pos, 0] - top2[pos, 1]), 4))
            total += len(out)
            chosen = ref.gather(1, torch.tensor(out)[:, None]).squeeze(1)
            diffs += (torch.tensor(run["logprobs"][f"p{i}"]) - chosen).abs().tolist()
    return {
        "agreement": agree / total,
        "agree": agree,
        "total": total,
        "logprob_mean_abs_diff": sum(diffs) / len(diffs),
        "reference_top2_gaps_where_different": sorted(gaps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the prepared default model")
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model_dir = Path(args.model or default_model_dir())
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    prompts = text_prompts(tokenizer)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = {"cpu": cpu_description(), "model": str(model_dir)}
    print(results["cpu"], flush=True)
    for kv in ("int8", "auto"):
        results[kv] = compare(hf, prompts, serve(model_dir, kv, prompts, args.output_len))
        r = results[kv]
        print(
            f"--kv-cache-dtype {kv}: greedy agreement {r['agree']}/{r['total']} = "
            f"{100 * r['agreement']:.2f}%, chosen-token logprob mean |diff| "
            f"{r['logprob_mean_abs_diff']:.5f}, reference top-2 gaps where different: "
            f"{r['reference_top2_gaps_where_different']}",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

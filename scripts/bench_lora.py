"""LoRA adapters' cost: tern serving four adapters mixed in one batch against the base model alone,
one adapter at one sequence against the base, and an adapter-only weight sync against a full one.

    python scripts/bench_lora.py [--model DIR] [--dtype auto|float32|bfloat16] [--rank 16]
                                 [--quantization int8] [--out FILE.json]

The model is the default one (SmolLM2-135M-Instruct, converted) unless --model says otherwise; the
four adapters are random PEFT LoRAs of --rank on q/k/v/o/gate/up/down, written by `peft`. Two
engines in process (the real scheduler and workers' code, as bench_models.py): one without LoRA,
one with --enable-lora and the adapters loaded. Measured, the engines alternating over 3 rounds
(this machine drifts by tens of percent over minutes), medians reported:
- c=1 TPOT (the median decode step of one sequence): the base model on the LoRA-less engine, and
  one adapter on the LoRA engine (target: <= 1.15x);
- c=32 output tokens/s (32 prompts at once, wall clock): all on the base model without LoRA, and
  spread over the 4 adapters, 8 each (target: >= 0.8x);
- sync: an adapter pushed as safetensors bytes (serialize + load on the workers: what
  /load_lora_adapter_from_tensors does) against the full weights pushed the same way
  (/update_weights: serialize, load, commit), median of 5, with their bytes.
The CPU's name and flags are printed first: every table must say which CPU it ran on.
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

import bench_models  # noqa: E402
from bench_models import run  # noqa: E402
from safetensors.torch import load_file, save  # noqa: E402

from enginecore.config import (  # noqa: E402
    CacheConfig,
    Config,
    LoraConfig,
    ModelConfig,
    SchedulerConfig,
)
from enginecore.control import EngineControl  # noqa: E402
from enginecore.core import EngineCore  # noqa: E402
from enginecore.executor import InProcExecutor  # noqa: E402
from enginecore.lora import adapter_spec  # noqa: E402
from enginecore.messages import (  # noqa: E402
    LoadLora,
    UpdateWeights,
    UpdateWeightsFromTensors,
)
from scripts.make_tiny_model import make_lora_adapter  # noqa: E402

ROUNDS = 3
NUM_ADAPTERS = 4


def make_core(
    model: Path, args: argparse.Namespace, adapters: dict[str, Path] | None
) -> EngineCore:
    lora = LoraConfig()
    if adapters is not None:
        lora = LoraConfig(
            enabled=True, max_loras=NUM_ADAPTERS, max_lora_rank=args.rank,
            modules=tuple((name, str(path)) for name, path in adapters.items()),
        )  # fmt: skip
    config = Config(
        model=ModelConfig(path=str(model), dtype=args.dtype, quantization=args.quantization),
        cache=CacheConfig(block_size=16, kv_cache_memory_gib=1.0),
        scheduler=SchedulerConfig(max_num_seqs=32),
        lora=lora,
    )
    return EngineCore(config, InProcExecutor(config))


def serving(args: argparse.Namespace, model: Path, adapters: dict[str, Path]) -> dict:
    rng = random.Random(0)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prompts = [[rng.randrange(3, vocab) for _ in range(args.input_len)] for _ in range(32)]
    names = list(adapters)
    mixed = [names[i % NUM_ADAPTERS] for i in range(32)]
    base, lora = make_core(model, args, None), make_core(model, args, adapters)
    cases = {  # name: (engine, c=1 adapter, c=32 adapters)
        "base": (base, [None], [None] * 32),
        "lora": (lora, [names[0]], mixed),
    }
    for core, one, _ in cases.values():
        run(core, prompts[:1], 8, "warm", one)
    tpots: dict[str, list[float]] = {k: [] for k in cases}
    rates: dict[str, list[float]] = {k: [] for k in cases}
    for r in range(ROUNDS):
        for name, (core, one, many) in cases.items():
            tpots[name].append(run(core, prompts[:1], args.output_len, f"{name}1-{r}-", one)[0])
            rates[name].append(run(core, prompts, args.output_len, f"{name}N-{r}-", many)[1])
    kernels = lora.executor.runner.kernel_report()
    return {
        "kernels": kernels,
        "tpot_ms": {k: statistics.median(v) * 1e3 for k, v in tpots.items()},
        "c32_tok_s": {k: statistics.median(v) for k, v in rates.items()},
        "tpot_ms_rounds": {k: [t * 1e3 for t in v] for k, v in tpots.items()},
        "c32_tok_s_rounds": rates,
    }


def sync(args: argparse.Namespace, model: Path, adapters: dict[str, Path]) -> dict:
    core = make_core(model, args, {})
    control = EngineControl(core)
    assert core.loras is not None
    adapter = next(iter(adapters.values()))
    tensors = load_file(adapter / "adapter_model.safetensors")
    rank, scaling = adapter_spec(json.loads((adapter / "adapter_config.json").read_text()))
    weights = {}
    for file in sorted(model.glob("*.safetensors")):
        weights.update(load_file(file))
    adapter_s, full_s = [], []
    for i in range(5):
        start = time.perf_counter()
        source = LoadLora(-1, rank, scaling, blobs=[save(tensors)])
        core.loras.load("policy", source, f"v{i}", ())
        adapter_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        result = control.handle(
            i, UpdateWeights(UpdateWeightsFromTensors(blobs=[save(weights)])), []
        )
        assert result is not None and result.error is None, result
        full_s.append(time.perf_counter() - start)
    return {
        "adapter_bytes": sum(t.nbytes for t in tensors.values()),
        "full_bytes": sum(t.nbytes for t in weights.values()),
        "adapter_sync_s": statistics.median(adapter_s),
        "full_sync_s": statistics.median(full_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    cpu = bench_models.cpu_description()
    print(f"CPU: {cpu}", flush=True)
    if args.model is None:
        from frontend.model_prep import default_model_dir

        args.model = Path(default_model_dir())
    with tempfile.TemporaryDirectory() as work:
        adapters = {
            f"a{i}": make_lora_adapter(
                args.model, Path(work) / f"a{i}", rank=args.rank, seed=i, scale=0.05
            )  # fmt: skip
            for i in range(NUM_ADAPTERS)
        }
        result = {"cpu": cpu, "args": {k: str(v) for k, v in vars(args).items()}}
        result["serving"] = serving(args, args.model, adapters)
        result["sync"] = sync(args, args.model, adapters)
    s, y = result["serving"], result["sync"]
    print(f"kernels: {s['kernels']}")
    print("| | base | LoRA | ratio | target |\n|---|---|---|---|---|")
    t, c = s["tpot_ms"], s["c32_tok_s"]
    print(f"| c=1 TPOT ms (1 adapter) | {t['base']:.2f} | {t['lora']:.2f} | "
          f"{t['lora'] / t['base']:.2f}x | <= 1.15x |")  # fmt: skip
    print(f"| c=32 tok/s (4 adapters mixed) | {c['base']:.0f} | {c['lora']:.0f} | "
          f"{c['lora'] / c['base']:.2f}x | >= 0.8x |")  # fmt: skip
    print(f"| sync s (bytes) | full {y['full_sync_s']:.3f} ({y['full_bytes'] / 1e6:.1f} MB) | "
          f"adapter {y['adapter_sync_s']:.3f} ({y['adapter_bytes'] / 1e6:.2f} MB) | "
          f"{y['full_sync_s'] / y['adapter_sync_s']:.0f}x faster | |")  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

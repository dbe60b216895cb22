"""Decode speed of every family tern serves, beside the Llama of the same size.

For each family a random checkpoint of about 100M parameters (hidden 768, 12 layers, 12 heads / 4
KV heads, intermediate 2048, vocabulary 32000) is made from transformers' own config class with the
family's features on (the tiny test checkpoints' settings of scripts/make_tiny_model.py: windows,
softcapping, NoPE layers, multipliers, linear attention ...; sliding windows of 64 tokens, shorter
than the context, so they bite), and served in process through the real scheduler and model runner
(an EngineCore on an InProcExecutor): --input-len random prompt tokens, --output-len tokens each,
greedy, ignore_eos. Reported per family: c=1 TPOT (the median decode step with one sequence) and
c=32 output tokens per second (32 prompts at once, wall clock), each as a ratio to Llama's.

With --llama-server (llama.cpp's, as ../shared/tools/build-llama-server builds it), each checkpoint
is also converted by llama.cpp's own convert_hf_to_gguf.py (float32 GGUF; the source tree the
server was built from) and served by llama-server -t 2 -np 32 on the same token ids: its c=1
TPOT (the server's predicted_per_token_ms) and c=32 tok/s beside tern's; a family its converter
does not take is reported with the converter's reason. The checkpoints then carry the default
model's tokenizer (the converter reads one), and the vocabulary is the tokenizer's. The converter
needs `sentencepiece` in this Python (pip install sentencepiece; not one of tern's dependencies).

    python scripts/bench_models.py [--families llama gemma3 ...] [--dtype auto] [--out FILE.json]
        [--llama-server PATH]

The CPU's name and flags are printed first: every table must say which CPU it ran on.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import make_tiny_model as tiny  # noqa: E402
import torch  # noqa: E402

from enginecore.config import CacheConfig, Config, ModelConfig, SchedulerConfig  # noqa: E402
from enginecore.core import EngineCore  # noqa: E402
from enginecore.executor import InProcExecutor  # noqa: E402
from enginecore.messages import EngineCoreRequest, SamplingParams  # noqa: E402

SIZE = {
    "vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048,
    "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64,
    "num_hidden_layers": 12, "max_position_embeddings": 4096,
}  # fmt: skip
WINDOW = 64


def family_config(arch: str) -> dict:
    """The tiny checkpoint's features at the benchmark's size (layer lists stretched to 12)."""
    kwargs = {**tiny._config_kwargs(arch, SIZE["vocab_size"]), **SIZE, "initializer_range": 0.02}
    n = SIZE["num_hidden_layers"]
    for key in ("layer_types", "no_rope_layers"):
        if key in kwargs:
            pattern = kwargs[key]
            kwargs[key] = [pattern[i % len(pattern)] for i in range(n)]
    if "sliding_window" in kwargs:
        kwargs["sliding_window"] = WINDOW
    if arch == "gemma2" or arch == "gemma3":
        kwargs["query_pre_attn_scalar"] = SIZE["head_dim"]
    if arch == "qwen3_5":  # 4 key / 8 value heads of 64: about the attention layers' width
        kwargs.update(linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                      linear_value_head_dim=64)  # fmt: skip
    if arch == "phi3":  # its factors cover the rotated half of a 64-dim head
        rope = dict(kwargs["rope_parameters"])
        rope["short_factor"] = [1.0 + 0.05 * i for i in range(24)]
        rope["long_factor"] = [2.0 + 0.5 * i for i in range(24)]
        kwargs["rope_parameters"] = rope
    return kwargs


def make_checkpoint(arch: str, out_dir: Path, tokenizer_dir: Path | None = None) -> Path:
    """The family's random checkpoint; with `tokenizer_dir`, beside that tokenizer (and its
    vocabulary size)."""
    import transformers

    family = tiny._FAMILIES[arch]
    config_class = {"gemma3": transformers.Gemma3TextConfig,
                    "qwen3_5": transformers.Qwen3_5TextConfig}.get(arch) or getattr(
        transformers, f"{family}Config")  # fmt: skip
    model_class = getattr(transformers, f"{family}ForCausalLM")
    kwargs = family_config(arch)
    if tokenizer_dir is not None:
        kwargs["vocab_size"] = len(transformers.AutoTokenizer.from_pretrained(tokenizer_dir))
    torch.manual_seed(0)
    model = model_class(config_class(**kwargs)).to(torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    copy_tokenizer(tokenizer_dir, out_dir)
    return out_dir


def copy_tokenizer(tokenizer_dir: Path | None, out_dir: Path) -> None:
    """The tokenizer files llama.cpp's converter reads, beside a benchmark checkpoint."""
    if tokenizer_dir is not None:
        for f in tokenizer_dir.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
                shutil.copy(f, out_dir / f.name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def bench_llamacpp(
    model_dir: Path, server: Path, prompts: list[list[int]], output_len: int
) -> dict:
    """llama.cpp on the same checkpoint: convert, serve, c=1 TPOT (the median of 3 requests) and
    c=32 tok/s (or the converter's or server's reason it could not)."""
    src = server.resolve().parents[2]  # src/build/bin/llama-server
    gguf = model_dir / "model-f32.gguf"
    env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
    conv = subprocess.run(
        [sys.executable, str(src / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", "f32",
         "--outfile", str(gguf)],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    if conv.returncode != 0:
        lines = [ln for ln in conv.stderr.strip().splitlines() if ln.strip()]
        return {"llamacpp_error": "converter: " + (lines[-1] if lines else "failed")[:200]}
    return serve_llamacpp(gguf, server, prompts, output_len)


def launch_llamacpp(gguf: Path, server: Path) -> tuple[subprocess.Popen, str]:
    """llama-server on a GGUF file (-t 2 -np 32), healthy: (process, base URL); RuntimeError with
    the server's reason when it could not start."""
    port = _free_port()
    # A file, not a pipe: a long run's request log would fill a pipe nobody reads and stall it.
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(
        [str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", "2",
         "-tb", "2", "-np", "32", "-c", str(32 * 512)],
        stdout=subprocess.DEVNULL, stderr=log, text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            log.seek(0)
            last = log.read().strip().splitlines()[-1:] or ["exited"]
            raise RuntimeError("llama-server: " + last[0][:200])
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, base
        except OSError:
            time.sleep(0.5)
    stop_llamacpp(proc)
    raise RuntimeError("llama-server did not become healthy")


def stop_llamacpp(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def serve_llamacpp(gguf: Path, server: Path, prompts: list[list[int]], output_len: int) -> dict:
    """llama-server on a GGUF file: c=1 TPOT (the median of 3 requests) and c=len(prompts) tok/s,
    or the server's reason it could not."""
    try:
        proc, base = launch_llamacpp(gguf, server)
    except RuntimeError as e:
        return {"llamacpp_error": str(e)}
    try:

        def complete(prompt: list[int]) -> dict:
            body = {"prompt": prompt, "n_predict": output_len, "temperature": 0.0,
                    "ignore_eos": True, "cache_prompt": False}  # fmt: skip
            return _post(base + "/completion", body)

        complete(prompts[0][:16])  # warm-up
        # The median of 3, as this machine's step times drift.
        tpot = statistics.median(
            complete(prompts[i])["timings"]["predicted_per_token_ms"] for i in range(3)
        )
        start = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(complete, prompts))
        wall = time.perf_counter() - start
        produced = sum(o["timings"]["predicted_n"] for o in outs)
        return {"llamacpp_tpot_ms": tpot, "llamacpp_c32_tok_s": produced / wall}
    finally:
        stop_llamacpp(proc)


def run(
    core: EngineCore,
    prompts: list[list[int]],
    output_len: int,
    tag: str,
    loras: list[str | None] | None = None,
) -> tuple[float, float]:
    """-> (median seconds of a decode-only step, output tokens per second over the whole run);
    `loras`: each prompt's LoRA adapter."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, (p, lora) in enumerate(zip(prompts, loras or [None] * len(prompts))):
        req = EngineCoreRequest(f"{tag}{i}", p, params, lora_name=lora)
        assert core.add_request(req) == []
    decode_steps, produced = [], 0
    start = time.perf_counter()
    while core.scheduler.has_requests:
        decoding = not core.scheduler.waiting and all(
            r.num_computed_tokens >= len(r.prompt_token_ids) for r in core.scheduler.running
        )
        t0 = time.perf_counter()
        outs = core.step()
        if decoding and core.scheduler.running:
            decode_steps.append(time.perf_counter() - t0)
        produced += sum(len(o.new_token_ids) for o in outs)
    wall = time.perf_counter() - start
    return statistics.median(decode_steps), produced / wall


def alternate(
    cores: dict[str, EngineCore], prompts: list[list[int]], output_len: int, rounds: int
) -> dict[str, dict]:
    """Each core's c=1 TPOT and c=len(prompts) throughput, the cores measured in alternation over
    `rounds` (this machine's step times drift by tens of percent over minutes): per core the
    medians and every round."""
    for core in cores.values():
        run(core, prompts[:1], 8, "warm")
    tpots: dict[str, list[float]] = {name: [] for name in cores}
    rates: dict[str, list[float]] = {name: [] for name in cores}
    for r in range(rounds):
        for name, core in cores.items():
            tpots[name].append(run(core, prompts[:1], output_len, f"{name}-c1-{r}-")[0])
            rates[name].append(run(core, prompts, output_len, f"{name}-cN-{r}-")[1])
    return {
        name: {"tpot_ms": statistics.median(tpots[name]) * 1e3,
               "c32_tok_s": statistics.median(rates[name]),
               "tpot_ms_rounds": [t * 1e3 for t in tpots[name]], "c32_tok_s_rounds": rates[name]}
        for name in cores
    }  # fmt: skip


def bench(arch: str, work: Path, args: argparse.Namespace) -> dict:
    tokenizer_dir = None
    if args.llama_server is not None:
        from frontend.model_prep import default_model_dir

        tokenizer_dir = Path(default_model_dir())
    model_dir = make_checkpoint(arch, work / arch, tokenizer_dir)
    core = make_core(model_dir, args.dtype)
    rng = random.Random(0)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = [[rng.randrange(3, vocab) for _ in range(args.input_len)]
               for _ in range(32)]  # fmt: skip
    run(core, prompts[:1], 8, "warm")
    tpot, _ = run(core, prompts[:1], args.output_len, "c1-")
    _, throughput = run(core, prompts, args.output_len, "c32-")
    report = core.executor.runner.kernel_report()
    result = {"family": arch, "tpot_ms": tpot * 1e3, "c32_tok_s": throughput, "kernels": report}
    del core  # its memory, before llama-server loads the same model
    if args.llama_server is not None:
        result.update(bench_llamacpp(model_dir, args.llama_server, prompts, args.output_len))
    return result


def make_core(model_dir: Path, dtype: str, quantization: str | None = None) -> EngineCore:
    """The engine of a benchmark: 32 sequences at once in 1 GiB of KV cache."""
    config = Config(
        model=ModelConfig(path=str(model_dir), dtype=dtype, quantization=quantization),
        cache=CacheConfig(block_size=16, kv_cache_memory_gib=1.0),
        scheduler=SchedulerConfig(max_num_seqs=32),
    )
    return EngineCore(config, InProcExecutor(config))


def cpu_description() -> str:
    text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next(
        (ln.split(":", 1)[1].strip() for ln in text.splitlines() if "Model name" in ln), "?"
    )
    flags = next(
        (ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("Flags")), []
    )
    simd = sorted(f for f in flags if f.startswith(("avx", "amx")))
    return f"{name}, {torch.get_num_threads()} threads, flags: {' '.join(simd)}"


def _llamacpp_cells(r: dict) -> str:
    if "llamacpp_tpot_ms" in r:
        return f"{r['llamacpp_tpot_ms']:.2f} | {r['llamacpp_c32_tok_s']:.0f}"
    return f"{r.get('llamacpp_error', '')} | " if "llamacpp_error" in r else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    dense = [a for a in tiny._FAMILIES if a not in tiny.MOE_ARCHS]  # MoE: scripts/bench_moe.py
    parser.add_argument("--families", nargs="+", default=dense)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--llama-server", type=Path, default=None)
    args = parser.parse_args()
    families = ["llama", *[f for f in args.families if f != "llama"]]
    print(f"CPU: {cpu_description()}", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in families:
            results.append(bench(arch, Path(tmp), args))
            r = results[-1]
            print(f"{arch:10s} TPOT {r['tpot_ms']:7.2f} ms   c=32 {r['c32_tok_s']:7.1f} tok/s   "
                  f"{r['kernels'].split(', fused decode layer: ')[-1]}   "
                  f"{_llamacpp_cells(r)}", flush=True)  # fmt: skip
    base = results[0]
    print(
        "\n| family | c=1 TPOT ms | vs Llama | c=32 tok/s | vs Llama | fused decode layer |"
        + (" llama.cpp c=1 TPOT ms | llama.cpp c=32 tok/s |" if args.llama_server else "")
    )
    print("|---|---|---|---|---|---|" + ("---|---|" if args.llama_server else ""))
    for r in results:
        fused = r["kernels"].split(", fused decode layer: ")[-1]
        print(f"| {r['family']} | {r['tpot_ms']:.2f} | {r['tpot_ms'] / base['tpot_ms']:.2f}x | "
              f"{r['c32_tok_s']:.0f} | {r['c32_tok_s'] / base['c32_tok_s']:.2f}x | {fused} |"
              + (f" {_llamacpp_cells(r)} |" if args.llama_server else ""))  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"cpu": cpu_description(), "results": results}, indent=2))


if __name__ == "__main__":
    main()

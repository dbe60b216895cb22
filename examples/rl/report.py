"""What a run leaves behind: one printed line per step, the JSON log, the plot, and the machine
it ran on (CPU model and the ISA flags tern's kernels choose between, load average); what each
push sent (the full weights, or a LoRA adapter) and took."""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
from pathlib import Path
from typing import Any

import torch

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")


def machine_info() -> dict[str, Any]:
    model, flags = platform.processor(), set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    return {
        "cpu": model,
        "num_cpus": os.cpu_count(),
        "isa": {flag: flag in flags for flag in ISA_FLAGS},
        "torch": torch.__version__,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }


def format_step(s: dict[str, Any]) -> str:
    line = (
        f"step {s['step']:3d} | reward {s['reward']:.3f} exact {s['exact']:.2f}"
        f" | {s['mean_completion_tokens']:4.1f} tok/sample"
        f" | rollout {s['rollout_s']:5.1f} s {s['rollout_tok_s']:6.1f} tok/s"
    )
    if "train_s" in s:
        line += f" | train {s['train_s']:5.1f} s | update {s['update_s']:5.2f} s"
        line += f" {format_bytes(s['update_bytes'])}"
    if "sleep_s" in s:
        line += f" | sleep {s['sleep_s']:.2f} s wake {s['wake_s']:.2f} s"
    if "mismatch" in s:
        line += f" | mismatch {s['mismatch']:.2e} (max {s['mismatch_max']:.1e})"
    if "ratio_mean" in s:
        line += f" | ratio {s['ratio_mean']:.4f} clip {s['clip_frac']:.3f}"
    return line + f" | load {s['load_avg']:.1f}"


def format_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def push_summary(steps: list[dict[str, Any]], full_weight_bytes: int) -> str:
    """The median push's bytes and seconds, beside the full weights' bytes when it sent less."""
    pushes = [s for s in steps if "update_s" in s]
    if not pushes:
        return "no push"
    num_bytes = statistics.median(s["update_bytes"] for s in pushes)
    text = (f"push {format_bytes(num_bytes)} in "
            f"{statistics.median(s['update_s'] for s in pushes):.2f} s (median)")  # fmt: skip
    if num_bytes < full_weight_bytes:
        text += f", the full weights {format_bytes(full_weight_bytes)}"
    return text


def write_log(path: Path, log: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(log, indent=1))


def plot(path: Path, steps: list[dict[str, Any]], title: str, subtitle: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [s["step"] for s in steps]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(x, [s["reward"] for s in steps], "o-", label="mean reward 2^-|words - n|")
    top.plot(x, [s["exact"] for s in steps], "s--", label="exactly n words")
    if len(steps) >= 5:  # one step's 32-odd samples are noisy: show the trend too
        rewards = [s["reward"] for s in steps]
        mean5 = [sum(rewards[max(0, i - 4) : i + 1]) / len(rewards[max(0, i - 4) : i + 1])
                 for i in range(len(rewards))]  # fmt: skip
        top.plot(x, mean5, "-", color="black", alpha=0.6, label="reward, mean of 5 steps")
    top.set_ylim(0, 1)
    top.set_ylabel("reward (rollouts at T=1)")
    top.legend(loc="upper left")
    top.set_title(f"{title}\n{subtitle}" if subtitle else title, fontsize="medium")
    trained = [s for s in steps if math.isfinite(s.get("mismatch", math.nan))]
    bottom.semilogy([s["step"] for s in trained], [s["mismatch"] for s in trained], "o-",
                    label="mean |logprob tern - logprob trainer|")  # fmt: skip
    bottom.semilogy([s["step"] for s in trained], [s["mismatch_max"] for s in trained], "^:",
                    label="max over the step's tokens")  # fmt: skip
    bottom.set_xlabel("step")
    bottom.set_ylabel("training-inference mismatch (nats)")
    bottom.legend(loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)

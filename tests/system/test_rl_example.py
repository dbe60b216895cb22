"""examples/rl/grpo.py in its short (CI) mode on the tiny Llama: the script launches tern, runs two
GRPO steps, pushes weights, and stops every process it started.

Two runs cover both weight-sync paths and colocation: a broadcast from the trainer's process group
(tern awake, --batch-invariant), and /dev/shm files with tern asleep (level 2) while the trainer
steps. A third trains
a LoRA adapter (--lora 8) and pushes only it, over the same broadcast.
"""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 180.0


def run_example(args: list[str]) -> tuple[subprocess.CompletedProcess, dict[int, psutil.Process]]:
    """Runs the example, watching the processes under it (to check later that none survived)."""
    cmd = [sys.executable, str(ROOT / "examples/rl/grpo.py"), *args]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + TIMEOUT_S
    while proc.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(proc.pid).children(recursive=True):
                seen.setdefault(p.pid, p)
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
    out, _ = proc.communicate(timeout=30)
    return subprocess.CompletedProcess(cmd, proc.returncode, out), seen


def alive(processes: list[psutil.Process], timeout: float = 10.0) -> list[psutil.Process]:
    """The processes still running after `timeout` s (zombies count as dead: PID 1 may be slow
    to reap orphans)."""

    def is_alive(p: psutil.Process) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    deadline = time.monotonic() + timeout
    while any(map(is_alive, processes)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in processes if is_alive(p)]


def run_short(model: Path, out_dir: Path, args: list[str]) -> dict:
    """The example's short mode on `model`; its log, once every process it started has ended."""
    args = ["--short", "--model", str(model), "--dtype", "float32", "--out-dir", str(out_dir),
            *args]  # fmt: skip
    result, seen = run_example(args)
    try:
        assert result.returncode == 0, result.stdout[-4000:]
        log = json.loads((out_dir / "log.json").read_text())
        assert (out_dir / "rl.png").stat().st_size > 0
    finally:
        survivors = alive(list(seen.values()))
        for p in survivors:
            with contextlib.suppress(psutil.Error):
                p.kill()
    assert not survivors, f"processes outlived the example: {survivors}"
    assert set(log["server_pids"]) <= set(seen)  # the watch above covered tern's processes
    return log


def check_steps(steps: list[dict], timings: list[str]) -> None:
    assert [s["step"] for s in steps] == [0, 1, 2]  # 2 training steps, then the final rollout
    for s in steps:
        assert 0.0 <= s["reward"] <= 1.0 and 0.0 <= s["exact"] <= 1.0
        assert math.isfinite(s["rollout_tok_s"]) and s["rollout_tok_s"] > 0
    for s in steps[:-1]:
        for key in timings:
            assert math.isfinite(s[key]) and s[key] > 0, (key, s)
        # float32 on both sides: only summation order separates tern's logprobs and the trainer's
        assert math.isfinite(s["mismatch"]) and s["mismatch"] < 1e-3, s
        assert s["num_learning_samples"] > 0 and abs(s["ratio_mean"] - 1) < 1e-3, s


@pytest.mark.parametrize(
    "mode",
    [["--weight-sync", "distributed", "--batch-invariant"], ["--weight-sync", "shm", "--colocate"]],
    ids=["distributed-batch-invariant", "shm-colocate"],
)  # fmt: skip
def test_grpo_example_short(tiny_llama_with_tokenizer: Path, tmp_path: Path, mode: list[str]):
    log = run_short(tiny_llama_with_tokenizer, tmp_path, ["--lr", "1e-3", *mode])
    steps = log["steps"]
    check_steps(
        steps, ["train_s", "update_s"] + (["sleep_s", "wake_s"] if "--colocate" in mode else [])
    )
    # Each step pushed its weights, and tern served them: versions moved, greedy output moved.
    assert [s["weight_version"] for s in steps[1:]] == ["step-1", "step-2"]
    assert log["weight_version_end"] == "step-2" != log["weight_version_start"]
    assert all(s["update_bytes"] == log["full_weight_bytes"] for s in steps[:-1])
    assert log["greedy_after"] != log["greedy_before"]


def adapter_bytes(model: Path, rank: int) -> int:
    """A float32 LoRA of `rank` on every projection of a Llama: rank x (in + out) per projection."""
    c = json.loads((model / "config.json").read_text())
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    head_dim = c.get("head_dim") or hidden // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    in_out = [(hidden, q), (hidden, kv), (hidden, kv), (q, hidden),
              (hidden, inter), (hidden, inter), (inter, hidden)]  # fmt: skip
    return 4 * rank * sum(i + o for i, o in in_out) * c["num_hidden_layers"]


def test_grpo_example_short_lora(tiny_llama_with_tokenizer: Path, tmp_path: Path):
    """--lora 8: tern serves the adapter as model "policy"; each step pushes the adapter alone
    (its version step-k), and the base weights never move."""
    # lr 1e-2: one step moves the tiny model's logprobs by nats, so check_steps's mismatch bound
    # at step 1 holds only if the trainer's forward runs the adapter as tern does.
    log = run_short(tiny_llama_with_tokenizer, tmp_path, ["--lora", "8", "--lr", "1e-2"])
    steps = log["steps"]
    check_steps(steps, ["train_s", "update_s"])
    # On-policy: step k sampled with the adapter of step k (the example asserts it as it goes).
    assert [s["lora_version"] for s in steps] == ["step-0", "step-1", "step-2"]
    base = log["weight_version_start"]
    assert log["weight_version_end"] == base and {s["weight_version"] for s in steps} == {base}
    # Each push sent the adapter's tensors, a small part of the full weights.
    expected = adapter_bytes(tiny_llama_with_tokenizer, 8)
    assert log["adapter_bytes"] == expected and log["initial_push"]["update_bytes"] == expected
    assert all(s["update_bytes"] == expected for s in steps[:-1])
    assert 50 * expected < log["full_weight_bytes"]
    # The adapter tern served moved the policy's greedy outputs (B = 0 at step 0: the base's).
    assert log["greedy_after"] != log["greedy_before"]

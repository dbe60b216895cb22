"""examples/rl/grpo.py in its short (CI) mode on the tiny Llama: the script launches tern, runs two
GRPO steps, pushes weights, and stops every process it started.

Two runs cover both weight-sync paths and colocation: a broadcast from the trainer's process group
(tern awake), and /dev/shm files with tern asleep (level 2) while the trainer steps.
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


@pytest.mark.parametrize(
    "mode", [["--weight-sync", "distributed"], ["--weight-sync", "shm", "--colocate"]],
    ids=["distributed", "shm-colocate"],
)  # fmt: skip
def test_grpo_example_short(tiny_llama_with_tokenizer: Path, tmp_path: Path, mode: list[str]):
    args = ["--short", "--model", str(tiny_llama_with_tokenizer), "--dtype", "float32",
            "--lr", "1e-3", "--out-dir", str(tmp_path), *mode]  # fmt: skip
    result, seen = run_example(args)
    try:
        assert result.returncode == 0, result.stdout[-4000:]
        log = json.loads((tmp_path / "log.json").read_text())
        assert (tmp_path / "rl.png").stat().st_size > 0
    finally:
        survivors = alive(list(seen.values()))
        for p in survivors:
            with contextlib.suppress(psutil.Error):
                p.kill()
    assert not survivors, f"processes outlived the example: {survivors}"
    assert set(log["server_pids"]) <= set(seen)  # the watch above covered tern's processes

    steps = log["steps"]
    assert [s["step"] for s in steps] == [0, 1, 2]  # 2 training steps, then the final rollout
    for s in steps:
        assert 0.0 <= s["reward"] <= 1.0 and 0.0 <= s["exact"] <= 1.0
        assert math.isfinite(s["rollout_tok_s"]) and s["rollout_tok_s"] > 0
    timings = ["train_s", "update_s"] + (["sleep_s", "wake_s"] if "--colocate" in mode else [])
    for s in steps[:-1]:
        for key in timings:
            assert math.isfinite(s[key]) and s[key] > 0, (key, s)
        # float32 on both sides: only summation order separates tern's logprobs and the trainer's
        assert math.isfinite(s["mismatch"]) and s["mismatch"] < 1e-3, s
        assert s["num_learning_samples"] > 0 and abs(s["ratio_mean"] - 1) < 1e-3, s
    # Each step pushed its weights, and tern served them: versions moved, greedy output moved.
    assert [s["weight_version"] for s in steps[1:]] == ["step-1", "step-2"]
    assert log["weight_version_end"] == "step-2" != log["weight_version_start"]
    assert log["greedy_after"] != log["greedy_before"]

"""A non-editable install (`pip install .`) ships the kernels' C sources, and an installed copy
builds and loads them (into an empty TERN_HOME) away from the source tree."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import workers.kernels.kernel_library as kl, workers.kernels.linear_ops as linear_ops, torch
assert kl.__file__.startswith(TARGET), kl.__file__
assert kl.load() is not None, "kernels did not build"
x, w = torch.randn(3, 64), torch.randn(32, 64)
torch.testing.assert_close(linear_ops.f32_linear(x, w, None), x @ w.T, atol=1e-4, rtol=1e-4)
print("tier", kl.active_tier_name())
"""


def test_non_editable_install_builds_its_kernels(tmp_path: Path) -> None:
    target, home, src = tmp_path / "site", tmp_path / "tern_home", tmp_path / "src"
    # NOTE: from a copy: setuptools writes build/ and *.egg-info next to the sources it builds.
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in ("frontend", "enginecore", "workers"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    build = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-q",
         "--target", str(target), str(src)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr
    shipped = {p.name for p in (target / "workers/kernels/csrc").iterdir()}
    assert {"tern_kernels.h", "simd.h", "attention.c", "decode_layer.c"} <= shipped
    env = {**os.environ, "PYTHONPATH": str(target), "TERN_HOME": str(home)}
    run = subprocess.run(
        [sys.executable, "-c", f"TARGET = {str(target)!r}\n" + CHECK],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "tier" in run.stdout and list((home / "kernels").glob("tern_*.so"))

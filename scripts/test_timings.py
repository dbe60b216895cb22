"""Writes tests/timings/<cpu tier><suffix>.txt from the JSON files scripts/test's pytest runs wrote
(tests/conftest.py): the wall time of each run and of the whole, each lane's test count and summed
time, and the 40 slowest tests. A whole run (no suffix) also writes tests/timings/<cpu tier>.json:
every test's call time, from which `scripts/test --fast` leaves out the slow ones.
Usage: test_timings.py DIR WALL_SECONDS UNIT_WORKERS SUFFIX"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SLOWEST = 40


def cpu_tier() -> str:
    """amx, avx512bf16, avx512, avx2 or other: the best of lscpu's flags (as the kernels' tiers)."""
    try:
        flags = set(subprocess.run(["lscpu"], capture_output=True, text=True).stdout.split())
    except OSError:
        flags = set()
    for tier, flag in (("amx", "amx_tile"), ("avx512bf16", "avx512_bf16"), ("avx512", "avx512f")):
        if flag in flags:
            return tier
    return "avx2" if "avx2" in flags else "other"


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _workers(tests: dict[str, dict]) -> str:
    """Each xdist worker's summed test time and when its last test ended (s into the run)."""
    busy: dict[str, list[float]] = {}
    for t in tests.values():
        if t.get("worker"):
            entry = busy.setdefault(t["worker"], [0.0, 0.0])
            entry[0] += t["seconds"]
            entry[1] = max(entry[1], t.get("ended_s", 0.0))
    parts = [f"{w} busy {b:.0f} s, done at {end:.0f} s" for w, (b, end) in sorted(busy.items())]
    return f" ({'; '.join(parts)})" if parts else ""


def main(folder: str, wall: str, workers: str, suffix: str) -> None:
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(Path(folder).glob("*.json"))}
    tests = {nodeid: t for run in runs.values() for nodeid, t in run["tests"].items()}
    lanes: dict[str, list[float]] = {}
    for t in tests.values():
        lanes.setdefault(t["lane"], []).append(t["seconds"])
    lines = [
        f"# scripts/test{' --fast' if suffix else ''} on {cpu_name()} ({cpu_tier()}),"
        f" {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"total wall time: {int(wall)} s (setup_env included)",
        *(
            f"run {name}: {run['wall_seconds']:.0f} s wall{_workers(run['tests'])}"
            for name, run in runs.items()
        ),
        f"unit and server lanes workers (pytest-xdist): {workers}",
        "",
        "lane        tests   summed s  (setup + call + teardown of each test)",
        *(f"{lane:<10} {len(s):>6} {sum(s):>10.1f}" for lane, s in sorted(lanes.items())),
        "",
        f"the {SLOWEST} slowest tests (s, lane, outcome if not passed):",
    ]
    slowest = sorted(tests.items(), key=lambda kv: -kv[1]["seconds"])[:SLOWEST]
    for nodeid, t in slowest:
        outcome = "" if t["outcome"] == "passed" else f"  {t['outcome']}"
        lines.append(f"{t['seconds']:8.1f}  {t['lane']:<9} {nodeid}{outcome}")
    out = ROOT / "tests" / "timings" / f"{cpu_tier()}{suffix}.txt"
    out.parent.mkdir(exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"scripts/test: timings in {out.relative_to(ROOT)}")
    if not suffix:
        calls = {
            nodeid: round(t.get("call", t["seconds"]), 2) for nodeid, t in sorted(tests.items())
        }
        out.with_suffix(".json").write_text(json.dumps(calls, indent=0) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:5])

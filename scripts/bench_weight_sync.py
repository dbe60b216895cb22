#!/usr/bin/env python
"""Times every weight-update path and sleep/wake-up against a tern server it launches.

    .venv/bin/python scripts/bench_weight_sync.py [--model DIR] [--tp N] [--repeats 3]

Reports seconds per full update and MB/s for: disk, tensors over HTTP (base64 safetensors),
tensors through /dev/shm, and a trainer process group (this process is trainer rank 0); then the
latency of sleep level 1 and 2 and of waking, and how much worker RSS each sleep freed.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from frontend.client.trainer import TrainerClient  # noqa: E402
from frontend.model_prep import default_model_dir  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workers_rss(base_url: str) -> int:
    pid = httpx.get(f"{base_url}/server_info", timeout=30).json()["engine"]["engine_core_pid"]
    procs = psutil.Process(pid).children()
    return sum(
        p.memory_info().rss for p in procs if "resource_tracker" not in " ".join(p.cmdline())
    )


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = Path(args.model or default_model_dir())
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "frontend", "launch", "--model", str(model), "--port", str(port),
           "--dtype", "float32", "--tp", str(args.tp)]  # fmt: skip
    server = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        client = TrainerClient(base_url)
        sd = load_file(next(model.glob("*.safetensors")))
        mb = sum(t.numel() * t.element_size() for t in sd.values()) / 1e6
        rows = []
        for label, fn in [
            ("disk", lambda: client.update_weights_from_disk(str(model))),
            ("tensors, base64 safetensors", lambda: client.update_weights_from_tensors(sd)),
            ("tensors, /dev/shm", lambda: client.update_weights_from_tensors(sd, "shm")),
        ]:
            s = timed(fn, args.repeats)
            rows.append((label, s, mb / s))
        client.init_weights_update_group("127.0.0.1", free_port(), tern_world_size=args.tp)
        s = timed(lambda: client.update_weights_from_distributed(sd), args.repeats)
        rows.append(("process group broadcast (gloo)", s, mb / s))
        client.destroy_weights_update_group()
        print(f"model {model.name}: {mb:.0f} MB of weights (float32), tp {args.tp}")
        print(f"{'path':34} {'s/update':>9} {'MB/s':>8}")
        for label, s, rate in rows:
            print(f"{label:34} {s:9.2f} {rate:8.0f}")

        for level in (1, 2):
            before = workers_rss(base_url)
            start = time.perf_counter()
            client.sleep(level)
            sleep_s = time.perf_counter() - start
            freed = (before - workers_rss(base_url)) / 2**20
            start = time.perf_counter()
            client.wake_up(["weights"])
            if level == 2:
                client.update_weights_from_disk(str(model))
            client.wake_up(["kv_cache"])
            wake_s = time.perf_counter() - start
            extra = " (+ reload from disk)" if level == 2 else ""
            print(f"sleep level {level}: {sleep_s:.2f} s, freed {freed:.0f} MiB of worker RSS; "
                  f"wake{extra}: {wake_s:.2f} s")  # fmt: skip
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()

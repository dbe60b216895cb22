"""`python -m frontend launch` as a subprocess that a test, a script or an example owns: started on
a free loopback port, ready once /health answers 200, stopped with SIGTERM (tern then stops its
engine core and workers) and SIGKILL after a timeout, and checked with psutil for any process of it
that survived. Used by the test fixtures, scripts/soak, scripts/bench_pooling and examples/rl.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil

from enginecore.executor import free_port

ROOT = Path(__file__).resolve().parents[2]


def is_alive(p: psutil.Process) -> bool:
    """Zombies count as dead: PID 1 of a container may be slow to reap orphans."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class LaunchedServer:
    def __init__(
        self,
        args: Sequence[str],
        port: int | None = None,
        env: Mapping[str, str] | None = None,
        wrapper: Sequence[str] = (),
        log_prefix: str = "tern-server-",
    ) -> None:
        """`args` follow `launch --host 127.0.0.1 --port PORT`; `wrapper` must exec the command,
        so that `proc` is the frontend itself."""
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix=log_prefix, suffix=".log")[1])
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop())
        cmd = [*wrapper, sys.executable, "-m", "frontend", "launch", "--host", "127.0.0.1"]
        self.proc = subprocess.Popen(
            [*cmd, "--port", str(self.port), *args],
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        self.descendants: dict[int, psutil.Process] = {}

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self) -> str:
        return self.log[-4000:]

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tern exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as r:
                    if r.status == 200:
                        self.record_descendants()
                        return
            time.sleep(0.1)
        raise TimeoutError(f"tern was not ready within {timeout} s:\n{self.log_tail()}")

    def record_descendants(self) -> None:
        """Remembers every process under the launcher (to check later that none survived)."""
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                self.descendants[p.pid] = p

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout`; returns the exit code."""
        if self.proc.poll() is None:
            self.record_descendants()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        return self.proc.returncode

    def survivors(self, timeout: float = 10.0) -> list[psutil.Process]:
        """Descendants still alive after up to `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            alive = [p for p in self.descendants.values() if is_alive(p)]
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.1)

    def shut_down(self, timeout: float = 15.0) -> list[psutil.Process]:
        """stop(), then kills what survived it and returns those; the log is kept only then."""
        self.stop(timeout)
        alive = self.survivors()
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        if not alive:
            self.log_path.unlink(missing_ok=True)
        return alive

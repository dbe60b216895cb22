"""Fixtures that run a real `tern launch` (frontend, engine core, workers) on a free local port.

`launch_server(*args)` starts one and returns a TernServer once /health answers 200; every server
started is stopped at the end of the test (SIGTERM, then SIGKILL), and the fixture then checks with
psutil that none of its processes survived.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TernServer:
    def __init__(
        self, args: list[str], port: int | None = None, wrapper: tuple[str, ...] = ()
    ) -> None:
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="tern-server-", suffix=".log")[1])
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop())
        # `wrapper` must exec the command, so that self.proc is the frontend itself.
        cmd = [*wrapper, sys.executable, "-m", "frontend", "launch", "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), *args]
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env=dict(os.environ)
        )
        self.descendants: dict[int, psutil.Process] = {}

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tern exited with {self.proc.returncode}:\n{self.log[-4000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    self.record_descendants()
                    return
            time.sleep(0.5)
        raise TimeoutError(f"tern was not ready within {timeout} s:\n{self.log[-4000:]}")

    def record_descendants(self) -> None:
        """Remembers every process under the launcher (to check later that none survived)."""
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                self.descendants[p.pid] = p

    def server_info(self) -> dict:
        r = httpx.get(f"{self.base_url}/server_info", timeout=30)
        r.raise_for_status()
        return r.json()

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
        """Descendants still alive after `timeout` seconds (zombies count as dead: PID 1 of a
        container may be slow to reap orphans)."""
        deadline = time.monotonic() + timeout
        while True:
            alive = [p for p in self.descendants.values() if _is_alive(p)]
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.1)


def _is_alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _stop_all(servers: list[TernServer]) -> None:
    leftovers = []
    for server in servers:
        server.stop()
        alive = server.survivors()
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        leftovers += alive
        server.log_path.unlink(missing_ok=True)
    assert not leftovers, f"processes survived their server: {leftovers}"


@pytest.fixture
def launch_server() -> Iterator[Callable[..., TernServer]]:
    """launch(*args, wait=True, port=None, wrapper=()) -> TernServer; all are stopped and checked
    after."""
    servers: list[TernServer] = []

    def launch(
        *args: str, wait: bool = True, port: int | None = None, wrapper: tuple[str, ...] = ()
    ) -> TernServer:
        server = TernServer(list(args), port, wrapper)
        servers.append(server)
        if wait:
            server.wait_ready()
        return server

    yield launch
    _stop_all(servers)


@pytest.fixture(scope="module")
def module_server() -> Iterator[Callable[..., TernServer]]:
    """Like launch_server, for servers shared by the tests of one module."""
    servers: list[TernServer] = []

    def launch(*args: str) -> TernServer:
        server = TernServer(list(args))
        servers.append(server)
        server.wait_ready()
        return server

    yield launch
    _stop_all(servers)

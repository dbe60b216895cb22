"""Fixtures that run a real `tern launch` (frontend, engine core, workers) on a free local port.

`launch_server(*args)` starts one and returns a TernServer once /health answers 200; every server
started is stopped at the end of the test (SIGTERM, then SIGKILL), and the fixture then checks with
psutil that none of its processes survived. `module_server` does the same for a server that one
module's tests share (and change: weight updates, pauses, faults...); `shared_server` keeps one
server per argument list for the modules that only send requests (the server lane,
docs/testing.md).
"""

from __future__ import annotations

import base64
import io
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
import pytest
from PIL import Image

from frontend.client.launched_server import LaunchedServer
from tests.conftest import make_tiny_model

# For servers whose answers are checked token for token against Hugging Face's float32 model:
# `--dtype auto` computes in bfloat16 on a CPU with AVX512-BF16 or AMX, whose rounding flips the
# near-tied greedy tokens of a random model.
FLOAT32 = ("--dtype", "float32")


class TernServer(LaunchedServer):
    def __init__(
        self, args: list[str], port: int | None = None, wrapper: tuple[str, ...] = ()
    ) -> None:
        super().__init__(args, port, wrapper=wrapper)

    def server_info(self) -> dict:
        r = httpx.get(f"{self.base_url}/server_info", timeout=30)
        r.raise_for_status()
        return r.json()


def _stop_all(servers: list[TernServer]) -> None:
    leftovers = [p for server in servers for p in server.shut_down()]
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


_SHARED = pytest.StashKey[dict]()
# How many shared servers stay up between modules, the most recently asked for (each holds its
# model and KV cache); the others are stopped, and started again if a later module asks.
KEEP_SHARED = 3


@pytest.fixture(scope="session")
def shared_server(request: pytest.FixtureRequest) -> Iterator[Callable[..., TernServer]]:
    """launch(*args) -> TernServer, one per argument list: for modules that only send their
    server requests (no weight updates, pauses, sleeps, faults or LoRA loading, which would make
    the tests of the modules sharing it depend on their order), so modules that launch with the
    same arguments share one server. Between modules the KEEP_SHARED servers asked for last stay
    up; all are stopped and checked when no integration test follows (pytest_runtest_teardown)."""
    servers: dict[tuple[str, ...], TernServer] = request.config.stash.setdefault(_SHARED, {})

    def launch(*args: str) -> TernServer:
        if args in servers:
            servers[args] = servers.pop(args)  # the most recently asked for last
        else:
            servers[args] = TernServer(list(args))
            servers[args].wait_ready()
        return servers[args]

    yield launch
    _stop_shared(request.config, keep=0)


def _stop_shared(config: pytest.Config, keep: int) -> None:
    """Stops and checks all but the `keep` shared servers asked for last."""
    servers = config.stash.get(_SHARED, {})
    stopping = list(servers)[: max(len(servers) - keep, 0)]
    if stopping:
        _stop_all([servers.pop(args) for args in stopping])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After a module's last test (and its fixtures' teardown): stops the shared servers beyond
    KEEP_SHARED, or all of them when no integration test follows (they would otherwise idle
    through the unit tests)."""
    yield
    if nextitem is None or Path(__file__).parent not in Path(nextitem.path).parents:
        _stop_shared(item.config, keep=0)
    elif nextitem.path != item.path:
        _stop_shared(item.config, keep=KEEP_SHARED)


@pytest.fixture
def no_leftover_children() -> Iterator[None]:
    """Fails the test if a process it started outlives it (multiprocessing's resource tracker and
    the servers other modules share live on by design)."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    leftovers = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.pid in before or p.status() == psutil.STATUS_ZOMBIE:
                continue
            if "resource_tracker" not in " ".join(p.cmdline()):
                leftovers.append(p)
        except psutil.NoSuchProcess:  # it ended while we looked
            continue
    assert not leftovers, leftovers


_LENGTH = re.compile(r'^tern:request_success_total\{finished_reason="length"[^}]*\} (\S+)$', re.M)


def length_finishes(server: TernServer) -> float:
    """How many requests the server has ended by length (max_tokens) so far."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    return sum(float(v) for v in _LENGTH.findall(text))


@pytest.fixture
def no_length_finish(server: Any) -> Iterator[None]:
    """Fails the test if the module's `server` ended any request by length while it ran (the
    client-library tests: every call must finish, not hit max_tokens)."""
    before = length_finishes(server)
    yield
    assert length_finishes(server) == before, "a request ended by length (max_tokens)"


# --------------------------------------------------------------------------- images
# The tiny LLaVA server that test_images.py (chat) and test_generate_images.py (/generate) share:
# one argument list, so one server.


def random_image(seed: int, size: tuple[int, int] = (40, 48)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def image_bytes(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(image_bytes(image, fmt)).decode()


def random_video(seed: int, num_frames: int = 32, size: tuple[int, int] = (24, 32)) -> bytes:
    """An MPEG-4 video of random frames at 8 frames a second (4 s by default)."""
    import av

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.height, stream.width = size
        stream.pix_fmt = "yuv420p"
        for _ in range(num_frames):
            pixels = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())
    return buf.getvalue()


@pytest.fixture(scope="session")
def llava_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path | None) -> Path:
    if tokenizer_dir is None:
        pytest.skip("needs the default model's tokenizer")
    return make_tiny_model("llava", tmp_path_factory.mktemp("llava"), tokenizer_dir)


@pytest.fixture(scope="session")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The server's --allowed-local-media-path: seven.png is random_image(7)."""
    folder = tmp_path_factory.mktemp("media")
    random_image(7).save(folder / "seven.png")
    return folder


@pytest.fixture(scope="session")
def llava_server_args(llava_dir: Path, media_dir: Path) -> tuple[str, ...]:
    """Chunks of 32 tokens (an image is 16 placeholders: chunks split images), 10 KV blocks of 16
    (concurrent requests preempt each other), two images per prompt, local files under one
    folder."""
    return (
        "--model", str(llava_dir), "--served-model-name", "vl",
        "--max-num-batched-tokens", "32", "--num-gpu-blocks-override", "10",
        "--limit-mm-per-prompt", json.dumps({"image": 2}),
        "--allowed-local-media-path", str(media_dir), *FLOAT32,
    )  # fmt: skip

"""`tern launch` (or vLLM's spelling, `tern serve MODEL`): the frontend process. Loads the
tokenizer, starts the engine core, serves HTTP. (frontend/__main__.py is its entry point.)

Start-up order: arguments -> Config -> listening socket (a taken port fails before the model
loads) -> engine core spawned -> tokenizer, while the engine loads the model -> EngineReady ->
uvicorn. Shutdown (SIGTERM, Ctrl-C, or
the engine dying): uvicorn stops, requests in flight end, the engine core is stopped, IPC files
are removed. Exit code: 0 after a requested shutdown, 1 when the engine failed, 2 for bad arguments.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import signal
import socket
import sys
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn
import uvloop

from enginecore.config import Config
from frontend.cli.launch import config_from_args, make_parser
from frontend.cli.server import FrontendConfig, frontend_config_from_args
from frontend.common.http_protocol import KeepAliveSafeHttpProtocol
from frontend.disagg.bootstrap import BootstrapServer, LeaseRegistry, open_bootstrap
from frontend.disagg.lmdeploy_proxy import LMDeployProxyRegistration, ProxyRegistrationError
from frontend.engine.client import EngineClient, EngineStartupError
from frontend.server.middleware import access_warnings

if TYPE_CHECKING:
    from frontend.text.tokenizer import Tokenizer

logger = logging.getLogger("tern.frontend")

ENGINE_DEAD_GRACE_S = 1.0


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = config_from_args(args)
        frontend_config = frontend_config_from_args(args, config)
    except (ValueError, OSError) as e:
        print(f"tern: error: {e}", file=sys.stderr)
        return 2
    if config.parallel.node_rank > 0:  # other nodes run only their workers
        from workers.worker_proc import run_worker_node

        return run_worker_node(config)
    try:
        return uvloop.run(Launcher(config, frontend_config).run())
    finally:
        shutil.rmtree(config.ipc_dir, ignore_errors=True)


class Launcher:
    """Owns the server's lifetime: start-up, signals, and an orderly shutdown."""

    def __init__(self, config: Config, frontend_config: FrontendConfig) -> None:
        self.config = config
        self.frontend_config = frontend_config
        self.engine = EngineClient(config)
        self.server: Server | None = None
        self.bootstrap: BootstrapServer | None = None  # a KV producer's (frontend/disagg/)
        self.is_stop_requested = False
        self._main_task: asyncio.Task[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def run(self) -> int:
        self._loop = asyncio.get_running_loop()
        self._main_task = asyncio.current_task()
        # NOTE: plain signal.signal handlers: uvicorn restores them after serving and re-raises the
        # signal it caught, which then lands here instead of killing the process before cleanup.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        try:
            return await self._run()
        except (EngineStartupError, ValueError, OSError) as e:
            # Start-up failures the user can act on (engine error, bad model files, taken port).
            print(f"tern: error: {e}", file=sys.stderr)
            return 1
        except asyncio.CancelledError:
            if not self.is_stop_requested:
                raise
            asyncio.current_task().uncancel()
            logger.info("start-up interrupted")
            return 0
        finally:
            if self.bootstrap is not None:
                await self.bootstrap.close()
            await self.engine.shutdown()
            logger.info("tern stopped")

    async def _run(self) -> int:
        config = self.config
        sock = _listen(config.server.host, config.server.port)
        try:
            # The engine core and its workers load the model while this process loads the
            # tokenizer (transformers' imports: seconds), in a thread beside the event loop.
            kv, leases = config.kv_transfer, None
            if kv.produces:  # bound before the model loads: a taken port fails fast
                leases, self.bootstrap = open_bootstrap(
                    kv.lease_s, config.server.host, kv.bootstrap_port,
                    self.engine.release_kv, self.engine.replica_ready,
                )  # fmt: skip
            self.engine.spawn()
            tokenizer = await asyncio.to_thread(_load_tokenizer, config, self.frontend_config)
            return await self._serve(sock, tokenizer, leases)
        finally:
            sock.close()

    async def _serve(
        self, sock: socket.socket, tokenizer: Tokenizer, leases: LeaseRegistry | None
    ) -> int:
        from frontend.server.startup import start_serving

        config = self.config
        app, serving = await start_serving(config, self.frontend_config, self.engine, tokenizer)
        serving.leases = leases
        uv_config = uvicorn.Config(
            app,
            loop="uvloop",
            log_level=self.frontend_config.uvicorn_log_level,
            access_log=self.frontend_config.uvicorn_log_level in ("info", "debug", "trace"),
            lifespan="off",
            timeout_graceful_shutdown=2,
            timeout_keep_alive=self.frontend_config.keep_alive_timeout_s,
            http=KeepAliveSafeHttpProtocol,
        )
        self.server = Server(uv_config, on_shutdown=self._fail_requests)
        self.engine.on_dead.append(self._on_engine_dead)
        if self.is_stop_requested or self.engine.is_dead:
            return 1 if self.engine.is_dead else 0
        host, port = sock.getsockname()[:2]
        logger.info("serving %r at %s", serving.model_name, _url(host, port))
        for warning in access_warnings(self.frontend_config, host):
            logger.warning("%s", warning)
        proxy_url = self.frontend_config.proxy_url
        if proxy_url is None:
            await self.server.serve(sockets=[sock])
            return 1 if self.engine.is_dead else 0
        names = self.frontend_config.served_model_names
        proxy = LMDeployProxyRegistration(proxy_url, _url(host, port), names)
        return await self._serve_behind_proxy(sock, proxy)

    async def _serve_behind_proxy(
        self, sock: socket.socket, proxy: LMDeployProxyRegistration
    ) -> int:
        """Serves, registering with the LMDeploy proxy once uvicorn accepts connections (the
        proxy may call back) and removing this server from it when serving ends."""
        assert self.server is not None
        serving = asyncio.create_task(self.server.serve(sockets=[sock]))
        while not self.server.started and not serving.done():
            await asyncio.sleep(0.05)
        if not serving.done():
            try:
                await proxy.register()
                logger.info("registered with LMDeploy proxy %s", proxy.proxy_url)
            except ProxyRegistrationError as e:
                logger.error("%s", e)
                self.server.should_exit = True
                await serving
                return 1
        try:
            await serving
        finally:
            failure = await proxy.remove()
            if failure is not None:
                logger.warning("leaving the LMDeploy proxy: %s", failure)
        return 1 if self.engine.is_dead else 0

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.is_stop_requested = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop)

    def _stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
        elif self._main_task is not None and not self._main_task.cancelling():
            self._main_task.cancel()  # once: a second Ctrl-C must not interrupt the cleanup

    def _on_engine_dead(self, reason: str) -> None:
        # Requests in flight have failed already; /health answers 503 for a moment (so that
        # health checkers see why) before the port closes and tern exits with code 1.
        assert self._loop is not None
        self._loop.call_later(ENGINE_DEAD_GRACE_S, self._stop)

    def _fail_requests(self) -> None:
        self.engine.fail_all_requests("the server is shutting down")


def _load_tokenizer(config: Config, frontend_config: FrontendConfig) -> Tokenizer:
    """The serving layer's modules (transformers among them: seconds of imports) and the
    model's tokenizer; imported here, after the engine core was spawned, so that the two
    processes load at once."""
    from frontend.server.startup import load_tokenizer

    return load_tokenizer(config, frontend_config)


class Server(uvicorn.Server):
    """uvicorn.Server that first ends the requests in flight, so that shutdown takes seconds."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_shutdown = on_shutdown

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._on_shutdown()
        await super().shutdown(sockets=sockets)


def _listen(host: str, port: int) -> socket.socket:
    """Binds the HTTP socket before the model loads, so a taken port fails fast."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, addr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as e:
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

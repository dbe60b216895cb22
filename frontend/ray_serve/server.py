"""TernServer: a Ray Serve replica that is a whole tern server (Ray Serve LLM's `server_cls`).

Each replica starts tern in its own process: the tokenizer, the engine core (a child process) and
the worker ranks. By default the ranks are Ray actors in the replica's own placement group (one
bundle per rank, the replica sharing the first: frontend/ray_serve/llm_config.py), so Ray accounts
for every core a replica uses; with engine_kwargs distributed_executor_backend="mp" they are child
processes of the engine core instead, outside Ray's accounting.

HTTP: the replica is a late-bound Serve ingress (`serve.ingress()(TernServer)`): Ray's proxy hands
each request to tern's own ASGI app (__serve_build_asgi_app__), so every route tern serves works
through Serve, streams included. With `dev=True` (build_dev_openai_app) the control routes of Ray
Serve LLM's dev ingress (/sleep, /wakeup, /pause...) reach every replica (dev_routes.py).

Python calls: the methods Ray Serve LLM's LLMServer has (chat, completions, embeddings, tokenize,
detokenize, check_health, sleep/wakeup/is_sleeping, pause/resume/is_paused, reset_prefix_cache)
run the same routes in-process (asgi_call.py): a request is Ray's pydantic model or a dict; a
response is tern's JSON object (a dict), a stream the SSE events as strings, an error tern's
OpenAI error body. Ray Serve LLM's own builders (`LLMConfig(server_cls=TernServer)`) can only be
imported where vLLM or SGLang is installed; TernServer has the methods they call, but that path is
untested here: frontend/ray_serve/builders.py deploys it with Ray Serve alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import shutil
from collections.abc import AsyncIterator
from typing import Any

from starlette.types import ASGIApp

from frontend.cli.launch import config_from_args, make_parser
from frontend.cli.server import frontend_config_from_args
from frontend.engine.client import EngineClient
from frontend.ray_serve.asgi_call import call_app, request_body
from frontend.ray_serve.llm_config import TernLLMConfig, deployment_options, engine_argv
from frontend.server.startup import load_tokenizer, start_serving

logger = logging.getLogger("tern.ray_serve")


class ControlCallError(RuntimeError):
    """A control call (sleep, pause...) the engine refused."""


class TernServer:
    async def __init__(self, llm_config: Any, dev: bool = False) -> None:
        self._llm_config = TernLLMConfig.of(llm_config)
        self._dev = dev
        self.engine: EngineClient | None = None
        self._app: ASGIApp | None = None  # with the dev routes when dev
        self._tern_app: ASGIApp | None = None
        self._ipc_dir: str | None = None
        await self.start()

    @classmethod
    def get_deployment_options(cls, llm_config: Any) -> dict[str, Any]:
        return deployment_options(TernLLMConfig.of(llm_config))

    async def start(self) -> None:
        args = make_parser().parse_args(
            engine_argv(self._llm_config, {"distributed_executor_backend": "ray"})
        )
        config = config_from_args(args)
        frontend = frontend_config_from_args(args, config)
        if config.parallel.distributed_executor_backend == "ray":
            config = config.replace(parallel=_in_this_replicas_bundles(config.parallel))
        self._ipc_dir = config.ipc_dir
        self._api_key = frontend.api_key or frontend.admin_api_key
        tokenizer = await asyncio.to_thread(load_tokenizer, config, frontend)
        self.engine = EngineClient(config)
        self._tern_app, _ = await start_serving(config, frontend, self.engine, tokenizer)
        self._app = self._tern_app
        if self._dev:
            from frontend.ray_serve.dev_routes import with_dev_routes

            self._app = with_dev_routes(self._tern_app, self._llm_config.model_id)

    async def __serve_build_asgi_app__(self) -> ASGIApp:
        assert self._app is not None
        return self._app

    async def llm_config(self) -> TernLLMConfig:
        return self._llm_config

    # ------------------------------------------------------------------ inference

    async def chat(self, request: Any, raw_request_info: Any = None) -> AsyncIterator[Any]:
        async for item in self._generate("/v1/chat/completions", request):
            yield item

    async def completions(self, request: Any, raw_request_info: Any = None) -> AsyncIterator[Any]:
        async for item in self._generate("/v1/completions", request):
            yield item

    async def embeddings(self, request: Any, raw_request_info: Any = None) -> AsyncIterator[Any]:
        yield await self._json("POST", "/v1/embeddings", request_body(request))

    async def tokenize(self, request: Any, raw_request_info: Any = None) -> AsyncIterator[Any]:
        yield await self._json("POST", "/tokenize", request_body(request))

    async def detokenize(self, request: Any, raw_request_info: Any = None) -> AsyncIterator[Any]:
        yield await self._json("POST", "/detokenize", request_body(request))

    async def _generate(self, path: str, request: Any) -> AsyncIterator[Any]:
        body = request_body(request)
        answer = await self._call("POST", path, json.dumps(body).encode())
        if answer.status != 200 or not body.get("stream"):
            yield json.loads(await answer.read())
            return
        pending = b""
        async for chunk in answer.body():
            pending += chunk
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if event.strip():
                    yield event.decode() + "\n\n"

    # ------------------------------------------------------------------ health and control

    async def check_health(self) -> None:
        if self.engine is None:
            return
        if self.engine.is_dead:
            raise RuntimeError(f"tern's engine is dead: {self.engine.dead_reason}")

    async def reset_prefix_cache(self) -> None:
        await self._control("POST", "/reset_prefix_cache")

    async def sleep(self, **options: Any) -> None:
        await self._control("POST", "/sleep", options)

    async def wakeup(self, **options: Any) -> None:
        await self._control("POST", "/wake_up", options)

    async def is_sleeping(self) -> bool:
        return bool((await self._control("GET", "/is_sleeping"))["is_sleeping"])

    async def pause(self, **options: Any) -> None:
        await self._control("POST", "/pause_generation", options)

    async def resume(self, **options: Any) -> None:
        await self._control("POST", "/resume_generation", options)

    async def is_paused(self) -> bool:
        return bool((await self._control("GET", "/is_paused"))["is_paused"])

    async def _control(
        self, method: str, path: str, options: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        body = json.dumps(options).encode() if options else b""
        answer = await self._call(method, path, body)
        reply = json.loads(await answer.read() or b"{}")
        if answer.status != 200:
            message = reply.get("error", {}).get("message", reply)
            raise ControlCallError(f"{path}: HTTP {answer.status}: {message}")
        return reply

    async def _json(self, method: str, path: str, body: dict[str, Any]) -> Any:
        answer = await self._call(method, path, json.dumps(body).encode())
        return json.loads(await answer.read())

    async def _call(self, method: str, path: str, body: bytes = b"") -> Any:
        assert self._tern_app is not None, "TernServer.start() has not run"
        headers = {"authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        return await call_app(self._tern_app, method, path, body, headers=headers)

    # ------------------------------------------------------------------ shutdown

    async def shutdown(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            await engine.shutdown()
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)

    async def __del__(self) -> None:
        await self.shutdown()


def _in_this_replicas_bundles(parallel: Any) -> Any:
    """The ray backend's ranks go in this replica's placement group, rank r in bundle r, on the
    cluster this replica belongs to."""
    import ray

    group = ray.util.get_current_placement_group()
    address = ray.get_runtime_context().gcs_address
    if group is None:  # a replica without a placement group: the engine makes its own
        return dataclasses.replace(parallel, ray_address=address)
    return dataclasses.replace(
        parallel,
        ray_address=address,
        ray_placement_group=group.id.hex(),
        ray_bundle_indices=tuple(range(parallel.world_size)),
    )

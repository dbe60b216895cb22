"""The small informational routes: /v1/models, /health, /version, /server_info, /metrics, SGLang's
/get_server_info and /get_model_info, /openapi.json and its page /docs.

/health: 200 while the engine serves, 503 once it is dead. With --dp > 1 it also answers a JSON body,
{"status": "ok" | "degraded" | "dead", ...}: degraded (some replica died, the others serve) is
still 200 (see frontend/engine/client.py for why).
"""

from __future__ import annotations

import dataclasses
import platform
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

from enginecore.config import Config, KVTransferConfig
from frontend.cli.server import FrontendConfig
from frontend.common.errors import engine_dead_error
from frontend.common.http import json_response
from frontend.common.metrics import CONTENT_TYPE_LATEST
from frontend.control.serving import ControlServing
from frontend.engine.client import EngineClient, EngineDeadError
from frontend.openai.protocol import ModelCard, ModelList
from frontend.server.middleware import DOCS_STATIC
from frontend.server.openapi import docs_page
from frontend.serving.base import OpenAIServing

_VERSIONED_PACKAGES = ("tern", "torch", "transformers", "tokenizers", "msgspec", "starlette")


def package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


def tern_version() -> str:
    return package_version("tern")


class InfoServing:
    def __init__(
        self,
        config: Config,
        frontend: FrontendConfig,
        engine: EngineClient,
        serving: OpenAIServing,
        control: ControlServing,
        openapi: bytes,
    ) -> None:
        assert engine.ready is not None, "the engine is started before the app is built"
        self.config = config
        self.frontend = frontend
        self.engine = engine
        self.ready = engine.ready
        self.serving = serving
        self.control = control
        self.openapi = openapi
        self.started = int(time.time())
        self.num_replicas = config.parallel.data_parallel_size

    def _card(self, name: str) -> ModelCard:
        return ModelCard(
            id=name,
            created=self.started,
            root=self.config.model.path,
            max_model_len=self.ready.max_model_len,
        )

    async def models(self, request: Request) -> Response:
        cards = [self._card(name) for name in self.serving.model_names]
        for name, adapter in (self.serving.adapters or {}).items():
            card = self._card(name)
            card.root, card.parent = adapter.get("path") or name, self.serving.model_name
            cards.append(card)
        return json_response(ModelList(cards))

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        adapter = self.serving.check_model(name)
        card = self._card(name)
        if adapter is not None:
            card.root = (self.serving.adapters or {})[adapter].get("path") or adapter
            card.parent = self.serving.model_name
        return json_response(card)

    async def health(self, request: Request) -> Response:
        status = 503 if self.engine.is_dead else 200
        if self.num_replicas == 1:
            return Response(status_code=status)
        return json_response(self.engine.health(), status)

    async def version(self, request: Request) -> Response:
        return json_response({"version": tern_version()})

    async def metrics(self, request: Request) -> Response:
        assert self.serving.metrics is not None
        return Response(self.serving.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def openapi_json(self, request: Request) -> Response:
        return Response(self.openapi, media_type="application/json")

    async def docs(self, request: Request) -> Response:
        return HTMLResponse(docs_page("/openapi.json", DOCS_STATIC, "tern API"))

    async def server_info(self, request: Request) -> Response:
        return json_response(await self._server_info())

    async def _server_info(self) -> dict[str, Any]:
        engine, ready, config = self.engine, self.ready, self.config
        try:
            stats = await engine.get_stats()
        except EngineDeadError as e:
            raise engine_dead_error(str(e)) from e
        return {
            "version": tern_version(),
            "versions": {
                "python": platform.python_version(),
                **{name: package_version(name) for name in _VERSIONED_PACKAGES},
            },
            "served_model_name": self.serving.model_name,
            "served_model_names": self.serving.model_names,
            "model_path": config.model.path,  # sglang-router reads it at registration
            "config": dataclasses.asdict(config),
            "frontend": self.frontend.public_dict(),
            "engine": {
                "model_summary": ready.model_summary,
                "task": ready.task,
                "input_modalities": ["text", *self.serving.modalities],
                "num_kv_blocks": ready.num_kv_blocks,
                "block_size": ready.block_size,
                "max_model_len": ready.max_model_len,
                "vocab_size": ready.vocab_size,
                "engine_core_pid": engine.pid,
                "data_parallel_size": self.num_replicas,
                "replicas": self._replicas(),
            },
            "kv_cache": {
                "num_blocks": ready.num_kv_blocks,
                "block_size": ready.block_size,
                "num_tokens": ready.num_kv_blocks * ready.block_size,
                "memory_gib": config.cache.kv_cache_memory_gib,
            },
            "num_requests_in_flight": engine.num_in_flight,
            # Prefill/decode disaggregation: kv_producer | kv_consumer | kv_both, or None (off).
            "kv_transfer_role": config.kv_transfer.role if config.kv_transfer.enabled else None,
            "scheduler_stats": stats,
        }

    def _replicas(self) -> list[dict[str, Any]]:
        engine = self.engine
        if self.num_replicas == 1:
            return [
                {"replica": 0, "engine_core_pid": engine.pid, "dead_reason": engine.dead_reason}
            ]
        return [
            {"replica": r.index, "engine_core_pid": r.pid, "dead_reason": r.dead_reason}
            for r in engine.replicas
        ]

    async def get_server_info(self, request: Request) -> Response:
        """SGLang's /get_server_info: its server-argument names beside tern's /server_info."""
        info = await self._server_info()
        control, ready = self.control, self.ready
        await control.get_weight_version(request)  # refreshes the control state
        parallel = self.config.parallel
        return json_response({
            **info,
            "model_path": self.config.model.path,
            "tokenizer_path": self.config.model.path,
            "tp_size": parallel.tensor_parallel_size,
            "pp_size": parallel.pipeline_parallel_size,
            "dp_size": self.num_replicas,
            "context_length": ready.max_model_len,
            "max_total_num_tokens": ready.num_kv_blocks * ready.block_size,
            "weight_version": control.weight_version,
            "internal_states": [{"weight_version": control.weight_version}],
            **_sglang_disaggregation(self.config.kv_transfer),
        })  # fmt: skip

    async def get_model_info(self, request: Request) -> Response:
        """SGLang's /get_model_info."""
        control = self.control
        await control.get_weight_version(request)
        return json_response({
            "model_path": self.config.model.path,
            "tokenizer_path": self.config.model.path,
            "served_model_name": self.serving.model_name,
            "is_generation": self.ready.task == "generate",
            "preferred_sampling_params": None,
            "weight_version": control.weight_version,
            "has_image_understanding": self.serving.images is not None,
            "has_audio_understanding": False,
            "architectures": [self.ready.model_summary.split(":")[0]],
            "model_type": _model_type(self.config.model.path),
        })  # fmt: skip


def _sglang_disaggregation(kv: KVTransferConfig) -> dict[str, Any]:
    """SGLang's server-argument names of a disaggregated server's role and bootstrap port."""
    mode = {"kv_producer": "prefill", "kv_consumer": "decode"}.get(kv.role, "null")
    return {
        "disaggregation_mode": mode if kv.enabled else "null",
        "disaggregation_bootstrap_port": kv.bootstrap_port,
        "disaggregation_transfer_backend": "tern",
    }


def _model_type(model_path: str) -> str | None:
    """config.json's model_type (sglang-router labels workers with it)."""
    try:
        with open(f"{model_path}/config.json", "rb") as f:
            return msgspec.json.decode(f.read()).get("model_type")
    except (OSError, msgspec.DecodeError, AttributeError):
        return None

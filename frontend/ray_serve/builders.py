"""Serve applications of tern, with the call shapes of Ray Serve LLM's builders:

    from frontend.ray_serve import build_openai_app
    app = build_openai_app({"llm_configs": [{
        "model_loading_config": {"model_id": "smol", "model_source": "/models/smol"},
        "engine_kwargs": {"tensor_parallel_size": 2},
        "deployment_config": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 4}},
    }]})
    serve.run(app)

One model per application (deploy one application per model, each at its own route_prefix):
tern's replica is the ingress itself, with no router deployment in front of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from frontend.ray_serve.llm_config import TernLLMConfig
from frontend.ray_serve.server import TernServer


def build_openai_app(builder_config: Any) -> Any:
    """The OpenAI-compatible application: every tern route, served by each replica."""
    return _application(builder_config, dev=False)


def build_dev_openai_app(builder_config: Any) -> Any:
    """The same with Ray Serve LLM's dev control routes reaching every replica (dev_routes.py)."""
    return _application(builder_config, dev=True)


def _application(builder_config: Any, dev: bool) -> Any:
    from ray import serve

    configs = _llm_configs(builder_config)
    if len(configs) != 1:
        raise ValueError(
            f"one model per application ({len(configs)} llm_configs given): deploy one "
            "application per model, each at its own route_prefix"
        )
    config = TernLLMConfig.of(configs[0])
    deployment = serve.deployment(
        serve.ingress()(TernServer), **TernServer.get_deployment_options(config)
    )
    return deployment.bind(llm_config=config, dev=dev)


def _llm_configs(builder_config: Any) -> list[Any]:
    configs = (
        builder_config.get("llm_configs")
        if isinstance(builder_config, Mapping)
        else getattr(builder_config, "llm_configs", None)
    )
    if not configs:
        raise ValueError('the builder config needs "llm_configs": [an LLMConfig]')
    return list(configs)

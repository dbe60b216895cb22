"""A Ray Serve LLM `LLMConfig` as tern reads it, and what follows from it: the `tern launch`
arguments of the replica's engine and the Serve deployment's options.

Ray's own LLMConfig (ray.serve.llm) only imports beside vLLM or SGLang, so tern reads any object or
dict with its field names: `model_loading_config` {model_id, model_source}, `engine_kwargs` (tern's
flags, snake_case: tensor_parallel_size=2 is --tensor-parallel-size 2), `deployment_config` (Serve's
deployment options), `placement_group_config` {bundles, strategy}.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from frontend.cli.launch import make_parser

# What a worker rank asks of its placement-group bundle.
WORKER_BUNDLE = {"CPU": 1.0}


@dataclasses.dataclass(frozen=True)
class TernLLMConfig:
    model_id: str
    model_source: str
    engine_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    deployment_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    placement_group_config: dict[str, Any] | None = None

    @classmethod
    def of(cls, llm_config: Any) -> TernLLMConfig:
        """From Ray's LLMConfig, a dict of its fields, or a TernLLMConfig."""
        if isinstance(llm_config, TernLLMConfig):
            return llm_config
        get = (
            llm_config.get
            if isinstance(llm_config, Mapping)
            else lambda name, default=None: getattr(llm_config, name, default)
        )
        loading = _as_dict(get("model_loading_config", None))
        if not loading.get("model_id"):
            raise ValueError("llm_config.model_loading_config needs a model_id")
        placement = get("placement_group_config", None)
        return cls(
            model_id=loading["model_id"],
            model_source=loading.get("model_source") or loading["model_id"],
            engine_kwargs=dict(_as_dict(get("engine_kwargs", None))),
            deployment_config=dict(_as_dict(get("deployment_config", None))),
            placement_group_config=None if placement is None else _as_dict(placement),
        )

    @property
    def world_size(self) -> int:
        """Worker ranks of one replica (tp x pp)."""
        kwargs = self.engine_kwargs
        tp = int(kwargs.get("tensor_parallel_size", kwargs.get("tp", 1)))
        pp = int(kwargs.get("pipeline_parallel_size", kwargs.get("pp", 1)))
        return tp * pp


def _as_dict(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    if hasattr(value, "model_dump"):  # Ray's pydantic models
        return value.model_dump(exclude_unset=True)
    raise ValueError(f"expected a mapping, not {type(value).__name__}")


def engine_argv(config: TernLLMConfig, defaults: Mapping[str, Any] = {}) -> list[str]:  # noqa: B006
    """`tern launch` arguments: the model, its served name, then each engine kwarg as its flag
    (`defaults` fill kwargs not given). A kwarg tern has no flag for is an error, not ignored."""
    kwargs = {**defaults, **config.engine_kwargs}
    for key in ("model", "served_model_name"):
        if key in kwargs:
            raise ValueError(f"engine_kwargs.{key}: set model_loading_config instead")
    if int(kwargs.get("data_parallel_size", kwargs.get("dp", 1))) != 1:
        raise ValueError(
            "engine_kwargs.data_parallel_size: a Serve replica runs one engine; scale with "
            "deployment_config num_replicas or autoscaling_config instead"
        )
    parser = make_parser()
    known = {opt for action in _launch_actions(parser) for opt in action.option_strings}
    argv = ["launch", "--model", config.model_source, "--served-model-name", config.model_id]
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is False:
            if f"--no-{flag[2:]}" in known:
                argv.append(f"--no-{flag[2:]}")
                continue
            if flag in known:
                continue  # a store_true flag left off
        if flag not in known:
            raise ValueError(f"engine_kwargs.{key}: tern has no {flag} flag (tern launch --help)")
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            argv += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def _launch_actions(parser: Any) -> list[Any]:
    (sub,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    return list(sub.choices["launch"]._actions)


def deployment_options(config: TernLLMConfig) -> dict[str, Any]:
    """Serve deployment options: deployment_config plus a placement group of one bundle per worker
    rank, the replica's own resources added to the first bundle (the replica and rank 0 share it,
    as in Ray Serve LLM)."""
    options = copy.deepcopy(config.deployment_config)
    if "placement_group_bundles" in options or "placement_group_strategy" in options:
        raise ValueError(
            "placement_group_bundles and placement_group_strategy must not be set in "
            "deployment_config: set placement_group_config in the LLMConfig instead"
        )
    actor = options.setdefault("ray_actor_options", {})
    replica = {"CPU": float(actor.get("num_cpus", 1))}
    if actor.get("num_gpus"):
        replica["GPU"] = float(actor["num_gpus"])
    replica.update(actor.get("resources", {}))
    if "memory" in actor:
        replica["memory"] = actor["memory"]
    placement = config.placement_group_config or {}
    bundles = [dict(b) for b in placement.get("bundles") or [WORKER_BUNDLE] * config.world_size]
    if len(bundles) != config.world_size:
        raise ValueError(
            f"placement_group_config.bundles: {len(bundles)} bundles for {config.world_size} "
            "worker ranks (one bundle per rank)"
        )
    first = bundles[0]
    bundles[0] = {k: first.get(k, 0) + replica.get(k, 0) for k in {*first, *replica}}
    options["placement_group_bundles"] = bundles
    options["placement_group_strategy"] = placement.get("strategy", "PACK")
    options.setdefault("name", config.model_id.replace("/", "--").replace(".", "_"))
    return options

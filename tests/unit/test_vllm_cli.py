"""vLLM's spellings of `tern launch` options: `tern serve MODEL`, -tp/-pp,
--[no-]enable-prefix-caching, --gpu-memory-utilization, --generation-config, --uvicorn-log-level."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest

from enginecore.config import Config, ModelConfig
from frontend.cli.launch import config_from_args, make_parser
from frontend.cli.server import frontend_config_from_args
from frontend.server.startup import generation_defaults

CONFIG = Config(model=ModelConfig(path="/m", served_model_name="default-name"))


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def parse(*argv: str):
    return make_parser().parse_args(list(argv))


def test_serve_model_is_launch_model(model_dir: Path) -> None:
    config = config_from_args(parse("serve", str(model_dir)))
    assert config.model.path == str(model_dir.resolve())
    assert config.model.served_model_name == str(model_dir)
    same = config_from_args(parse("launch", "--model", str(model_dir)))
    assert (same.model, same.cache, same.parallel) == (config.model, config.cache, config.parallel)
    with pytest.raises(ValueError, match="twice"):
        config_from_args(parse("serve", str(model_dir), "--model", "/elsewhere"))


def test_tp_pp_short_spellings(model_dir: Path) -> None:
    config = config_from_args(parse("serve", str(model_dir), "-tp", "2", "-pp", "1"))
    assert config.parallel.tensor_parallel_size == 2
    assert config.parallel.pipeline_parallel_size == 1


@pytest.mark.parametrize(
    "flags,expected",
    [
        ((), True),
        (("--enable-prefix-caching",), True),
        (("--no-enable-prefix-caching",), False),
        (("--no-prefix-caching",), False),
    ],
)
def test_prefix_caching_switch(model_dir: Path, flags: tuple[str, ...], expected: bool) -> None:
    config = config_from_args(parse("serve", str(model_dir), *flags))
    assert config.cache.enable_prefix_caching is expected


def test_gpu_memory_utilization_is_a_fraction_of_available_memory(model_dir: Path) -> None:
    available = psutil.virtual_memory().available / 2**30
    config = config_from_args(parse("serve", str(model_dir), "--gpu-memory-utilization", "0.1"))
    assert config.cache.kv_cache_memory_gib == pytest.approx(0.1 * available, rel=0.2)
    # The workers of one node share the host's memory on CPU: each gets its part.
    tp2 = config_from_args(
        parse("serve", str(model_dir), "--gpu-memory-utilization", "0.1", "-tp", "2")
    )
    assert tp2.cache.kv_cache_memory_gib == pytest.approx(0.05 * available, rel=0.2)
    assert config_from_args(parse("serve", str(model_dir))).cache.kv_cache_memory_gib == 1.0
    for bad in ("0", "1.5", "-0.1"):
        with pytest.raises(ValueError, match="gpu-memory-utilization"):
            config_from_args(parse("serve", str(model_dir), "--gpu-memory-utilization", bad))
    with pytest.raises(ValueError, match="not both"):
        config_from_args(
            parse(
                "serve",
                str(model_dir),
                "--gpu-memory-utilization",
                "0.1",
                "--kv-cache-memory",
                "1",
            )  # fmt: skip
        )


def test_generation_config(tmp_path: Path) -> None:
    model = {"temperature": 0.6, "top_p": 0.9}
    assert generation_defaults("auto", model) == model
    assert generation_defaults("vllm", model) == {}
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.2, "top_k": 5, "eos_token_id": 3, "do_sample": True})
    )
    assert generation_defaults(str(tmp_path), model) == {"temperature": 0.2, "top_k": 5}
    fc = frontend_config_from_args(parse("launch", "--generation-config", str(tmp_path)), CONFIG)
    assert fc.generation_config == str(tmp_path)
    assert frontend_config_from_args(parse("launch"), CONFIG).generation_config == "auto"
    with pytest.raises(ValueError, match="generation-config"):
        frontend_config_from_args(parse("launch", "--generation-config", "/nowhere"), CONFIG)


def test_uvicorn_log_level() -> None:
    assert frontend_config_from_args(parse("launch"), CONFIG).uvicorn_log_level == "warning"
    fc = frontend_config_from_args(parse("serve", "--uvicorn-log-level", "info"), CONFIG)
    assert fc.uvicorn_log_level == "info"
    with pytest.raises(SystemExit):
        parse("launch", "--uvicorn-log-level", "loud")


def test_kv_cache_dtype_and_lmdeploys_quant_policy(model_dir: Path) -> None:
    def dtype(*flags: str) -> str:
        return config_from_args(parse("serve", str(model_dir), *flags)).cache.kv_cache_dtype

    assert dtype() == "auto"
    assert dtype("--kv-cache-dtype", "int8") == "int8"
    assert dtype("--quant-policy", "8") == "int8"
    assert dtype("--quant-policy", "0") == "auto"
    with pytest.raises(ValueError, match="fp8"):
        dtype("--kv-cache-dtype", "fp8")
    with pytest.raises(ValueError, match="disagree"):
        dtype("--quant-policy", "0", "--kv-cache-dtype", "int8")


def test_distributed_executor_backend(model_dir: Path) -> None:
    parallel = config_from_args(parse("serve", str(model_dir))).parallel
    assert parallel.distributed_executor_backend == "mp"
    ray = config_from_args(
        parse(
            "serve",
            str(model_dir),
            "-tp",
            "2",
            "--distributed-executor-backend",
            "ray",
            "--ray-placement-strategy",
            "SPREAD",
            "--ray-address",
            "10.0.0.1:6379",
        )  # fmt: skip
    ).parallel
    assert (ray.distributed_executor_backend, ray.ray_placement_strategy, ray.ray_address) == (
        "ray",
        "SPREAD",
        "10.0.0.1:6379",
    )
    with pytest.raises(ValueError, match="--ray-address needs --distributed-executor-backend ray"):
        config_from_args(parse("serve", str(model_dir), "--ray-address", "auto"))
    with pytest.raises(ValueError, match="Ray places the nodes' ranks itself"):
        config_from_args(
            parse(
                "serve",
                str(model_dir),
                "--distributed-executor-backend",
                "ray",
                "--nnodes",
                "2",
                "--dist-init-addr",
                "10.0.0.1:5000",
            )  # fmt: skip
        )
    with pytest.raises(SystemExit):  # argparse: not a choice
        parse("serve", str(model_dir), "--distributed-executor-backend", "mpi")


def test_worker_openmp_wait_unless_the_user_set_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from enginecore.executor import worker_env

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert worker_env() == {"GOMP_SPINCOUNT": "1000"}
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    assert worker_env() == {}

"""The decode floor's byte count: what one decode step of one sequence reads, checked against the
checkpoint's own tensors (tied and untied embeddings, routed experts), and the probe's bandwidth."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.unit.test_fused_decode import _runner
from workers.kernels import memory_floor


def checkpoint_bytes(model_dir: Path) -> dict[str, int]:
    """float32 bytes of each tensor in the checkpoint (the runners below load float32)."""
    sizes = {}
    for file in model_dir.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                sizes[name] = f.get_slice(name).get_shape()
    return {name: 4 * _numel(shape) for name, shape in sizes.items()}


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2", "tiny_qwen3_moe"])
def test_decode_bytes_counts_what_a_step_reads(arch: str, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(arch)
    config = json.loads((model_dir / "config.json").read_text())
    sizes = checkpoint_bytes(model_dir)
    expected = sum(sizes.values())
    embedding = sizes["model.embed_tokens.weight"]
    if not config.get("tie_word_embeddings", False):
        expected -= embedding  # looked up a row at a time; the LM head is read whole
    experts = sum(v for k, v in sizes.items() if ".mlp.experts." in k)
    if experts:  # a token reads top_k of num_experts
        num_experts = config.get("num_experts") or config["num_local_experts"]
        expected -= experts * (1 - config["num_experts_per_tok"] / num_experts)
    runner = _runner(model_dir, None, "float32")
    assert memory_floor.decode_bytes(runner.model) == pytest.approx(expected, rel=0.01)
    floor = runner.decode_floor()
    assert floor.read_bandwidth > 1e8  # 100 MB/s: any machine streams faster than that
    assert floor.seconds == pytest.approx(floor.weight_bytes / floor.read_bandwidth)
    assert str(floor).startswith(f"decode floor: {floor.weight_bytes / 1e6:.0f} MB")


def test_start_ups_take_the_bandwidth_measured_on_this_cpu(tmp_path: Path, monkeypatch) -> None:
    """The start-up line's bandwidth is probed once per CPU model and thread count and read from
    TERN_HOME after that; another thread count is probed anew."""
    monkeypatch.setenv("TERN_HOME", str(tmp_path))
    probes = []
    probe = memory_floor.read_bandwidth
    monkeypatch.setattr(memory_floor, "read_bandwidth", lambda: probes.append(1) or probe())
    first = memory_floor.remembered_read_bandwidth()
    assert memory_floor.remembered_read_bandwidth() == first and len(probes) == 1
    monkeypatch.setattr(memory_floor.torch, "get_num_threads", lambda: 7)
    memory_floor.remembered_read_bandwidth()
    assert len(probes) == 2
    known = json.loads((tmp_path / "read_bandwidth.json").read_text())
    assert len(known) == 2 and first in known.values()
    assert any("| 7 threads |" in key for key in known)


def test_a_tern_home_it_cannot_write_measures_at_every_start(tmp_path: Path, monkeypatch) -> None:
    """Writing the remembered bandwidth may fail (here TERN_HOME lies under a file; a read-only
    home likewise): the start goes on with the bandwidth it measured."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TERN_HOME", str(tmp_path / "file" / "tern"))
    assert memory_floor.remembered_read_bandwidth() > 1e8

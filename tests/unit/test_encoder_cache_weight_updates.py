"""Every weight-update path of the workers empties the encoder cache (ImageInputs.weights_changed,
hooked to ServedWeights.on_change) when it ends: a commit after a push from disk or as tensors, the
rollback of a push, and the rollback the engine core sends after a push that failed half-way.
The vision tower's tensors travel with the push and are restored by the rollback. (The broadcast
from a trainer's process group ends in the same commit: tests/integration/test_images_parallel.py
checks its answers.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save

from enginecore.config import Config, ModelConfig
from enginecore.messages import CommitWeights, UpdateWeightsFromDisk, UpdateWeightsFromTensors
from tests.conftest import make_tiny_model
from workers.runner.model_runner import ModelRunner
from workers.worker_control import WorkerControl

TOWER = "vision_tower.encoder.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("llava_updates")
    return make_tiny_model("llava", root / "a"), make_tiny_model("llava", root / "b", None, 1)


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(next(model_dir.glob("*.safetensors"))))


def test_every_update_path_empties_the_encoder_cache(checkpoints: tuple[Path, Path]) -> None:
    original, perturbed = checkpoints
    runner = ModelRunner(Config(model=ModelConfig(path=str(original), dtype="float32")))
    runner.load_model()
    control = WorkerControl(runner, rank=0)
    assert runner.images is not None and runner.model.vision is not None
    tower = dict(runner.model.named_parameters())["vision." + TOWER]
    new_tower = _tensors(perturbed)[TOWER]

    def cached() -> int:
        runner.images.cache.put("an image", torch.zeros(16, 8))
        return len(runner.images.cache)

    assert cached() == 1
    control.handle(UpdateWeightsFromDisk(str(perturbed)))
    control.handle(CommitWeights(commit=True))
    assert len(runner.images.cache) == 0 and torch.equal(tower, new_tower)

    assert cached() == 1
    blob = save({TOWER: _tensors(original)[TOWER]})
    control.handle(UpdateWeightsFromTensors(blobs=[blob]))
    assert not torch.equal(tower, new_tower)
    control.handle(CommitWeights(commit=False))  # rolled back: the pushed tower is gone
    assert len(runner.images.cache) == 0 and torch.equal(tower, new_tower)

    assert cached() == 1
    bad = save({TOWER: torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="shape"):
        control.handle(UpdateWeightsFromTensors(blobs=[blob, bad]))
    control.handle(CommitWeights(commit=False))  # what enginecore/control.py sends on failure
    assert len(runner.images.cache) == 0 and torch.equal(tower, new_tower)

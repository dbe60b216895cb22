"""The tiny LLaVA split over --tp 2 --pp 2, loaded in one process: the image encoder is on every
tensor-parallel rank of the first stage (replicated, the checkpoint's tensors whole) and on no
later stage; each checkpoint tensor fills one parameter (one shard of a fused one) of a stage,
and the stages together load every tensor of the checkpoint (none missed, none twice)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import make_tiny_model
from workers.distributed import ParallelContext
from workers.models.args import load_model_args
from workers.models.registry import build_model
from workers.weight_loader import (
    _canonical,
    _local_param,
    expected_weight_names,
    iter_safetensors,
    load_checkpoint,
)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llava", tmp_path_factory.mktemp("llava_split"))


def _is_vision(name: str) -> bool:
    return name.startswith(("vision_tower.", "multi_modal_projector."))


def _stage(llava_dir: Path, tp_rank: int, pp_rank: int) -> torch.nn.Module:
    ctx = ParallelContext(tp_rank=tp_rank, tp_size=2, tp_group=object(), pp_rank=pp_rank,
                          pp_size=2)  # loading needs no collective  # fmt: skip
    model = build_model(load_model_args(llava_dir), ctx)
    load_checkpoint(model, llava_dir)  # raises if a parameter of the stage is not covered
    return model


def test_encoder_replicated_on_the_first_stage_and_every_tensor_loaded_once(
    llava_dir: Path,
) -> None:
    checkpoint = dict(iter_safetensors(llava_dir))
    assert sum(_is_vision(n) for n in checkpoint) > 10
    stages = {(tp, pp): _stage(llava_dir, tp, pp) for tp in (0, 1) for pp in (0, 1)}

    loaded: dict[int, set[str]] = {}  # checkpoint names each stage loads
    for pp in (0, 1):
        targets: dict[tuple[str, object], str] = {}  # (parameter, shard) -> checkpoint name
        for name in checkpoint:
            local = _local_param(stages[0, pp], _canonical(name))
            if local is not None:
                assert local not in targets, f"{name} and {targets[local]} both fill {local}"
                targets[local] = name
        loaded[pp] = set(targets.values())
        for tp in (0, 1):
            has_vision = any(n.startswith("vision.") for n in expected_weight_names(stages[tp, pp]))
            assert has_vision == (stages[tp, pp].vision is not None) == (pp == 0)
    vision = {n for n in checkpoint if _is_vision(n)}
    assert vision <= loaded[0] and not vision & loaded[1]
    assert loaded[0] | loaded[1] == set(checkpoint)  # every tensor on some stage
    # Only the tied embedding is on both: the first stage's input, the last stage's LM head.
    assert loaded[0] & loaded[1] == {"language_model.model.embed_tokens.weight"}

    # Replicated: both ranks hold every encoder tensor whole, equal to the checkpoint's.
    for tp in (0, 1):
        params = dict(stages[tp, 0].vision.named_parameters())
        assert params
        for name, tensor in checkpoint.items():
            local = stages[tp, 0].vision.local_weight_name(_canonical(name))
            if local is not None:
                assert torch.equal(params[local], tensor), (tp, name)

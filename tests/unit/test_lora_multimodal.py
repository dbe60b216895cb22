"""PEFT adapters on the tiny LLaVA: one on the language model (PEFT names its modules
`model.language_model.layers...`) fills each targeted layer's slot with its A and scaled B; one
whose targets also match the CLIP tower's q/v projections (PEFT's usual `["q_proj", "v_proj"]`)
is refused, naming the image encoder, rather than served half. (That the served adapter answers
as PEFT does, with images in the batch: tests/integration/test_images_parallel.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from enginecore.config import LoraConfig
from enginecore.messages import LoadLora
from tests.conftest import make_tiny_model
from workers.distributed import ParallelContext
from workers.lora_adapters import LoraError, attach_lora_stacks, load_adapter
from workers.models.args import load_model_args
from workers.models.registry import build_model
from workers.weight_loader import load_checkpoint


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llava", tmp_path_factory.mktemp("llava_lora_unit"))


def _adapter(llava_dir: Path, out: Path, targets: str | list[str]) -> Path:
    import peft
    import transformers

    torch.manual_seed(0)
    base = transformers.LlavaForConditionalGeneration.from_pretrained(
        llava_dir, dtype=torch.float32
    )
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    peft.get_peft_model(base, config).save_pretrained(out)
    return out


def _served(llava_dir: Path) -> torch.nn.Module:
    model = build_model(load_model_args(llava_dir), ParallelContext.single())
    load_checkpoint(model, llava_dir)
    attach_lora_stacks(model, LoraConfig(enabled=True, max_lora_rank=4), torch.device("cpu"))
    return model


def test_language_model_adapter_fills_its_layers(llava_dir: Path, tmp_path: Path) -> None:
    path = _adapter(llava_dir, tmp_path / "lm", r".*language_model.*\.(q_proj|v_proj)")
    tensors = load_file(str(path / "adapter_model.safetensors"))
    assert tensors and all(".model.language_model.layers." in n for n in tensors)
    model = _served(llava_dir)
    load_adapter(model, LoadLora(slot=1, rank=4, scaling=2.0, path=str(path)), 0)
    attn = model.model.layers[0].self_attn.qkv_proj.lora
    prefix = "base_model.model.model.language_model.layers.0.self_attn"
    a_q, b_q = tensors[f"{prefix}.q_proj.lora_A.weight"], tensors[f"{prefix}.q_proj.lora_B.weight"]
    q_rows = b_q.size(0)
    assert torch.equal(attn.a[1, :4], a_q)
    assert torch.allclose(attn.b[1, :q_rows], 2.0 * b_q)
    k_rows = attn.segment_rows[1]
    assert not attn.b[1, q_rows : q_rows + k_rows].any()  # k_proj is not a target
    assert not attn.a[0].any()  # other slots untouched


def test_adapter_on_the_vision_tower_is_refused(llava_dir: Path, tmp_path: Path) -> None:
    path = _adapter(llava_dir, tmp_path / "both", ["q_proj", "v_proj"])
    assert any("vision_tower" in n for n in load_file(str(path / "adapter_model.safetensors")))
    with pytest.raises(LoraError, match="image encoder"):
        load_adapter(_served(llava_dir), LoadLora(slot=0, rank=4, scaling=2.0, path=str(path)), 0)

"""RoPE parameters from both config.json styles, checked against transformers' own computation."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from workers.layers.rotary import RopeParams, compute_inv_freq

BASE = {"max_position_embeddings": 4096, "hidden_size": 256, "num_attention_heads": 4}
LLAMA3 = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 512,
}


@pytest.mark.parametrize(
    "hf, expected",
    [
        ({}, RopeParams(10000.0, "default", {})),
        ({"rope_theta": 5e5}, RopeParams(5e5, "default", {})),
        (
            {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 4.0}},
            RopeParams(5e5, "linear", {"factor": 4.0}),
        ),
        (
            {"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **LLAMA3}},
            RopeParams(5e5, "llama3", LLAMA3),
        ),
        (
            {"rope_parameters": {"rope_theta": 1e5, "rope_type": "default"}},
            RopeParams(1e5, "default", {}),
        ),
        (
            {"rope_parameters": {"rope_theta": 1e5, "rope_type": "llama3", **LLAMA3}},
            RopeParams(1e5, "llama3", LLAMA3),
        ),
    ],
    ids=["nothing", "v4_theta", "v4_linear", "v4_llama3", "v5_default", "v5_llama3"],
)
def test_both_config_styles(hf: dict, expected: RopeParams) -> None:
    assert RopeParams.from_hf_config({**BASE, **hf}) == expected


def test_unsupported_rope_type_raises() -> None:
    with pytest.raises(ValueError, match="yarn"):
        RopeParams.from_hf_config({**BASE, "rope_scaling": {"type": "yarn", "factor": 4.0}})


@pytest.mark.parametrize("rope_type", ["default", "linear", "llama3"])
def test_inv_freq_matches_transformers(rope_type: str) -> None:
    extra = {"linear": {"factor": 4.0}, "llama3": LLAMA3}.get(rope_type, {})
    rope_parameters = {"rope_type": rope_type, "rope_theta": 50000.0, **extra}
    config = transformers.LlamaConfig(**BASE, rope_parameters=rope_parameters)
    init = ROPE_INIT_FUNCTIONS.get(rope_type)
    if rope_type == "default":
        expected = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config).inv_freq
    else:
        expected, _ = init(config, torch.device("cpu"))
    ours = compute_inv_freq(64, RopeParams.from_hf_config(config.to_dict()))
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)

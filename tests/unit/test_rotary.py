"""RoPE parameters from both config.json styles, and every rope type's frequencies and attention
factor (partial rotation included), checked against transformers' own computation."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from workers.layers.rotary import RopeParams, attention_factor, compute_inv_freq

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
    with pytest.raises(ValueError, match="mrope"):
        RopeParams.from_hf_config({**BASE, "rope_scaling": {"type": "mrope", "factor": 4.0}})


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


SCALED = {
    "yarn": {"factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 16},
    "yarn_mscale": {"factor": 8.0, "original_max_position_embeddings": 512, "mscale": 0.707,
                    "mscale_all_dim": 1.0},
    "longrope": {"original_max_position_embeddings": 1024,
                 "short_factor": [1.0 + 0.05 * i for i in range(32)],
                 "long_factor": [2.0 + 0.5 * i for i in range(32)]},
    "dynamic": {"factor": 2.0},
}  # fmt: skip


@pytest.mark.parametrize("case", list(SCALED))
@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_scaled_types_match_transformers(case: str, partial: float) -> None:
    rope_type = case.split("_")[0]
    extra = dict(SCALED[case])
    if rope_type == "longrope":
        extra = {k: v[: int(32 * partial)] if isinstance(v, list) else v for k, v in extra.items()}
    rope_parameters = {
        "rope_type": rope_type, "rope_theta": 50000.0, "partial_rotary_factor": partial, **extra,
    }  # fmt: skip
    config = transformers.LlamaConfig(**BASE, rope_parameters=rope_parameters)
    expected, expected_factor = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    rope = RopeParams.from_hf_config(config.to_dict())
    assert rope.rotary_dim(64) == int(64 * partial)
    factors = extra.get("short_factor")
    torch.testing.assert_close(compute_inv_freq(64, rope, factors), expected, rtol=0, atol=0)
    assert attention_factor(rope) == pytest.approx(expected_factor, rel=1e-12)

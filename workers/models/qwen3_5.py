"""Qwen3.5 (text) and Qwen3-Next-style hybrids: Gated DeltaNet linear-attention layers
(workers/layers/gated_delta_net.py) interleaved with gated full attention (`layer_types`: three
linear to one full by default). The full-attention layers have per-head q/k norms, a quarter of each
head rotated (`partial_rotary_factor`), and an output gate that q_proj computes beside each query
head; every norm multiplies by 1 + weight. Text-only positions make Qwen3.5's multimodal rope
(`mrope_section`) the plain rotation; in a step with images the attention layers rotate by each
token's (t, h, w) positions (workers/runner/mrope.py, AttentionMetadata.mrope_positions).
"""

from __future__ import annotations

from workers.models.args import ModelArgs
from workers.models.decoder import DecoderSpec, layer_kinds


def decoder_spec(args: ModelArgs) -> DecoderSpec:
    hf = args.hf_config
    interval = hf.get("full_attention_interval", 4)
    default_types = [
        "linear_attention" if (i + 1) % interval else "full_attention"
        for i in range(args.num_hidden_layers)
    ]
    return DecoderSpec(
        layers=layer_kinds(args, default_types),
        norm_offset=1.0,
        qkv_bias=args.attention_bias,
        o_bias=args.attention_bias,
        qk_norm="head",
        activation=hf.get("hidden_act", "silu"),
        attn_output_gate=True,
        linear_attention={
            "num_k_heads": hf["linear_num_key_heads"],
            "num_v_heads": hf["linear_num_value_heads"],
            "head_k_dim": hf["linear_key_head_dim"],
            "head_v_dim": hf["linear_value_head_dim"],
            "conv_kernel": hf.get("linear_conv_kernel_dim", 4),
        },
    )

"""Mixtral: Mistral's decoder (a sliding window where the config sets one) with a mixture of experts
as every layer's MLP: `num_local_experts` of `intermediate_size`, top `num_experts_per_tok`, always
renormalised. Its checkpoints name the MLP `block_sparse_moe` and the experts' projections w1
(gate), w3 (up), w2 (down): the weight loader maps them."""

from __future__ import annotations

from workers.layers.moe import MoESpec, num_experts_of
from workers.models import llama
from workers.models.args import ModelArgs
from workers.models.decoder import DecoderSpec


def decoder_spec(args: ModelArgs) -> DecoderSpec:
    hf = args.hf_config
    moe = MoESpec(
        num_experts=num_experts_of(hf),
        top_k=hf["num_experts_per_tok"],
        intermediate_size=args.intermediate_size,
        norm_topk_prob=True,
    )
    return llama.decoder_spec(args).with_experts(moe, [True] * args.num_hidden_layers)

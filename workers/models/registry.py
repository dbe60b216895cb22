"""Model architectures tern can run, keyed by config.json's `architectures[0]`: each one's decoder
family (workers/models/<family>.py) under an LM head or a pooling head.
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

from enginecore.model_task import ARCHITECTURES
from workers.distributed import ParallelContext
from workers.models.args import ModelArgs
from workers.models.decoder import DecoderForCausalLM
from workers.models.pooling import DecoderForPooling


def build_model(args: ModelArgs, ctx: ParallelContext) -> nn.Module:
    """An uninitialised model of `args.architecture` for `args.task` (the weight loader fills the
    parameters): the decoder of the architecture's family under an LM head (generate) or a
    pooling head (workers/models/pooling.py)."""
    family, head = ARCHITECTURES[args.architecture]
    module = family_module(args)
    if args.is_encoder_decoder:  # its own model whole (workers/models/whisper.py)
        return module.build_model(args, ctx)
    spec = module.decoder_spec(args)
    if args.task == "generate":
        return DecoderForCausalLM(args, ctx, spec)
    return DecoderForPooling(args, ctx, spec, "none" if args.task == "embed" else head)


def family_module(args: ModelArgs) -> Any:
    """The module of the architecture's family (workers/models/<family>.py), whose decoder_spec
    says how its decoder differs from Llama's."""
    return importlib.import_module(f"workers.models.{ARCHITECTURES[args.architecture][0]}")

"""PEFT LoRA adapters on a worker: the slots every served linear layer gets, and an adapter's
tensors put into one slot as this rank's shards (workers/layers/lora.py says how they apply).

Served layers: each decoder layer's attention qkv_proj and o_proj and its dense MLP's
gate_up_proj and down_proj (q/k/v/o/gate/up/down in PEFT's names; Phi-3's fused qkv_proj /
gate_up_proj too). An adapter naming anything else (embeddings, the LM head, experts, DoRA
magnitudes) is refused by name; nothing is served half-loaded (the engine core gives a slot to
no request until every rank loaded it).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file
from torch import nn

from enginecore.config import LoraConfig
from enginecore.lora import SERVED_MODULES, LoraError
from enginecore.messages import LoadLora
from workers.layers.linear import LinearBase
from workers.layers.lora import LoraBatch, LoraStack
from workers.weight_loader import _local_param, _shard_order, _unfused

# The tern modules adapters apply to, by the end of their names.
_SERVED_SUFFIXES = (
    ".self_attn.qkv_proj",
    ".self_attn.o_proj",
    ".mlp.gate_up_proj",
    ".mlp.down_proj",
)
_PREFIX = "base_model.model."


def attach_lora_stacks(model: nn.Module, config: LoraConfig, device: torch.device) -> LoraBatch:
    """Gives every served linear layer of this stage its slots; returns the step's slot map."""
    batch = LoraBatch()
    for name, module in model.named_modules():
        if isinstance(module, LinearBase) and name.endswith(_SERVED_SUFFIXES):
            module.lora = LoraStack(
                batch, config.num_slots, config.max_lora_rank, module.input_size,
                module.shard_rows(), device,
            )  # fmt: skip
    return batch


def adapter_tensors(call: LoadLora, tp_rank: int) -> dict[str, torch.Tensor]:
    if call.path:
        path = Path(call.path)
        file = path / "adapter_model.safetensors"
        if not file.is_file():
            raise LoraError(f"{path} holds no adapter_model.safetensors (PEFT's format)")
        return load_file(str(file))
    if not call.blobs:
        raise LoraError("an adapter needs a path or its tensors")
    blob = call.blobs[tp_rank] if len(call.blobs) > 1 else call.blobs[0]
    try:
        return load_safetensors(bytes(blob))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise LoraError(f"the adapter's tensors are not a safetensors file: {e}") from None


def load_adapter(
    model: nn.Module,
    call: LoadLora,
    tp_rank: int,
    received: dict[str, torch.Tensor] | None = None,
) -> None:
    """Puts the adapter into slot `call.slot` of every served layer of this stage (`received`:
    its tensors, when the trainer broadcast them)."""
    pairs = _pairs(received if received is not None else adapter_tensors(call, tp_rank))
    stacks = {m.lora for m in model.modules() if isinstance(m, LinearBase) and m.lora is not None}
    if not stacks:
        raise LoraError("this server was started without --enable-lora")
    for stack in stacks:
        stack.clear(call.slot)
    for module_name, (a, b) in pairs.items():
        if a.dim() != 2 or b.dim() != 2 or b.size(1) != a.size(0):
            raise LoraError(
                f"{module_name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not pair"
            )
        if a.size(0) > call.rank:
            raise LoraError(f"{module_name}: rank {a.size(0)} is above the adapter's r {call.rank}")
        b = b.float() * call.scaling
        for hf_name, b_rows in _unfused(model, [(f"{module_name}.weight", b)]):
            _place(model, hf_name, a.float(), b_rows, call.slot)


def _pairs(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """PEFT's tensors as {module name in the checkpoint's terms: (A, B)}."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        base = name.removeprefix(_PREFIX)
        for kind in ("A", "B"):
            suffix = f".lora_{kind}.weight"
            if base.endswith(suffix):
                halves.setdefault(base.removesuffix(suffix), {})[kind] = tensor
                break
        else:
            raise LoraError(
                f"adapter tensor {name!r} is not a LoRA A or B weight (DoRA magnitudes, embedding "
                "adapters and trained biases are not supported)"
            )
        if not tensor.is_floating_point():
            raise LoraError(f"adapter tensor {name!r} has dtype {tensor.dtype}, not a float type")
    unserved = sorted({m for m in halves if m.rsplit(".", 1)[-1] not in SERVED_MODULES})
    if unserved:
        raise LoraError(f"adapter modules {unserved[:4]} are not served with LoRA")
    pairs = {}
    for module, ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise LoraError(f"adapter module {module!r} lacks lora_{({'A', 'B'} - set(ab)).pop()}")
        pairs[module] = (ab["A"], ab["B"])
    return pairs


def _place(model: nn.Module, hf_name: str, a: torch.Tensor, b: torch.Tensor, slot: int) -> None:
    """One projection's A (r, inputs) and scaled B (rows, r), full, into this rank's slot."""
    local = _local_param(model, hf_name)
    if local is None:
        return  # another pipeline stage's layer
    param_name, shard_id = local
    if param_name.startswith("vision."):  # PEFT's q_proj/v_proj targets match both towers
        raise LoraError(
            f"adapter module {hf_name!r} is in the image encoder: tern serves LoRA on the "
            "language model only (target its modules, e.g. a regex on 'language_model')"
        )
    module_name = param_name.removesuffix(".weight")
    try:
        layer = model.get_submodule(module_name)
    except AttributeError:
        raise LoraError(f"adapter module {hf_name!r} matches no layer of the model") from None
    if not isinstance(layer, LinearBase) or layer.lora is None:
        raise LoraError(f"adapter module {hf_name!r} is not a layer tern serves LoRA on")
    segment = _shard_order((shard_id, hf_name))
    rows = layer.shard_rows()[segment]
    r = a.size(0)
    try:
        if layer.tp_dim == 1:  # row-parallel: this rank's input columns of A, all of B
            a_local = torch.empty(r, layer.input_size)
            layer.weight_loader(a_local, a, shard_id)
            b_local = b
        else:  # column-parallel (or replicated): all of A, this rank's rows of B
            a_local = a
            b_local = torch.empty(layer.output_size, r)
            layer.weight_loader(b_local, b, shard_id)
            start = sum(layer.shard_rows()[:segment])
            b_local = b_local.narrow(0, start, rows)
        layer.lora.set_segment(slot, segment, a_local, b_local)
    except ValueError as e:
        raise LoraError(f"adapter module {hf_name!r}: {e}") from None

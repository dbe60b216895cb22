"""What a worker does besides forward passes: weight updates, sleep and wake-up.

Weight updates are transactions. The first update call after a commit snapshots this rank's weights
(on the host); `finish(commit=False)` — sent by the engine core when any rank failed, or when a
trainer died mid-broadcast — copies the snapshot back, so no step ever runs on half-updated weights.
Every update goes through the one weight-loader loop (workers/weight_loader.py), which keeps only
this rank's TP shard and this stage's layers.

Sleep level 1 frees the KV cache (on GPU the weights also move to pinned host memory); level 2 frees
the KV cache and the weights. Freed host memory is handed back to the system (malloc_trim), so the
worker's RSS really falls.
"""

from __future__ import annotations

import ctypes
import gc
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load as load_safetensors

from enginecore.messages import (
    CommitWeights,
    ControlCall,
    DestroyWeightsUpdateGroup,
    InitWeightsUpdateGroup,
    LoadLora,
    Sleep,
    UpdateWeightsFromDisk,
    UpdateWeightsFromDistributed,
    UpdateWeightsFromTensors,
    WakeUp,
)
from workers.lora_adapters import load_adapter
from workers.runner.loading import ServedWeights
from workers.runner.model_runner import ModelRunner
from workers.weight_loader import checkpoint_weights, expected_weight_names
from workers.weight_sync import (
    destroy_weights_update_group,
    init_weights_update_group,
    parse_dtype,
    receive_flattened,
)

logger = logging.getLogger("tern.worker")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's ceiling for the mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX).
_MMAP_THRESHOLD_MAX = 32 << 20


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: memory is still freed, maybe not returned at once
        return None


def return_memory_to_system() -> None:
    gc.collect()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def reuse_heap_for_activations() -> None:
    """Activations up to 32 MiB are reused from the heap, not mapped and unmapped per op.

    A forward pass allocates and frees the same few activation sizes in every layer. Each one
    that glibc maps gets fresh zeroed pages on every use: with a 1 MiB threshold that was a third of
    a 2048-token prefill's time in page faults (sys time). Fixed thresholds also stop glibc from
    shrinking the heap after every big free; sleep hands memory back with malloc_trim, which
    releases free pages anywhere in the heap."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
        libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)


class WorkerControl:
    def __init__(self, runner: ModelRunner, rank: int) -> None:
        self.runner = runner
        self.rank = rank
        self._snapshot: dict[str, torch.Tensor] | None = None
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._weight_shapes: dict[str, torch.Size] | None = None  # set while weights are discarded
        self._offloaded: dict[str, torch.Tensor] | None = None  # GPU level-1 sleep
        self._kv_asleep = False
        self._handlers: dict[type, Callable[[Any], None]] = {
            UpdateWeightsFromDisk: self.on_update_from_disk,
            UpdateWeightsFromTensors: self.on_update_from_tensors,
            InitWeightsUpdateGroup: self.on_init_update_group,
            UpdateWeightsFromDistributed: self.on_update_from_distributed,
            DestroyWeightsUpdateGroup: self.on_destroy_update_group,
            CommitWeights: self.on_commit_weights,
            LoadLora: self.on_load_lora,
            Sleep: self.on_sleep,
            WakeUp: self.on_wake_up,
        }

    @property
    def model(self) -> torch.nn.Module:
        assert self.runner.model is not None
        return self.runner.model

    @property
    def weights(self) -> ServedWeights:
        """The served model's and the draft's weights (workers/runner/loading.py)."""
        assert self.runner.weights is not None
        return self.runner.weights

    def handle(self, call: ControlCall) -> None:
        try:
            self._handlers[type(call)](call)
        finally:  # a call that failed half-way may have moved storage too
            self.runner.storage_moved()

    # ------------------------------------------------------------------ weight updates

    def _begin(self) -> None:
        if self._weight_shapes is not None or self._offloaded is not None:
            raise RuntimeError("the weights are asleep: wake up the 'weights' tag before updating")
        if self._snapshot is None:
            self._snapshot = {
                name: p.detach().to("cpu", copy=True) for name, p in self.weights.named()
            }

    def on_commit_weights(self, call: CommitWeights) -> None:
        commit = call.commit
        if self._snapshot is not None and not commit:
            with torch.no_grad():
                for name, p in self.weights.named():
                    p.copy_(self._snapshot[name])
            logger.info("weight update rolled back on rank %d", self.rank)
        self._snapshot = None
        self.runner.weights_valid = self.runner.weights_valid or commit
        self.weights.repack()
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()
        return_memory_to_system()

    def on_update_from_disk(self, call: UpdateWeightsFromDisk) -> None:
        model_path = call.model_path
        path = Path(model_path)
        if not path.is_dir():
            raise ValueError(f"model_path {model_path!r} is not a directory")
        self._begin()
        loaded = self.weights.load(checkpoint_weights(self.model, path))
        missing = expected_weight_names(self.model) - loaded
        if missing:
            raise ValueError(f"checkpoint {model_path} lacks weights: {sorted(missing)[:8]}")

    def on_update_from_tensors(self, call: UpdateWeightsFromTensors) -> None:
        self._begin()
        for blob in call.blobs:
            tensors = load_safetensors(bytes(blob))
            self._load_checked(tensors.items())
        for shm_path in call.shm_paths:
            if not shm_path.startswith("/dev/shm/"):
                raise ValueError(f"shared-memory tensors must live in /dev/shm, not {shm_path!r}")
            with safe_open(shm_path, framework="pt") as f:  # maps the file: no copy until load
                self._load_checked((name, f.get_tensor(name)) for name in f.keys())  # noqa: SIM118

    def _load_checked(self, named: object) -> None:
        def checked():
            for name, tensor in named:
                if not tensor.is_floating_point():
                    raise ValueError(f"weight {name!r} has dtype {tensor.dtype}, not a float type")
                yield name, tensor

        self.weights.load(checked())

    def on_init_update_group(self, call: InitWeightsUpdateGroup) -> None:
        if call.group_name in self._groups:
            raise ValueError(f"weight-update group {call.group_name!r} already exists")
        self._groups[call.group_name] = init_weights_update_group(
            call.master_address,
            call.master_port,
            call.rank_offset + self.rank,
            call.world_size,
            call.group_name,
            call.backend,
            call.timeout_s,
        )

    def on_update_from_distributed(self, call: UpdateWeightsFromDistributed) -> None:
        received = self._receive(call.group_name, call.names, call.dtypes, call.shapes,
                                 call.flattened)  # fmt: skip
        self._begin()
        # Every tensor must be received even if one does not fit, or the trainer would block.
        errors: list[str] = []
        for name, tensor in received:
            try:
                self.weights.load([(name, tensor)])
            except ValueError as e:
                errors.append(str(e))
        if errors:
            raise ValueError("; ".join(errors[:4]))

    def _receive(
        self,
        group_name: str,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        flattened: bool,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The trainer's broadcast of these tensors (checked before the first one arrives): one
        flattened bucket, or one broadcast each."""
        group = self._groups.get(group_name)
        if group is None:
            raise ValueError(f"no weight-update group {group_name!r}: call init first")
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError("names, dtypes and shapes must have the same length")
        torch_dtypes = [parse_dtype(d) for d in dtypes]
        device = self.runner.device

        def received() -> Iterator[tuple[str, torch.Tensor]]:
            if flattened:
                yield from receive_flattened(names, torch_dtypes, shapes, group, device)
                return
            for name, dtype, shape in zip(names, torch_dtypes, shapes):
                tensor = torch.empty(shape, dtype=dtype, device=device)
                dist.broadcast(tensor, src=0, group=group)
                yield name, tensor

        return received()

    def on_destroy_update_group(self, call: DestroyWeightsUpdateGroup) -> None:
        group_name = call.group_name
        group = self._groups.pop(group_name, None)
        if group is None:
            raise ValueError(f"no weight-update group {group_name!r}")
        destroy_weights_update_group(group)

    def on_load_lora(self, call: LoadLora) -> None:
        tensors = None
        if (b := call.broadcast) is not None:  # every tensor received before any is checked
            received = self._receive(b.group_name, b.names, b.dtypes, b.shapes, b.flattened)
            tensors = {name: tensor.cpu() for name, tensor in received}
        load_adapter(self.model, call, self.runner.parallel.tp_rank, tensors)

    # ------------------------------------------------------------------ sleep and wake-up

    def on_sleep(self, call: Sleep) -> None:
        level, tags = call.level, set(call.tags)
        if level not in (1, 2) or not tags <= {"kv_cache", "weights"}:
            raise ValueError(f"sleep: level 1 or 2 and tags kv_cache/weights, not {call}")
        if "kv_cache" in tags:
            self.runner.release_kv_cache()
            self._kv_asleep = True
        if "weights" in tags and level == 2 and self._weight_shapes is None:
            offloaded, self._offloaded = self._offloaded, None  # level 1, then 2: gone too
            self._weight_shapes = {}
            for name, p in self.model.named_parameters():
                self._weight_shapes[name] = offloaded[name].shape if offloaded else p.shape
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self.runner.weights_valid = False
            self.weights.repack()  # drops the packed copies
        elif "weights" in tags and level == 1 and self.runner.device.type == "cuda":
            # Values kept in (pinned) host memory; on the CPU they already are, and stay put.
            if self._offloaded is None and self._weight_shapes is None:
                self._offloaded = {}
                for name, p in self.model.named_parameters():
                    host = torch.empty_like(p, device="cpu", pin_memory=True)
                    self._offloaded[name] = host.copy_(p.detach())  # one copy, into pinned pages
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()
        return_memory_to_system()

    def on_wake_up(self, call: WakeUp) -> None:
        tags = call.tags
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"unknown wake-up tags {sorted(unknown)}: use weights, kv_cache")
        if "weights" in tags:
            if self._weight_shapes is not None:
                for name, p in self.model.named_parameters():
                    p.data = torch.zeros(self._weight_shapes[name], dtype=p.dtype, device=p.device)
                self._weight_shapes = None  # values (and packed copies) come with the next update
            if self._offloaded is not None:
                for name, p in self.model.named_parameters():
                    p.data = self._offloaded[name].to(p.device, non_blocking=True)
                torch.cuda.synchronize(self.runner.device)  # the copies overlap; then the pages go
                self._offloaded = None
                self.weights.repack()
        if "kv_cache" in tags and self._kv_asleep:
            self.runner.init_kv_cache(self.runner.num_kv_blocks, self.runner.num_state_checkpoints)
            self._kv_asleep = False

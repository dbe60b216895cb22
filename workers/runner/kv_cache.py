"""The paged KV cache and the linear-attention state pools: how big they are and their allocation.

One tensor (slots, 2, num_blocks, block_size, Hkv, D) holds every attention layer's K and V of
this stage (a layer's slot: workers/models/kv_cache_groups.py); a hybrid model's linear-attention
layers keep a pool of states, a row per sequence that can run at once (--max-num-seqs) and then
the prefix cache's state checkpoints (enginecore/state_checkpoints.py); a drafter with its own KV
(a draft model, an EAGLE-3 head) sizes and allocates its own beside them.
"""

from __future__ import annotations

import math

import torch

from enginecore.config import Config
from workers.distributed import ParallelContext, shard_heads, stage_layers
from workers.layers.attention import Attention
from workers.layers.gated_delta_net import CHUNK, GatedDeltaNet
from workers.layers.request_state import RequestStateHolder, state_holders
from workers.models.args import ModelArgs
from workers.quant import kv_int8
from workers.spec.drafter import Drafter

# The share of --kv-cache-memory (after the running sequences' states) that a hybrid model's
# linear-attention state checkpoints take when prefix caching is on.
CHECKPOINT_SHARE = 0.25


class KVCache:
    def __init__(
        self,
        config: Config,
        args: ModelArgs,
        parallel: ParallelContext,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.config = config
        self.args = args
        self.parallel = parallel
        self.dtype = dtype
        self.device = device
        self.block_size = config.cache.block_size
        # Set once the model is loaded (bind): before, the sizes assume every layer of the stage.
        self.attn_layers: list[Attention] | None = None
        self.linear_layers: list[GatedDeltaNet] = []  # their states' sizes
        self.draft: Drafter | None = None
        # What keeps per-request state beside the KV cache: the model's layers, then the draft.
        self.holders: list[RequestStateHolder] = []

    def bind(
        self,
        model: torch.nn.Module,
        draft: Drafter | None,
    ) -> None:
        self.attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.linear_layers = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
        self.draft = draft
        self.holders = state_holders(model)
        if draft is not None:
            self.holders.append(draft)

    # ------------------------------------------------------------------ sizing

    def _kv_heads_per_rank(self) -> int:
        p = self.parallel
        return shard_heads(
            self.args.num_attention_heads, self.args.num_key_value_heads, p.tp_size, p.tp_rank
        ).num_kv_heads

    def _slots(self) -> int:
        """Layers one block holds on this stage: the most any KV-cache group has here."""
        if self.attn_layers is None:
            p = self.parallel
            return len(stage_layers(self.args.num_hidden_layers, p.pp_size, p.pp_rank))
        return max((layer.kv_slot + 1 for layer in self.attn_layers), default=1)

    def _row(self) -> tuple[int, torch.dtype]:
        """(elements, dtype) of one head's K or V row of one token in the cache."""
        if self.config.cache.kv_cache_dtype == "int8":
            return kv_int8.row_bytes(self.args.head_dim), torch.uint8
        return self.args.head_dim, self.dtype

    def block_shape(self) -> tuple[list[int], torch.dtype]:
        """One block of the cache tensor (slots, 2, block_size, Hkv, row), and its dtype."""
        row, dtype = self._row()
        return [self._slots(), 2, self.block_size, self._kv_heads_per_rank(), row], dtype

    def bytes_per_block(self) -> int:
        """K and V of one block over this stage's cache slots and this rank's KV heads."""
        row, dtype = self._row()
        elem = torch.empty((), dtype=dtype).element_size()
        per_layer = 2 * self.block_size * self._kv_heads_per_rank() * row * elem
        draft = self.draft.bytes_per_block() if self.draft is not None else 0
        return per_layer * self._slots() + draft

    def state_bytes_per_seq(self) -> int:
        """One sequence's linear-attention states over this stage's layers (0 without any)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        total = 0
        for layer in self.linear_layers:
            conv, recurrent = layer.state_shapes()
            total += math.prod(conv) * elem + math.prod(recurrent) * 4
        return total

    def plan_state_checkpoints(self) -> tuple[int, int]:
        """How many linear-attention state checkpoints (enginecore/state_checkpoints.py) this rank
        keeps for the prefix cache of a hybrid model, and every how many tokens they are taken.

        They get CHECKPOINT_SHARE of the memory the KV blocks would have, and are taken where
        one checkpoint costs about what the KV cache of the tokens since the last one does, at a
        multiple of the delta rule's chunk too: a prompt split there computes no padding."""
        per_seq = self.state_bytes_per_seq()
        if not per_seq or not self.config.cache.enable_prefix_caching:
            return 0, 0
        unit = math.lcm(self.block_size, CHUNK)
        unit_bytes = self.bytes_per_block() * (unit // self.block_size)
        interval = self.config.cache.state_checkpoint_interval or unit * -(-per_seq // unit_bytes)
        budget = self._memory_bytes() - per_seq * self.config.scheduler.max_num_seqs
        return max(int(budget * CHECKPOINT_SHARE), 0) // per_seq, interval

    def _memory_bytes(self) -> int:
        return int(self.config.cache.kv_cache_memory_gib * (1 << 30))

    def num_blocks_for_memory(self) -> int:
        if self.config.cache.num_gpu_blocks_override is not None:
            return self.config.cache.num_gpu_blocks_override
        num_states = self.config.scheduler.max_num_seqs + self.plan_state_checkpoints()[0]
        budget = self._memory_bytes() - self.state_bytes_per_seq() * num_states
        return max(budget, 0) // self.bytes_per_block()

    # ------------------------------------------------------------------ allocation

    def allocate(self, num_blocks: int, num_state_checkpoints: int) -> torch.Tensor:
        """Allocate (slots, 2, num_blocks, block_size, Hkv, D) and hand each layer its slot; and
        the linear-attention state pools: a row per running sequence, then the checkpoints'."""
        assert self.attn_layers is not None, "bind the model before allocating its cache"
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, not {num_blocks}")
        row, dtype = self._row()
        shape = (self._slots(), 2, num_blocks, self.block_size, self._kv_heads_per_rank(), row)
        # NOTE: zeros, not empty: masked-out keys are still multiplied, and NaN * 0 is NaN.
        kv_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        for layer in self.attn_layers:
            layer.kv_cache = kv_cache[layer.kv_slot]
        rows = self.config.scheduler.max_num_seqs + num_state_checkpoints
        for holder in self.holders:
            holder.allocate_states(rows, num_blocks)
        return kv_cache

    def release(self) -> None:
        """Frees the KV cache and the state pools (sleep); allocate brings them back."""
        for layer in self.attn_layers or []:
            layer.kv_cache = torch.empty(0)
        for holder in self.holders:
            holder.free_states()

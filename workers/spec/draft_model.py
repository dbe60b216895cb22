"""The draft model of speculative decoding's `draft_model` method: a small model with the served
model's vocabulary, on the same workers (sharded as the served model is), with a KV cache of its
own addressed through the served model's block tables (the same block ids, its own tensors).

Each step, before the served model's forward, `propose`:
1. catches the draft's KV cache up with every scheduled request: the tokens the served model
   computes this step, and the drafts of the last step that were accepted, whose positions the
   draft computed only up to its second-to-last draft;
2. for the requests the scheduler gave drafts (ScheduledRequest.num_model_drafts), samples a
   token from the draft's logits at their last position, then feeds it back, one decode step per
   further draft.
Drafts are sampled as the served model samples (the request's seed, temperature, top-k/p, min-p,
logit bias and min_tokens at the output index the draft stands for; penalties left out), so that
where the two models agree the coupled noise picks the same token; greedy requests take the
argmax. A request whose prefix came from the cache starts its draft KV after it: those blocks'
draft rows were written when the blocks were first computed (one left stale, the last draft of a
request that ended, costs acceptance only). Whatever the draft proposes, the served model's
verification keeps only what plain decoding would have produced (workers/spec/verification.py): a stale
or poor draft costs speed, never correctness. Every rank runs the same draft steps and gets the same logits (the LM head's
all-gather), so the ranks agree on the drafts without a word exchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from enginecore.messages import SamplingParams, ScheduledRequest
from workers.distributed import ParallelContext, shard_heads
from workers.layers.attention import Attention
from workers.layers.embedding import ParallelLMHead
from workers.layers.gated_delta_net import GatedDeltaNet
from workers.layers.linear import LinearBase
from workers.layers.norm import RMSNorm
from workers.layers.request_state import KVOnlyStates
from workers.models.args import ModelArgs, load_model_args
from workers.models.registry import build_model
from workers.sample.sampler import Sampler
from workers.spec.drafter import draft_step_inputs, sample_drafts
from workers.weight_loader import load_checkpoint


@dataclass
class _DraftState:
    """A request's draft KV: positions [0, kv_len) hold its tokens' keys and values; `drafts`,
    the last step's drafts (position start, start + 1, ...), of which a prefix was accepted."""

    kv_len: int
    drafts: list[int] = field(default_factory=list)
    drafts_start: int = 0


class DraftModel(KVOnlyStates):
    def __init__(
        self, path: str, target: ModelArgs, parallel: ParallelContext, device: torch.device,
        dtype: torch.dtype, block_size: int,
    ) -> None:  # fmt: skip
        args = load_model_args(path)
        if args.vocab_size != target.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({args.vocab_size} tokens) is not the served "
                f"model's ({target.vocab_size})"
            )
        if parallel.pp_size > 1:
            raise ValueError("a draft model is not served with pipeline parallelism")
        self.args = args
        self.parallel = parallel
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with device:
                model = build_model(args, parallel)
        finally:
            torch.set_default_dtype(previous)
        load_checkpoint(model, path)
        self.model = model.eval()
        self.attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
        if any(isinstance(m, GatedDeltaNet) for m in model.modules()):
            raise ValueError(
                f"the draft model {args.architecture} has linear-attention layers: a draft model "
                "keeps only a KV cache"
            )
        if len(model.model.kv_cache_groups) != 1:
            raise ValueError(
                f"the draft model {args.architecture} has sliding-window layers: a draft model "
                "must attend to its whole context"
            )
        for module in model.modules():
            if isinstance(module, (LinearBase, ParallelLMHead, RMSNorm)):
                module.repack_weights()
        self.kv_cache: torch.Tensor | None = None
        self.sampler = Sampler()
        self._states: dict[str, _DraftState] = {}

    def _kv_heads(self) -> int:
        p = self.parallel
        a = self.args
        return shard_heads(
            a.num_attention_heads, a.num_key_value_heads, p.tp_size, p.tp_rank
        ).num_kv_heads

    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return (
            2
            * self.block_size
            * self._kv_heads()
            * self.args.head_dim
            * elem
            * len(self.attn_layers)
        )

    def kv_layout(self) -> str:
        """Its KV covers every position a producer computed (it catches up before each forward,
        the prompt's chunks too), so it travels with the blocks."""
        a = self.args
        shape = [len(self.attn_layers), 2, self.block_size, self._kv_heads(), a.head_dim]
        return (
            f"{a.architecture} layers={a.num_hidden_layers} hidden={a.hidden_size} "
            f"vocab={a.vocab_size} block={shape} {str(self.dtype).removeprefix('torch.')}"
        )

    def kv_blocks(self) -> torch.Tensor | None:
        return self.kv_cache

    def allocate_states(self, num_rows: int, num_blocks: int) -> None:
        """Its own KV of `num_blocks` blocks (request_state.RequestStateHolder)."""
        shape = (len(self.attn_layers), 2, num_blocks, self.block_size, self._kv_heads(),
                 self.args.head_dim)  # fmt: skip
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.attn_layers):
            layer.kv_cache = self.kv_cache[i]
        self._states.clear()

    def free_states(self) -> None:
        for layer in self.attn_layers:
            layer.kv_cache = torch.empty(0)
        self.kv_cache = None
        self._states.clear()

    def record(
        self, reqs: list[ScheduledRequest], features: torch.Tensor | None, starts: list[int]
    ) -> None:
        """Nothing: it catches up from the requests' tokens when it proposes."""

    def own_weights(self) -> torch.nn.Module:
        return self.model

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    @torch.inference_mode()
    def propose(
        self,
        reqs: list[ScheduledRequest],
        tables: list[list[int]],
        params: list[SamplingParams],
    ) -> dict[str, list[int]]:
        """Drafts for the requests with num_model_drafts, by request id (see the module
        docstring). `tables`: each request's block table; `params`: its sampling parameters."""
        if self.kv_cache is None:
            raise RuntimeError("the draft model's KV cache is not allocated")
        # 1. catch up: each request's tokens from its draft KV's end to this step's last one
        starts, chunks = [], []
        for r in reqs:
            state = self._states.get(r.req_id)
            if state is None or r.sampling_params is not None:  # new, or resumed: from its start
                state = self._states[r.req_id] = _DraftState(r.start_pos)
            gap: list[int] = []
            if state.drafts:  # those accepted, from the first whose position was not fed back
                accepted = state.drafts[: max(r.start_pos - state.drafts_start, 0)]
                state.kv_len = min(state.kv_len, r.start_pos)
                gap = accepted[state.kv_len - state.drafts_start :]
            if state.kv_len + len(gap) != r.start_pos:
                raise ValueError(f"request {r.req_id!r}: the draft model's KV cache lost track")
            starts.append(state.kv_len)
            chunks.append([*gap, *r.token_ids])
            state.kv_len = r.start_pos + len(r.token_ids)
            state.drafts = []
        hidden = self._forward(starts, chunks, tables)
        drafting = [i for i, r in enumerate(reqs) if r.num_model_drafts > 0]
        if not drafting:
            return {}
        ends = torch.tensor([len(c) for c in chunks]).cumsum(0)
        rows = ends[torch.tensor(drafting)] - 1
        out: dict[str, list[int]] = {reqs[i].req_id: [] for i in drafting}
        tokens = self._sample(hidden[rows], drafting, reqs, params, 0)
        # 2. one decode step per further draft, the requests that want more
        for j in range(1, max(reqs[i].num_model_drafts for i in drafting) + 1):
            for i, t in zip(drafting, tokens):
                out[reqs[i].req_id].append(t)
            drafting = [i for i in drafting if reqs[i].num_model_drafts > j]
            if not drafting:
                break
            prev = {reqs[i].req_id: out[reqs[i].req_id][-1] for i in drafting}
            positions = [reqs[i].start_pos + len(reqs[i].token_ids) - 1 + j for i in drafting]
            hidden = self._forward(positions, [[prev[reqs[i].req_id]] for i in drafting],
                                   [tables[i] for i in drafting])  # fmt: skip
            tokens = self._sample(hidden, drafting, reqs, params, j)
        for r in reqs:
            if r.req_id in out:
                state = self._states[r.req_id]
                state.drafts, state.drafts_start = out[r.req_id], r.start_pos + len(r.token_ids)
                # the drafts but the last were fed back: their KV is written
                state.kv_len += len(out[r.req_id]) - 1
        return out

    def _forward(
        self, starts: list[int], chunks: list[list[int]], tables: list[list[int]]
    ) -> torch.Tensor:
        ids, meta = draft_step_inputs(starts, chunks, tables, self.block_size, self.device)
        return self.model(ids, meta, None)

    def _sample(
        self,
        hidden: torch.Tensor,
        drafting: list[int],
        reqs: list[ScheduledRequest],
        params: list[SamplingParams],
        j: int,
    ) -> list[int]:
        logits = self.model.compute_logits(hidden).float()
        return sample_drafts(
            self.sampler, logits, [reqs[i] for i in drafting], [params[i] for i in drafting], j
        )

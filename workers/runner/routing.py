"""The experts each token was routed to in a step, on a mixture-of-experts model: counted every
step (tern:moe_expert_tokens) and returned to the requests that ask (--enable-return-routed-experts,
routing replay for RL). A pipeline stage receives the earlier stages' routing with their hidden
states and sends its own on with them.
"""

from __future__ import annotations

import torch

from enginecore.messages import RoutingShape, ScheduledRequest
from workers.layers.moe import SparseMoE


class RoutingCapture:
    def __init__(self, model: torch.nn.Module) -> None:
        # Mixture-of-experts layers of this stage, those of earlier stages (whose routing arrives
        # with their hidden states), the experts per token and in each layer.
        self.layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
        spec = getattr(model.model, "spec", None)  # None: no decoder family's (Whisper)
        self.shape: RoutingShape | None = None
        self.layers_before = self.top_k = self.num_experts = 0
        if spec is not None and spec.moe is not None:
            first = model.model.stage_layers[0]
            self.layers_before = sum(k.mlp == "moe" for k in spec.layers[:first])
            self.top_k, self.num_experts = spec.moe.top_k, spec.moe.num_experts
            num_layers = sum(k.mlp == "moe" for k in spec.layers)
            self.shape = RoutingShape(num_layers, spec.moe.top_k, spec.moe.num_experts)

    @property
    def is_on(self) -> bool:
        return bool(self.top_k)

    def start(self) -> None:
        """Before the forward: each layer captures its routing."""
        for layer in self.layers:
            layer.captured = [] if self.is_on else None

    def collect(self, earlier: torch.Tensor | None, num_tokens: int) -> torch.Tensor:
        """(T, MoE layers so far, top_k) int16: the step's routing in layer order, the earlier
        stages' first."""
        parts = [] if earlier is None else [earlier]
        for layer in self.layers:
            assert layer.captured is not None
            parts += [e.to(torch.int16).unsqueeze(1) for e in layer.captured]
            layer.captured = None
        if not parts:
            return torch.empty(num_tokens, 0, self.top_k, dtype=torch.int16)
        return torch.cat(parts, dim=1)

    def expert_tokens(self, routes: torch.Tensor) -> list[int]:
        """Tokens each expert of each MoE layer took this step, layer-major (layers x experts)."""
        experts = self.num_experts
        offsets = torch.arange(routes.size(1), device=routes.device).unsqueeze(-1) * experts
        flat = (routes.long() + offsets).flatten()
        return torch.bincount(flat, minlength=routes.size(1) * experts).tolist()

    @staticmethod
    def per_request(
        routes: torch.Tensor, reqs: list[ScheduledRequest], starts: list[int]
    ) -> dict[str, bytes]:
        """Each request's rows of the step's routing, as bytes."""
        return {
            r.req_id: routes[starts[i] : starts[i + 1]].cpu().numpy().tobytes()
            for i, r in enumerate(reqs)
        }

"""A hybrid model's linear-attention states on the wire (prefill/decode disaggregation): one
rank's states of one row, holder by holder and tensor by tensor (Gated DeltaNet's conv, then
recurrent state), as raw bytes; the consumer's rank holds the same tensors (same model, dtype
and tp x pp: the layouts were checked)."""

from __future__ import annotations

import os

import numpy as np
import torch

from enginecore.messages import ScheduledRequest


def states_bytes(states: list[torch.Tensor]) -> np.ndarray:
    """The tensors' bytes, one after the other."""
    if not states:
        return np.empty(0, dtype=np.uint8)
    flat = [t.detach().cpu().contiguous().view(-1).view(torch.uint8) for t in states]
    return torch.cat(flat).numpy()


def load_states(states: list[torch.Tensor], data: torch.Tensor) -> None:
    """Writes `data` (uint8, states_bytes' layout) into the views `states`."""
    expected = sum(t.numel() * t.element_size() for t in states)
    if data.numel() != expected:
        raise ValueError(
            f"the pulled linear-attention states are {data.numel()} bytes, this rank's "
            f"{expected}: the two servers' models differ"
        )
    offset = 0
    for t in states:
        size = t.numel() * t.element_size()
        chunk = data[offset : offset + size].view(t.dtype).view(t.shape)
        t.copy_(chunk.to(t.device))
        offset += size


def load_pulled_states(reqs: list[ScheduledRequest], rank: int, request_states) -> None:
    """Each request's pulled states (KVLoad.state_paths) into its state row; the files go once
    read. `request_states(req_id)`: the views of the request's row."""
    for req in reqs:
        load = req.kv_load
        if load is None or not load.state_paths:
            continue
        path = load.state_paths[rank]
        data = torch.from_file(path, size=os.path.getsize(path), dtype=torch.uint8)
        os.unlink(path)
        load_states(request_states(req.req_id), data)

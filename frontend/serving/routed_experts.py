"""A request's routing as each API returns it (routing replay for RL, enginecore/routing.py).

The rows cover every token the model computed for the tokens answered: the prompt's and the
outputs' but the last one, (tokens - 1, MoE layers, top_k). SGLang's meta_info.routed_experts is
base64 of int32 rows, from `routed_experts_start_len` on; vLLM's choices[i].routed_experts is base64
of a NumPy .npy file, uint8 when the model has at most 256 experts per layer, uint16 otherwise.
"""

from __future__ import annotations

import base64
import io

import numpy as np

from enginecore.messages import RoutedExperts


class RoutingRows:
    """The rows a request's outputs carried, joined."""

    def __init__(self) -> None:
        self._data = bytearray()
        self._shape: tuple[int, int, int] | None = None  # layers, top_k, experts

    def add(self, part: RoutedExperts) -> None:
        self._data += part.data
        self._shape = (part.num_layers, part.top_k, part.num_experts)

    def array(self, num_tokens: int) -> np.ndarray | None:
        """int16 (num_tokens - 1, layers, top_k): the rows of a request of num_tokens tokens."""
        if self._shape is None:
            return None
        layers, top_k, _ = self._shape
        rows = np.frombuffer(bytes(self._data), dtype=np.int16).reshape(-1, layers, top_k)
        return rows[: max(num_tokens - 1, 0)]

    @property
    def num_experts(self) -> int:
        return self._shape[2] if self._shape else 0


def sglang_routed_experts(rows: np.ndarray, start: int) -> str:
    return base64.b64encode(rows[start:].astype(np.int32).tobytes()).decode()


def vllm_routed_experts(rows: np.ndarray, num_experts: int) -> str:
    buf = io.BytesIO()
    np.save(buf, rows.astype(np.uint8 if num_experts <= 256 else np.uint16), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()

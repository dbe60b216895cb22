"""What a module that keeps state per running request, beyond the paged KV cache's blocks, offers
the model runner: a Gated DeltaNet layer's state pools (a row per sequence, then the prefix
cache's checkpoints), a drafter's own KV cache (a draft model's, an EAGLE-3 head's).

The runner finds them once, when the model is loaded, and then goes through these verbs whatever
the module: allocate (with the cache; free gives it back on sleep), copy rows (a checkpoint
restored), take a row back to its states after the tokens a verification kept (drafted, then
take_back), and a row's states as tensors, read and written (prefill/decode disaggregation moves
them between servers).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class RequestStateHolder(Protocol):
    def allocate_states(self, num_rows: int, num_blocks: int) -> None:
        """`num_rows` rows of per-sequence state, or KV of `num_blocks` blocks, zeroed."""

    def copy_states(self, src: list[int], dst: list[int]) -> None:
        """Rows `src` into rows `dst`."""

    def drafted(self, row: int) -> Any:
        """After a step that verified drafts: row `row`'s states after each of its tokens, which
        the runner keeps for take_back (None where the holder keeps none)."""

    def take_back(self, row: int, states: Any, kept: int) -> None:
        """Row `row` back to its states after the first `kept` tokens of a verification step
        (`states`: what drafted(row) gave then)."""

    def free_states(self) -> None:
        """Gives the state's memory back (sleep); allocate_states brings it back."""

    def row_states(self, row: int) -> list[torch.Tensor]:
        """Views of row `row`'s states (none where the holder keeps its state elsewhere: a
        drafter's KV follows the block tables); writing into them writes the row."""


class KVOnlyStates:
    """The verbs of a holder whose only state is KV in its own paged cache, read and written
    through the served model's block tables (a draft model's, an EAGLE-3 or MTP head's): no row
    to copy, keep or take back, since a rejected draft's KV is written over."""

    def copy_states(self, src: list[int], dst: list[int]) -> None:
        """Nothing to copy: its KV follows the served model's block tables."""

    def row_states(self, row: int) -> list[torch.Tensor]:
        return []

    def drafted(self, row: int) -> None:
        return None

    def take_back(self, row: int, states: object, kept: int) -> None:
        """Nothing to take back: a rejected draft's KV is written over."""


def state_holders(model: nn.Module) -> list[RequestStateHolder]:
    """The model's modules that keep per-request state, in module order."""
    return [m for m in model.modules() if isinstance(m, RequestStateHolder)]

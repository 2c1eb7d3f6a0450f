"""The input ids a step reads from the step before it while that one is still on the device: with
one step in flight (`Engine.step_overlapped`), a sequence's next row sits at a position whose token
the in-flight step is still sampling (`Sequence.pending`); its id is copied on the device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.engine.sequence import Sequence
from loraplex.host_to_device import to_device


@dataclass(frozen=True)
class PendingTokens:
    """A launched step's sampled tokens, still on the device: the input ids of the next step's
    rows at the sequences' pending positions (`Sequence.pending`)."""

    tokens: torch.Tensor  # [n] int64, on the device
    row_of: dict[Sequence, int]  # each sequence's row in `tokens`

    def patch(self, ids: torch.Tensor, rows: list[tuple[int, Sequence]]) -> None:
        """ids[row] = the sequence's pending token, for each (row, sequence), on the device's
        stream (after the host's copy of the ids, before the forward)."""
        if not rows:
            return
        n = len(rows)
        # one host -> device copy for both index lists
        both = to_device([r for r, _ in rows] + [self.row_of[s] for _, s in rows], torch.int64, ids.device)
        ids.index_copy_(0, both[:n], self.tokens.index_select(0, both[n:]))

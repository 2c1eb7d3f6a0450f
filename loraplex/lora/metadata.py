"""Per-step LoRA batch metadata: token rows grouped into segments by adapter slot.

Built once per step by the model runner and passed explicitly into the model's forward; no
layer keeps global state about the batch.

Example: rows 0..11 with slots [A A A A - - B B B B B C] ('-' = base only) give
    row_perm     = [0 1 2 3 | 6 7 8 9 10 | 11]
    seg_offsets  = [0, 4, 9, 10]
    seg_slots    = [A, B, C]
Base-only rows are in no segment, so they cost the LoRA branch nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loraplex.lora.weights import LoRASlotTable

BASE_SLOT = -1  # a row without an adapter


@dataclass(frozen=True)
class LoRABatchMetadata:
    num_rows: int  # all rows of the step, base-only included
    row_perm: torch.Tensor  # [R] int64: rows of the segments, in segment order
    seg_offsets: torch.Tensor  # [S + 1] int64: segment s is row_perm[seg_offsets[s]:seg_offsets[s+1]]
    seg_slots: torch.Tensor  # [S] int64: adapter slot of each segment
    seg_offsets_host: tuple[int, ...]  # the same, on the host, for loops and launch sizing
    seg_slots_host: tuple[int, ...]
    active_groups: frozenset[tuple[int, str]]  # (layer, group) that some segment's adapter adapts

    @property
    def num_segments(self) -> int:
        return len(self.seg_slots_host)

    @property
    def num_lora_rows(self) -> int:
        return self.seg_offsets_host[-1] if self.seg_offsets_host else 0

    def targets_group(self, layer: int, group: str) -> bool:
        return (layer, group) in self.active_groups

    @classmethod
    def build(
        cls, row_slots: Sequence[int], table: LoRASlotTable, device: torch.device | str = "cpu"
    ) -> LoRABatchMetadata:
        """Group rows by slot, in order of each slot's first row (stable within a segment)."""
        rows_by_slot: dict[int, list[int]] = {}
        for row, slot in enumerate(row_slots):
            if slot != BASE_SLOT:
                rows_by_slot.setdefault(slot, []).append(row)
        perm: list[int] = []
        offsets = [0]
        slots: list[int] = []
        active: set[tuple[int, str]] = set()
        for slot, rows in rows_by_slot.items():
            perm.extend(rows)
            offsets.append(len(perm))
            slots.append(slot)
            active |= table.groups_of(slot)
        return cls(
            num_rows=len(row_slots),
            row_perm=torch.tensor(perm, dtype=torch.int64, device=device),
            seg_offsets=torch.tensor(offsets, dtype=torch.int64, device=device),
            seg_slots=torch.tensor(slots, dtype=torch.int64, device=device),
            seg_offsets_host=tuple(offsets),
            seg_slots_host=tuple(slots),
            active_groups=frozenset(active),
        )

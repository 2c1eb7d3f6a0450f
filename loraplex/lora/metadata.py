"""Per-step LoRA batch metadata: token rows grouped into segments by adapter slot.

Built once per step by the model runner and passed explicitly into the model's forward; no
layer keeps global state about the batch.

Example: rows 0..11 with slots [A A A A - - B B B B B C] ('-' = base only) give
    row_perm     = [0 1 2 3 | 6 7 8 9 10 | 11]
    seg_offsets  = [0, 4, 9, 10]
    seg_slots    = [A, B, C]
Base-only rows are in no segment, so they cost the LoRA branch nothing.

A CUDA graph cannot take new launch sizes per step, so a captured decode step uses *static*
metadata (`static` set): the device tensors are views of the graph's input buffers, rewritten
before every replay, and the host fields describe only the captured shape (`StaticLoRAShape`):
rows, a segment capacity and the rank tile. Segments are then at most `StaticLoRAShape.max_rows`
long (a longer one is split into several of the same slot) and the unused ones are empty and
point at the device table's null slot, so the launch sizes never depend on the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby

import torch

from loraplex.host_to_device import to_device
from loraplex.lora.weights import LoRASlotTable

BASE_SLOT = -1  # a row without an adapter


@dataclass(frozen=True)
class StaticLoRAShape:
    """The launch shape a captured step was recorded with (see the module docstring)."""

    rows: int  # rows of the step (the graph's batch size): an upper bound on LoRA rows
    segments: int  # segment capacity; unused segments are empty
    block_r: int  # rank tile: covers every adapter the replays may see
    max_rows: int  # longest segment


@dataclass(frozen=True)
class LoRABatchMetadata:
    num_rows: int  # all rows of the step, base-only included
    row_perm: torch.Tensor  # [R] int64: rows of the segments, in segment order
    seg_offsets: torch.Tensor  # [S + 1] int64: segment s is row_perm[seg_offsets[s]:seg_offsets[s+1]]
    seg_slots: torch.Tensor  # [S] int64: adapter slot of each segment
    seg_offsets_host: tuple[int, ...]  # the same, on the host, for loops and launch sizing
    seg_slots_host: tuple[int, ...]
    active_groups: frozenset[tuple[int, str]]  # (layer, group) that some segment's adapter adapts
    static: StaticLoRAShape | None = None  # set: a captured step's metadata (host fields unused)

    @property
    def num_segments(self) -> int:
        return self.static.segments if self.static else len(self.seg_slots_host)

    @property
    def num_lora_rows(self) -> int:
        """Rows the LoRA kernels size their scratch for (the static row count when captured)."""
        if self.static:
            return self.static.rows
        return self.seg_offsets_host[-1] if self.seg_offsets_host else 0

    def targets_group(self, layer: int, group: str) -> bool:
        # a captured step launches every group: the replays' adapters are unknown at capture
        return self.static is not None or (layer, group) in self.active_groups

    def live(self, table: LoRASlotTable) -> LoRABatchMetadata:
        """Plain metadata of what the device tensors hold now (a host sync): lets host-driven
        code such as the torch reference run a static step. Empty segments are dropped."""
        if self.static is None:
            return self
        offsets = self.seg_offsets.tolist()
        slots = self.seg_slots.tolist()
        perm = self.row_perm[: offsets[-1]]
        keep = [s for s in range(len(slots)) if offsets[s + 1] > offsets[s]]
        active: set[tuple[int, str]] = set()
        for s in keep:
            active |= table.groups_of(slots[s])
        new_offsets = [0]
        for s in keep:  # segments are contiguous in row_perm, so dropping empty ones keeps it valid
            new_offsets.append(new_offsets[-1] + offsets[s + 1] - offsets[s])
        dev = self.seg_offsets.device
        return LoRABatchMetadata(
            num_rows=self.num_rows,
            row_perm=perm,
            seg_offsets=torch.tensor(new_offsets, dtype=torch.int64, device=dev),
            seg_slots=torch.tensor([slots[s] for s in keep], dtype=torch.int64, device=dev),
            seg_offsets_host=tuple(new_offsets),
            seg_slots_host=tuple(slots[s] for s in keep),
            active_groups=frozenset(active),
        )

    @classmethod
    def build(
        cls, row_slots: Sequence[int], table: LoRASlotTable, device: torch.device | str = "cpu"
    ) -> LoRABatchMetadata:
        """Group rows by slot, in order of each slot's first row (stable within a segment)."""
        runs: list[tuple[int, int, int]] = []
        row = 0
        for slot, group in groupby(row_slots):
            n = sum(1 for _ in group)
            runs.append((slot, row, n))
            row += n
        return cls.build_runs(runs, row, table, device)

    @classmethod
    def build_runs(
        cls,
        runs: Sequence[tuple[int, int, int]],
        num_rows: int,
        table: LoRASlotTable,
        device: torch.device | str = "cpu",
    ) -> LoRABatchMetadata:
        """`build` from runs of consecutive rows on one slot, (slot, first row, rows) in row
        order: what an eager step has (a chunk's tokens are consecutive rows of one sequence), so
        the host work grows with the number of chunks, not of tokens."""
        runs_by_slot: dict[int, list[tuple[int, int]]] = {}
        for slot, first, n in runs:
            if slot != BASE_SLOT and n > 0:
                runs_by_slot.setdefault(slot, []).append((first, n))
        perm: list[int] = []
        offsets = [0]
        slots: list[int] = []
        active: set[tuple[int, str]] = set()
        for slot, slot_runs in runs_by_slot.items():
            for first, n in slot_runs:
                perm.extend(range(first, first + n))
            offsets.append(len(perm))
            slots.append(slot)
            active |= table.groups_of(slot)
        dev = torch.device(device)
        # One copy for the three, each starting 16-byte aligned (an even int64 index): the kernels
        # specialize on pointer alignment, so views at odd offsets would compile other variants.
        n, s = len(perm), len(slots)
        o_at = n + (n & 1)
        s_at = o_at + s + 1 + ((s + 1) & 1)
        packed = to_device(
            perm + [0] * (o_at - n) + offsets + [0] * (s_at - o_at - s - 1) + slots, torch.int64, dev
        )
        return cls(
            num_rows=num_rows,
            row_perm=packed[:n],
            seg_offsets=packed[o_at : o_at + s + 1],
            seg_slots=packed[s_at : s_at + s],
            seg_offsets_host=tuple(offsets),
            seg_slots_host=tuple(slots),
            active_groups=frozenset(active),
        )

"""Reference LoRA op in plain torch: the CPU path, and the contract the GPU kernels implement.

One call handles one executed linear layer (a *group*: qkv, o, gate_up or down) of one decoder
layer, for every segment of the step and every slice of the group.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loraplex.lora.layout import GROUP_SLICES
from loraplex.lora.metadata import BASE_SLOT, LoRABatchMetadata
from loraplex.lora.weights import LoRAPair, LoRASlotTable


def segment_pairs(
    meta: LoRABatchMetadata, table: LoRASlotTable, layer: int, group: str
) -> list[list[LoRAPair | None]]:
    """pairs[s][i]: the LoRA weights of segment s for slice i of the group (None: not adapted)."""
    slices = GROUP_SLICES[group]
    return [[table.pair(slot, layer, t) for t in slices] for slot in meta.seg_slots_host]


def lora_shrink(
    x: torch.Tensor, meta: LoRABatchMetadata, pairs: Sequence[Sequence[LoRAPair | None]]
) -> torch.Tensor:
    """H = X_a A_a^T per segment and slice, in float32.

    x: [T, d_in]; returns h: [n_slices, R, r_batch] where R = meta.num_lora_rows and r_batch is the
    largest rank in the call; row j of h belongs to token row meta.row_perm[j]; columns past a
    segment's own rank stay zero.

    Semantics:
        for s, slot in enumerate(meta.seg_slots):
            rows = meta.row_perm[meta.seg_offsets[s]:meta.seg_offsets[s+1]]
            for i, pair in enumerate(pairs[s]):
                if pair is not None:
                    h[i, seg_offsets[s]:seg_offsets[s+1], :pair.rank] = x[rows] @ pair.a.T
    """
    n_slices = len(pairs[0]) if pairs else 0
    r_batch = max((p.rank for seg in pairs for p in seg if p is not None), default=0)
    h = x.new_zeros((n_slices, meta.num_lora_rows, r_batch), dtype=torch.float32)
    offs = meta.seg_offsets_host
    for s, seg in enumerate(pairs):
        lo, hi = offs[s], offs[s + 1]
        xs = x.index_select(0, meta.row_perm[lo:hi]).float()
        for i, pair in enumerate(seg):
            if pair is not None:
                h[i, lo:hi, : pair.rank] = xs @ pair.a.float().T
    return h


def lora_expand(
    y: torch.Tensor,
    h: torch.Tensor,
    meta: LoRABatchMetadata,
    pairs: Sequence[Sequence[LoRAPair | None]],
    slice_offsets: Sequence[int],
) -> None:
    """Y[rows, slice] += s_a * H_a B_a^T, in place, per segment and slice.

    y: [T, d_out_total] (the base output); slice i occupies columns
    slice_offsets[i]:slice_offsets[i+1]. Rows of other segments and base-only rows are untouched.

    Semantics:
        for s, slot in enumerate(meta.seg_slots):
            rows = meta.row_perm[meta.seg_offsets[s]:meta.seg_offsets[s+1]]
            for i, pair in enumerate(pairs[s]):
                if pair is not None:
                    y[rows, slice_offsets[i]:slice_offsets[i+1]] += (
                        pair.scale * h[i, seg_rows, :pair.rank] @ pair.b.T)
    """
    offs = meta.seg_offsets_host
    for s, seg in enumerate(pairs):
        lo, hi = offs[s], offs[s + 1]
        rows = meta.row_perm[lo:hi]
        for i, pair in enumerate(seg):
            if pair is None:
                continue
            delta = (h[i, lo:hi, : pair.rank] @ pair.b.float().T) * pair.scale
            col = slice(slice_offsets[i], slice_offsets[i + 1])
            y[:, col].index_add_(0, rows, delta.to(y.dtype))


class TorchLoRABackend:
    """Runs the reference op; counts calls so tests can prove absent work costs nothing."""

    name = "torch"

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()  # group name -> number of op calls

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    def begin_step(
        self,
        meta: LoRABatchMetadata,
        table: LoRASlotTable,
        device: torch.device | str,
        replayed: bool | None = None,
    ) -> None:
        """Nothing to prepare per step (the Triton backend gathers per-step tables here)."""

    def graph_epoch(self, table: LoRASlotTable, device: torch.device | str) -> tuple[int, int]:
        """No device tables: captured-shape steps read the slot table directly (`meta.live`),
        and padding segments may name any slot id (they are empty)."""
        return 0, BASE_SLOT

    def apply(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        meta: LoRABatchMetadata,
        table: LoRASlotTable,
        layer: int,
        group: str,
        slice_offsets: Sequence[int],
    ) -> None:
        partial = self.shrink(x, meta, table, layer, group, slice_offsets)
        if partial is not None:
            self.expand(y, partial)

    def shrink(
        self,
        x: torch.Tensor,
        meta: LoRABatchMetadata,
        table: LoRASlotTable,
        layer: int,
        group: str,
        slice_offsets: Sequence[int],
    ) -> TorchLoRAPartial | None:
        """`lora_shrink` for one call; `expand` finishes it (None: nothing to do)."""
        meta = meta.live(table)  # a captured-shape step: read what its buffers hold now
        if meta.num_lora_rows == 0 or not meta.targets_group(layer, group):
            return None
        pairs = segment_pairs(meta, table, layer, group)
        self.calls[group] += 1
        return TorchLoRAPartial(lora_shrink(x, meta, pairs), meta, pairs, tuple(slice_offsets))

    def expand(self, y: torch.Tensor, partial: TorchLoRAPartial) -> None:
        lora_expand(y, partial.h, partial.meta, partial.pairs, partial.slice_offsets)


@dataclass(frozen=True)
class TorchLoRAPartial:
    h: torch.Tensor
    meta: LoRABatchMetadata
    pairs: list[list[LoRAPair | None]]
    slice_offsets: tuple[int, ...]

"""Compile, before serving, every LoRA kernel variant an eager (prefill, mixed or non-graph decode)
step can reach, whatever its rows, segments, ranks and target sets.

The kernels take every per-step value as a runtime argument (`triton_parts`), so what still picks a
variant is: the group (its slice count and widths), the rank tile (`block_r_for` of the step's
largest rank, up to `max_rank`), the tiling (decode or prefill, from the row tiles), and for
decode-tiled steps the split plan's bucketed split count and shrink stages and whether the
row-loop expand runs, which follow from the number of row tiles (segments x row tiles per
segment) and the width of the adapted slices. `eager_steps` lists synthetic steps that run every
such combination: for each rank tile, each of two target sets (every target; the narrowest slice
of each group, the two ends of the width rule), each segment count up to `max_segments`, segments
of 1, 5 and 17 rows (row loop or not, one or two row tiles), segments long enough for 3-16 row
tiles where the decode tiling still takes them, and one segment the prefill tiling takes. They
run on a private slot table and backend (one layer of synthetic adapters), so the engine's device
tables, and the graphs that read them, are untouched; compiled kernels are shared per process.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from loraplex.lora.backend import LoRABackend
from loraplex.lora.layout import GROUP_SLICES
from loraplex.lora.metadata import LoRABatchMetadata
from loraplex.lora.triton_config import DECODE, DECODE_MAX_ROW_TILES, DECODE_MAX_SEG_ROWS, block_r_for
from loraplex.lora.weights import AdapterWeights, LoRAPair, LoRASlotTable

GroupShapes = dict[str, tuple[int, tuple[int, ...]]]  # group -> (d_in, slice widths)
FILLER_RANK = 8  # the other segments' adapters: the step's rank tile is the top adapter's


def group_shapes(model: torch.nn.Module) -> GroupShapes:
    """(d_in, slice widths) of every LoRA group of the model's first layer."""
    shapes: GroupShapes = {}
    for module in model.modules():
        offsets = getattr(module, "slice_offsets", None)
        if offsets is not None and getattr(module, "layer", None) == 0:
            widths = tuple(offsets[i + 1] - offsets[i] for i in range(len(offsets) - 1))
            shapes[str(module.group)] = (int(getattr(module, "in_features")), widths)  # noqa: B009
    return shapes


def target_sets(shapes: GroupShapes) -> list[tuple[str, ...]]:
    """Every target, and the narrowest slice of each group (the two ends of the row-loop width
    rule; any other set of adapted slices is as wide as one of them or between)."""
    every = tuple(t for g in shapes for t in GROUP_SLICES[g])
    narrow = tuple(GROUP_SLICES[g][min(range(len(w)), key=w.__getitem__)] for g, (_, w) in shapes.items())
    return [every] if every == narrow else [every, narrow]


@dataclass(frozen=True)
class EagerStep:
    block_r: int
    targets: tuple[str, ...]
    seg_rows: tuple[int, ...]  # rows of each segment; the first segment's adapter has rank block_r


def long_segment_rows(max_segments: int) -> Iterator[tuple[int, ...]]:
    """Steps of n segments longer than `DECODE_MAX_SEG_ROWS` that the decode tiling still takes:
    one per (n, row tiles per segment), so every split plan of their tile counts is compiled."""
    for n in range(1, max_segments + 1):
        shift = (DECODE_MAX_SEG_ROWS // DECODE.block_m).bit_length()  # the first that is long
        while n << shift <= DECODE_MAX_ROW_TILES:
            yield ((DECODE.block_m << (shift - 1)) + 1,) * n
            shift += 1


def eager_steps(shapes: GroupShapes, max_rank: int, max_segments: int) -> Iterator[EagerStep]:
    tiles = sorted({block_r_for(r) for r in range(1, max_rank + 1)})
    # one segment past what the decode tiling takes: the prefill tiling
    prefill = DECODE.block_m * DECODE_MAX_ROW_TILES + 1
    long_rows = list(long_segment_rows(max_segments))
    for block_r in tiles:
        for targets in target_sets(shapes):
            yield EagerStep(block_r, targets, (prefill,))
            for rows in long_rows:
                yield EagerStep(block_r, targets, rows)
            for n in range(1, max_segments + 1):
                for rows in ((1,) * n, (5,) * n, (17,) * n, (17,) + (1,) * (n - 1)):
                    yield EagerStep(block_r, targets, rows)


def _adapter(
    shapes: GroupShapes, targets: Sequence[str], rank: int, dtype: torch.dtype, device: torch.device
) -> AdapterWeights:
    pairs = {}
    for group, (d_in, widths) in shapes.items():
        for t, d_out in zip(GROUP_SLICES[group], widths, strict=True):
            if t in targets:
                a = torch.zeros(rank, d_in, dtype=dtype, device=device)
                pairs[(0, t)] = LoRAPair(a, torch.zeros(d_out, rank, dtype=dtype, device=device), 1.0)
    return AdapterWeights(pairs)


class EagerWarmup:
    """Runs `eager_steps` through a backend of the engine's kind (a fresh instance)."""

    def __init__(
        self,
        backend: LoRABackend,
        shapes: GroupShapes,
        dtype: torch.dtype,
        device: torch.device,
        max_rank: int,
        max_segments: int,
    ) -> None:
        self.backend: LoRABackend = type(backend)()
        self.shapes, self.dtype, self.device = shapes, dtype, device
        self.steps = list(eager_steps(shapes, max_rank, max_segments))
        self._tables: dict[tuple[int, tuple[str, ...]], LoRASlotTable] = {}
        self._max_segments = max_segments
        rows = max(sum(s.seg_rows) for s in self.steps)
        # one input and output per group at the most rows, sliced per step (same strides)
        self._io = {
            g: (
                torch.zeros(rows, d_in, dtype=dtype, device=device),
                torch.zeros(rows, sum(w), dtype=dtype, device=device),
            )
            for g, (d_in, w) in shapes.items()
        }

    def _table(self, block_r: int, targets: tuple[str, ...]) -> LoRASlotTable:
        table = self._tables.get((block_r, targets))
        if table is None:
            table = LoRASlotTable(1, self.dtype, self._max_segments)
            table.set(0, _adapter(self.shapes, targets, block_r, self.dtype, self.device))
            filler = _adapter(self.shapes, targets, FILLER_RANK, self.dtype, self.device)
            for slot in range(1, self._max_segments):
                table.set(slot, filler)
            self._tables = {(block_r, targets): table}  # one at a time: steps come grouped
        return table

    @torch.inference_mode()
    def run(self, step: EagerStep) -> None:
        from loraplex.lora.step import LoRAContext

        table = self._table(step.block_r, step.targets)
        runs, row = [], 0
        for slot, n in enumerate(step.seg_rows):
            runs.append((slot, row, n))
            row += n
        meta = LoRABatchMetadata.build_runs(runs, row, table, self.device)
        LoRAContext.begin(meta, table, self.backend)
        for group, (_, widths) in self.shapes.items():
            x, y = self._io[group]
            offsets = [0]
            for w in widths:
                offsets.append(offsets[-1] + w)
            self.backend.apply(y[:row], x[:row], meta, table, 0, group, offsets)

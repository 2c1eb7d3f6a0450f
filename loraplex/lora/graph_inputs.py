"""The LoRA part of a captured step's static inputs (decode or mixed): what to record at capture
and what to rewrite before each replay.

A CUDA graph cannot take new launch sizes per step, so the LoRA metadata of a captured step is
*static* (`LoRABatchMetadata.static`): the row permutation, segment slots and segment offsets are
views of the graph's input buffers, rewritten before every replay. Segments are cut to at most
`SEGMENT_ROWS` rows (the decode tiling's row tile) and padded with empty segments on the device
table's null slot up to a power-of-two capacity, so the LoRA launches of a graph depend only on
(segment capacity, rank tile) — the LoRA part of its key — and the table epoch it was recorded
under (a graph of an older epoch reads freed tables).

The engine's graph runner owns the buffers (one host-to-device copy per replay for all its
inputs) and hands this module a view of `words(batch)` int64 words; it never reads them.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from loraplex.lora.backend import LoRABackend
from loraplex.lora.metadata import BASE_SLOT, LoRABatchMetadata, StaticLoRAShape
from loraplex.lora.triton_config import DECODE, block_r_for
from loraplex.lora.weights import LoRASlotTable

SEGMENT_ROWS = DECODE.block_m  # longest LoRA segment of a captured step: one row tile


class LoRAGraphKey(NamedTuple):
    segments: int  # segment capacity (a power of two, at most the batch)
    block_r: int  # rank tile covering every adapter of the step
    epoch: int  # the device tables' epoch the graph reads


class LoRAGraphInputs:
    """One bucket's static LoRA inputs for B rows: row_perm [B] | seg_slots [B] | seg_offsets
    [B + 1], each starting at an even word (16-byte aligned when the buffer is: the kernels
    specialize on pointer alignment, and every bucket should compile the same variants).

    The segment capacity of a step is the power of two covering its segments, kept within
    [min_segments, max_segments]: a decode bucket takes every power of two up to B; a mixed
    bucket's steps have at most B / SEGMENT_ROWS + (sequences) segments and start at a floor, so
    it needs few graphs (an unused segment costs its programs an early exit)."""

    @staticmethod
    def _stride(batch: int) -> int:
        return batch + (batch & 1)

    @classmethod
    def words(cls, batch: int) -> int:
        return 2 * cls._stride(batch) + batch + 1

    def __init__(
        self,
        batch: int,
        host: np.ndarray,
        device_words: torch.Tensor,
        table: LoRASlotTable,
        backend: LoRABackend,
        min_segments: int = 1,
        max_segments: int | None = None,
    ) -> None:
        b = batch
        assert host.shape == (self.words(b),) and device_words.shape == (self.words(b),)
        self.batch = b
        self.max_segments = min(_pow2(max_segments or b), b)
        self.min_segments = min(_pow2(min_segments), self.max_segments)
        self.table = table
        self.backend = backend
        self._host = host
        self._slots_at = st = self._stride(b)
        self._row_perm = device_words[:b]
        self._seg_slots = device_words[st : st + b]
        self._seg_offsets = device_words[2 * st :]

    def pack(self, row_slots: list[int]) -> tuple[LoRAGraphKey | None, int]:
        """Write a step's LoRA rows into the host buffer (uploaded with the runner's other inputs).
        Returns the graph key's LoRA part (None: no LoRA rows) and the number of distinct adapters."""
        return self._pack(*cut_segments(row_slots))

    def pack_runs(self, runs: list[tuple[int, int, int]]) -> tuple[LoRAGraphKey | None, int]:
        """`pack` from runs of consecutive rows on one slot, (slot, first row, rows) in row order
        (a chunk's tokens): host work grows with chunks and segments, not rows."""
        return self._pack(*cut_runs(runs))

    def _pack(
        self, segments: list[tuple[int, list[int]]], distinct: list[int]
    ) -> tuple[LoRAGraphKey | None, int]:
        if not segments:
            return None, 0
        epoch, null_slot = self.backend.graph_epoch(self.table, self._row_perm.device)
        cap = min(max(_pow2(len(segments)), self.min_segments), self.max_segments)
        assert len(segments) <= cap, f"{len(segments)} LoRA segments, the bucket takes {cap}"
        max_rank = max(self.table.weights(slot).max_rank for slot in distinct)
        self._write(segments, cap, null_slot)
        return LoRAGraphKey(cap, block_r_for(max_rank), epoch), len(distinct)

    def keys(self, max_rank: int) -> list[LoRAGraphKey]:
        """Every LoRA key a step of this bucket can have at the tables' current epoch, with
        adapters of rank up to `max_rank`: what a server captures at startup."""
        epoch = self.backend.graph_epoch(self.table, self._row_perm.device)[0]
        lo, hi = self.min_segments, self.max_segments
        caps = sorted({min(max(_pow2(n), lo), hi) for n in range(1, hi + 1)})
        tiles = sorted({block_r_for(r) for r in range(1, max_rank + 1)})
        return [LoRAGraphKey(cap, tile, epoch) for cap in caps for tile in tiles]

    def pack_empty(self, key: LoRAGraphKey) -> None:
        """An all-padding step (every segment empty, on the null slot): what a capture records with,
        so the warm-up and the capture change no state."""
        self._write([], key.segments, self.backend.graph_epoch(self.table, self._row_perm.device)[1])

    def metadata(self, key: LoRAGraphKey) -> LoRABatchMetadata:
        """The static metadata a graph of `key` is recorded with (views of the device buffer)."""
        b, cap = self.batch, key.segments
        return LoRABatchMetadata(
            num_rows=b,
            row_perm=self._row_perm,
            seg_offsets=self._seg_offsets[: cap + 1],
            seg_slots=self._seg_slots[:cap],
            seg_offsets_host=(),
            seg_slots_host=(),
            active_groups=frozenset(),  # unused: a static step launches every group
            static=StaticLoRAShape(rows=b, segments=cap, block_r=key.block_r, max_rows=SEGMENT_ROWS),
        )

    def _write(self, segments: list[tuple[int, list[int]]], cap: int, null_slot: int) -> None:
        h, st = self._host, self._slots_at
        perm, slots, offsets = 0, st, 2 * st
        pos = 0
        h[offsets] = 0
        for s, (slot, rows) in enumerate(segments):
            h[perm + pos : perm + pos + len(rows)] = rows
            pos += len(rows)
            h[slots + s] = slot
            h[offsets + s + 1] = pos
        k = len(segments)
        h[slots + k : slots + cap] = null_slot  # empty segments on the null slot (rank 0)
        h[offsets + k + 1 : offsets + cap + 1] = pos


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def cut_runs(runs: list[tuple[int, int, int]]) -> tuple[list[tuple[int, list[int]]], list[int]]:
    """`cut_segments` of runs (slot, first row, rows): the same segments, built per run."""
    by_slot: dict[int, list[int]] = {}
    for slot, first, n in runs:
        if slot != BASE_SLOT and n > 0:
            by_slot.setdefault(slot, []).extend(range(first, first + n))
    return _cut(by_slot)


def cut_segments(row_slots: list[int]) -> tuple[list[tuple[int, list[int]]], list[int]]:
    """Rows grouped by slot (order of first appearance; base rows left out), cut into pieces of
    SEGMENT_ROWS rows. Returns the segments and the distinct slots."""
    by_slot: dict[int, list[int]] = {}
    for row, slot in enumerate(row_slots):
        if slot != BASE_SLOT:
            by_slot.setdefault(slot, []).append(row)
    return _cut(by_slot)


def _cut(by_slot: dict[int, list[int]]) -> tuple[list[tuple[int, list[int]]], list[int]]:
    """Each slot's rows cut into pieces of SEGMENT_ROWS rows; the segments and the slots."""
    segments = []
    for slot, rows in by_slot.items():
        for i in range(0, len(rows), SEGMENT_ROWS):
            segments.append((slot, rows[i : i + SEGMENT_ROWS]))
    return segments, list(by_slot)

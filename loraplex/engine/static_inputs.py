"""The static inputs of captured steps: shapes (buckets), device buffers with pinned host twins,
and the host code that writes one step into them (`docs/cuda-graphs.md`).

Two kinds of step share the machinery:

- a *decode* shape (B rows, B sequences): every sequence adds one token; the graph computes
  logits for every row;
- a *mixed* shape (R rows, S sequences): prefill chunks beside decode rows, R a token bucket and
  S = min(R, the graphs' batch limit); the graph records the prefill launch over a tile map sized
  for R rows (`AttentionMetadata.prefill_tiles`) and gathers the rows that sample before the
  head, so its logits are [S, V].

A step is padded up to its shape: padding rows are token 0 at position 0 with KV slot -1 (no
write); padding sequences have no rows and no context; padding LoRA segments are empty, on the
device table's null slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from loraplex.layers.attention_metadata import AttentionMetadata
from loraplex.lora.backend import LoRABackend
from loraplex.lora.graph_inputs import SEGMENT_ROWS, LoRAGraphInputs
from loraplex.lora.weights import LoRASlotTable

_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
# token buckets of mixed steps: (step, up to): 64-row steps up to 384 rows, then coarser; a step
# of R rows pads to at most ~33% more (385 -> 512; compute-bound there), less where it is
# memory-bound. No 448-row bucket: at Llama-3-8B shapes on the H200, cuBLAS and cuBLASLt both
# pick slow kernels for 448 rows (a layer stack's GEMMs 13.8 ms, 10.8 ms at 512; docs/bench.md).
_TOKEN_STEPS = ((64, 384), (128, 1024), (256, 2048), (512, 4096), (1024, 1 << 30))
TILE_CODE_SEQ = 65536  # prefill tile map entry: sequence * 65536 + tile
MIN_MIXED_SEGMENTS = 16  # smallest LoRA segment capacity of a mixed shape: fewer graphs per bucket


def batch_bucket(n: int, max_batch: int) -> int | None:
    """The padded batch size a decode graph is captured for (None: too large for graphs)."""
    if n < 1 or n > max_batch:
        return None
    for b in _BUCKETS:
        if b >= n:
            return min(b, max_batch)
    return min(-(-n // 64) * 64, max_batch)  # past the table: multiples of 64


def token_bucket(n: int, max_tokens: int) -> int | None:
    """The padded row count a mixed-step graph is captured for (None: too many rows)."""
    if n < 1 or n > max_tokens:
        return None
    for step, upto in _TOKEN_STEPS:
        if n <= upto:
            return min(-(-n // step) * step, max_tokens)
    raise AssertionError("unreachable")


def token_buckets(max_tokens: int) -> list[int]:
    return sorted({b for n in range(1, max_tokens + 1) if (b := token_bucket(n, max_tokens))})


@dataclass(frozen=True)
class StepShape:
    rows: int
    seqs: int
    mixed: bool  # sequences may have several rows: prefill launch recorded, sampling rows gathered

    @classmethod
    def decode(cls, batch: int) -> StepShape:
        return cls(batch, batch, False)

    @classmethod
    def mixed_for(cls, rows: int, max_batch: int) -> StepShape:
        return cls(rows, min(rows, max_batch), True)


class StaticInputs:
    """Device buffers of one shape (plus pinned host twins), and the metadata views over them.

    int64 buffer: ids [R] | positions [R] | KV slots [R] | sample rows [S] (mixed) | the LoRA
    inputs' words (each part at an even word); int32 buffer: context lens [S] | query_start
    [S + 1] | block table [S, W] | prefill tile map [C] (mixed).
    """

    def __init__(
        self,
        shape: StepShape,
        width: int,
        device: torch.device,
        lora_table: LoRASlotTable,
        lora_backend: LoRABackend,
        tile_rows: int,
    ) -> None:
        r, s = shape.rows, shape.seqs
        self.shape, self.width, self.tile_rows = shape, width, tile_rows
        pin = device.type == "cuda"
        even = lambda n: n + (n & 1)  # noqa: E731
        sample_at = 3 * r
        lora_at = sample_at + (even(s) if shape.mixed else (r & 1))
        self.tile_cap = (-(-r // tile_rows) + s) if shape.mixed else 0
        table_at = 2 * s + 1
        tiles_at = table_at + s * width
        self.host64 = torch.zeros(lora_at + LoRAGraphInputs.words(r), dtype=torch.int64, pin_memory=pin)
        self.host32 = torch.zeros(tiles_at + self.tile_cap, dtype=torch.int32, pin_memory=pin)
        self.h64 = self.host64.numpy()
        self.h32 = self.host32.numpy()
        self.ids_h, self.pos_h, self.slots_h = (self.h64[i * r : (i + 1) * r] for i in range(3))
        self.sample_h = self.h64[sample_at : sample_at + s]
        self.ctx_h = self.h32[:s]
        self.qstart_h = self.h32[s:table_at]
        self.table = self.h32[table_at:tiles_at].reshape(s, width)
        # What each table row holds: (the block list it was written from, entries written). A
        # sequence's `block_ids` only grows in place (`extend`) or is replaced by a new list
        # (freed, or admitted with cached blocks), so the same list object with more entries needs
        # only its new tail written; anything else, the whole row. Holding the list keeps its
        # identity from being reused. A decode row's table is otherwise ~70 ints per row and step
        # at a 1k context (list -> int32 conversion: ~0.13 ms a step of 64 on the CPU).
        self._rows: list[tuple[list[int], int] | None] = [None] * s
        self.tiles_h = self.h32[tiles_at:]
        if not shape.mixed:
            self.qstart_h[:] = np.arange(s + 1)  # one query row per sequence, always
        self._uploaded = torch.cuda.Event() if pin else None  # the last upload's end
        self.dev64 = self.host64.to(device)
        self.dev32 = self.host32.to(device)
        d64, d32 = self.dev64, self.dev32
        self.ids = d64[:r]
        self.sample_rows = d64[sample_at : sample_at + s] if shape.mixed else None
        self.attn = AttentionMetadata(
            positions=d64[r : 2 * r],
            slot_mapping=d64[2 * r : 3 * r],
            query_start=tuple(range(s + 1)),  # the captured shape only (the device tensor is read)
            context_lens=(0,) * s,
            kv_indices=(),
            block_tables=(),
            block_table=d32[table_at:tiles_at].view(s, width),
            context_lens_t=d32[:s],
            query_start_t=d32[s:table_at],
            max_query_len=r if shape.mixed else 1,
            max_context_len=0,  # set per graph: the bound its decode launch is sized for
            num_decode_seqs=s,
            static=True,
            prefill_tiles=d32[tiles_at:] if shape.mixed else None,
            prefill_tile_rows=tile_rows if shape.mixed else 0,
        )
        # a mixed step's segments: each adapter's rows cut into row tiles, at most R / 16 + S
        caps = {}
        if shape.mixed:
            caps = dict(min_segments=MIN_MIXED_SEGMENTS, max_segments=r // SEGMENT_ROWS + s)
        self.lora = LoRAGraphInputs(r, self.h64[lora_at:], d64[lora_at:], lora_table, lora_backend, **caps)

    def upload(self) -> None:
        self.dev64.copy_(self.host64, non_blocking=True)
        self.dev32.copy_(self.host32, non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()

    def _writable(self) -> None:
        """Wait until the last upload has read the host buffers. One step ahead, the step using
        them last may be queued behind the one in flight; its copy runs as soon as that one ends,
        which the host has waited for by its next fill, so this wait is short or none."""
        if self._uploaded is not None:
            self._uploaded.synchronize()

    def fill_decode(self, chunks: tuple, block_size: int) -> list[tuple[int, Any]]:
        """A pure decode step's rows (one per chunk); the rest padding. Returns the rows at a
        pending position (row, sequence): their ids are written on the device."""
        self._writable()
        b, n, bs = self.shape.rows, len(chunks), block_size
        ids, pos_h, slots, ctx = self.ids_h, self.pos_h, self.slots_h, self.ctx_h
        pending: list[tuple[int, Any]] = []
        row = self._row
        for i, chunk in enumerate(chunks):
            seq = chunk.seq
            pos = seq.num_computed
            blocks = seq.block_ids
            row(i, seq, pos, blocks, bs, pending)
            ctx[i] = pos + 1
            self._table_row(i, blocks)
        ids[n:b] = 0
        pos_h[n:b] = 0
        slots[n:b] = -1
        ctx[n:b] = 0
        return pending

    def fill_mixed(
        self, chunks: tuple, slots_of: list[int], block_size: int
    ) -> tuple[list[tuple[int, int, int]], list[tuple[int, Any]]]:
        """A step's chunks, rows in chunk order; returns its LoRA runs (slot, first row, rows) and
        its rows at a pending position (as `fill_decode`). Sampling rows (the last row of each
        completing chunk) go to the front of `sample rows`."""
        self._writable()
        bs, tile_rows = block_size, self.tile_rows
        ids, pos_h, slots, ctx = self.ids_h, self.pos_h, self.slots_h, self.ctx_h
        qstart, tiles, sample = self.qstart_h, self.tiles_h, self.sample_h
        runs: list[tuple[int, int, int]] = []
        pending: list[tuple[int, Any]] = []
        row = n_tiles = n_sample = 0
        for i, (chunk, adapter_slot) in enumerate(zip(chunks, slots_of, strict=True)):
            seq = chunk.seq
            start = seq.num_computed
            n = chunk.num_tokens
            blocks = seq.block_ids
            qstart[i] = row
            ctx[i] = start + n
            self._table_row(i, blocks)
            if n == 1:  # a decode row: scalar writes (most chunks of a mixed step)
                self._row(row, seq, start, blocks, bs, pending)
            else:
                ids[row : row + n] = seq.tokens_between(start, start + n)
                pos = np.arange(start, start + n)
                pos_h[row : row + n] = pos
                slots[row : row + n] = np.asarray(blocks)[pos // bs] * bs + pos % bs
                k = -(-n // tile_rows)
                tiles[n_tiles : n_tiles + k] = i * TILE_CODE_SEQ + np.arange(k)
                n_tiles += k
            if chunk.completes:
                sample[n_sample] = row + n - 1
                n_sample += 1
            runs.append((adapter_slot, row, n))
            row += n
        n_seq = len(chunks)
        qstart[n_seq:] = row  # padding sequences: no rows
        ctx[n_seq:] = 0
        ids[row:] = 0
        pos_h[row:] = 0
        slots[row:] = -1
        tiles[n_tiles:] = -1
        sample[n_sample:] = 0  # gathered, never read
        return runs, pending

    def _table_row(self, i: int, blocks: list[int]) -> None:
        """Block table row i := blocks (see `_rows`: only what changed is written)."""
        n = len(blocks)
        held = self._rows[i]
        if held is not None and held[0] is blocks and n >= held[1]:
            if n > held[1]:
                self.table[i, held[1] : n] = blocks[held[1] :]
        else:
            self.table[i, :n] = blocks
        self._rows[i] = (blocks, n)

    def _row(self, row: int, seq: Any, pos: int, blocks: list[int], bs: int, pending: list) -> None:  # noqa: ANN401
        """One row at `pos` of `seq`: its id (0 and noted in `pending` at a pending position, whose
        id the device writes), position and KV slot."""
        if seq.pending:
            self.ids_h[row] = 0
            pending.append((row, seq))
        else:
            self.ids_h[row] = seq.token_at(pos)
        self.pos_h[row] = pos
        self.slots_h[row] = blocks[pos // bs] * bs + pos % bs

    def fill_empty(self) -> None:
        """An all-padding step: what a capture records with, so it changes no state."""
        if self.shape.mixed:
            self.fill_mixed((), [], 1)
        else:
            self.fill_decode((), 1)

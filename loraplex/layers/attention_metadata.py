"""What one step tells every attention layer (`AttentionMetadata`), and the choice of attention
implementation for a device (`attention_backend`).

Its own module because both implementations read it: `attention.py` (the dispatch and the torch
reference) and `attention_triton.py` (the kernels' launches), and the dispatch imports the kernels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loraplex.host_to_device import to_device


@dataclass(frozen=True)
class AttentionMetadata:
    """Per step, shared by every layer. Rows of one sequence are contiguous, in position order.

    The host tuples and `kv_indices` feed the torch reference; the device tensors after them feed
    the GPU kernels (`None` where the builder was told not to make them). The rows of sequence i
    sit at positions context_lens[i] - q_len .. context_lens[i] - 1 (q_len its query rows).
    """

    positions: torch.Tensor  # [T] int64: absolute position of each row
    slot_mapping: torch.Tensor  # [T] int64: flat cache slot (block * block_size + offset) per row
    query_start: tuple[int, ...]  # [S + 1] host: rows of sequence i are query_start[i]:query_start[i+1]
    context_lens: tuple[int, ...]  # [S] host: tokens in the cache for sequence i after this step
    kv_indices: tuple[torch.Tensor, ...]  # [S] of [context_len] int64: flat cache slots of positions 0..len-1
    block_tables: tuple[tuple[int, ...], ...]  # [S] block ids per sequence (host)
    block_table: torch.Tensor | None = None  # [S, max_blocks] int32, padded with block 0 (never read)
    context_lens_t: torch.Tensor | None = None  # [S] int32
    query_start_t: torch.Tensor | None = None  # [S + 1] int32
    max_query_len: int = 0  # most query rows of one sequence in this step
    max_context_len: int = 0
    num_decode_seqs: int = 0  # sequences with exactly one query row (the decode kernel's work)
    # A captured step (CUDA graph): the device tensors are views of the graph's input buffers,
    # rewritten before each replay; the host fields hold only the captured shape (max_context_len
    # and max_query_len are the bounds the launches were sized for). Padding rows have slot -1 and
    # no context.
    static: bool = False
    # A captured mixed step: [C] int32, the prefill launch's (sequence, query tile) per program
    # (s * 65536 + tile, -1: none), tiles of `prefill_tile_rows` rows; None: a grid of sequences x
    # the longest chunk's tiles.
    prefill_tiles: torch.Tensor | None = None
    prefill_tile_rows: int = 0

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @classmethod
    def build(
        cls,
        positions: Sequence[int],
        slot_mapping: Sequence[int],
        query_start: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str,
        for_kernels: bool | None = None,
    ) -> AttentionMetadata:
        """From host lists: the kernels' tensors in one int32 host tensor moved once (when
        `for_kernels`, by default where `attention_backend(device)` is "triton"), the reference's
        `kv_indices` as views of one flat int64 tensor moved once (otherwise)."""
        dev = torch.device(device)
        if for_kernels is None:
            for_kernels = attention_backend(dev) == "triton"
        n = len(context_lens)
        q_lens = [query_start[i + 1] - query_start[i] for i in range(n)]
        kernel_fields: dict = {}
        kv_indices: tuple[torch.Tensor, ...] = ()
        if for_kernels:
            width = max((len(t) for t in block_tables), default=0) or 1
            flat: list[int] = []
            for t in block_tables:
                flat.extend(t)
                flat.extend([0] * (width - len(t)))
            # Each part starts 16 bytes into the buffer (4 int32s): Triton specializes a kernel on
            # whether each pointer argument is 16-byte aligned, so offsets that vary with the
            # step's shape would compile new variants while serving.
            flat.extend([0] * (-len(flat) % 4))
            lens_at = len(flat)
            flat.extend(context_lens)
            flat.extend([0] * (-len(flat) % 4))
            starts_at = len(flat)
            packed = to_device(flat + list(query_start), torch.int32, dev)
            kernel_fields = dict(
                block_table=packed[: n * width].view(n, width),
                context_lens_t=packed[lens_at : lens_at + n],
                query_start_t=packed[starts_at:],
            )
        else:
            slots: list[int] = []
            for t, length in zip(block_tables, context_lens, strict=True):
                start = len(slots)
                for b in t[: -(-length // block_size)]:
                    slots.extend(range(b * block_size, (b + 1) * block_size))
                del slots[start + length :]
            flat_idx = to_device(slots, torch.int64, dev)
            kv_indices = tuple(flat_idx.split(list(context_lens)))
        # slot_mapping starts 16 bytes into the buffer (2 int64s), as above
        pad = [0] * (len(positions) % 2)
        rows = to_device(list(positions) + pad + list(slot_mapping), torch.int64, dev)
        return cls(
            positions=rows[: len(positions)],
            slot_mapping=rows[len(positions) + len(pad) :],
            query_start=tuple(query_start),
            context_lens=tuple(context_lens),
            kv_indices=kv_indices,
            block_tables=tuple(tuple(t) for t in block_tables),
            max_query_len=max(q_lens, default=0),
            max_context_len=max(context_lens, default=0),
            num_decode_seqs=sum(1 for q in q_lens if q == 1),
            **kernel_fields,
        )

    def live(self, block_size: int) -> AttentionMetadata:
        """Plain metadata of what a static step's device tensors hold now (a host sync), for the
        torch reference."""
        if not self.static:
            return self
        assert self.block_table is not None and self.context_lens_t is not None
        assert self.query_start_t is not None
        ctx = self.context_lens_t.tolist()
        tables = [row[: -(-c // block_size)] for row, c in zip(self.block_table.tolist(), ctx, strict=True)]
        return AttentionMetadata.build(
            self.positions.tolist(),
            self.slot_mapping.tolist(),
            self.query_start_t.tolist(),
            ctx,
            tables,
            block_size,
            self.positions.device,
            for_kernels=False,
        )


def attention_backend(device: torch.device | str) -> str:
    """Return "triton" on CUDA, "torch" elsewhere: the one place the attention implementation is chosen."""
    return "triton" if torch.device(device).type == "cuda" else "torch"

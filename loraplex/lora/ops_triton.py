"""Triton LoRA backend: the `TorchLoRABackend.apply` contract in two launches per group.

Per call (one decoder layer's qkv, o, gate_up or down): a shrink launch writes H = X_a A_a^T for
every segment and slice, an expand launch adds s_a H B_a^T into the base output. Decode-shaped
calls run the split launch (`_launch_split`: grids planned to fill the GPU, the two launches
chained by programmatic dependent launch); prefill-shaped calls, and decode-shaped ones the split
launch does not take, the two-launch pair. Nothing is launched when the step has no LoRA rows or
no adapter of the step adapts any slice of the group; a slice that no adapter of the step adapts
is compiled out.

triton is imported when the backend is constructed, never by `import loraplex.lora`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from loraplex.lora.layout import GROUP_SLICES
from loraplex.lora.metadata import LoRABatchMetadata
from loraplex.lora.triton_config import (
    DECODE,
    DecodeTiling,
    SplitPlan,
    TwoLaunchTiling,
    plan_split,
    row_loop_applies,
    split_cap,
)
from loraplex.lora.triton_plan import CallPlan, TritonStep, cdiv, group_call, new_step
from loraplex.lora.triton_table import GroupTables, LoRADeviceTable, target_bit
from loraplex.lora.weights import LoRASlotTable

_UNPLANNED = object()  # a call shape whose split plan is not made yet (None: no split plan fits)


class TritonLoRABackend:
    """Segmented, rank-exact, slice-fused LoRA op on the GPU (or the Triton interpreter on CPU)."""

    name = "triton"

    def __init__(self, tiling: TwoLaunchTiling | None = None) -> None:
        from loraplex.lora import triton_kernels  # lazy: needs triton

        self._k = triton_kernels
        # None: pick per step from the segment lengths (DECODE or PREFILL); a tiling: every step's
        # (the split launch where it is a DecodeTiling)
        self.tiling = tiling
        # Tests set this: the scratch H is filled with NaN first (one extra launch), so a block the
        # shrink kernel failed to write poisons the output instead of passing by luck.
        self.poison_scratch = False
        self.calls: Counter[str] = Counter()  # group name -> calls that launched the kernel pair
        self._tables: dict[torch.device, LoRADeviceTable] = {}
        self._sms: dict[torch.device, int] = {}
        self._step: TritonStep | None = None  # the current step's plan
        self._plans: dict[tuple, SplitPlan | None] = {}  # split grids per call shape (None: two launches)
        # the (layer, group) shapes already checked against the device tables' version
        self._checked: set[tuple] = set()
        self._checked_version = -1

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    @staticmethod
    def _table_key(device: torch.device | str) -> torch.device:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" are one table
            device = torch.device("cuda", torch.cuda.current_device())
        return device

    def device_table(self, device: torch.device | str) -> LoRADeviceTable:
        device = self._table_key(device)
        if device not in self._tables:
            self._tables[device] = LoRADeviceTable(device)
        return self._tables[device]

    def prepare(self, meta: LoRABatchMetadata, table: LoRASlotTable, device: torch.device | str) -> None:
        """Refresh the device tables and plan the step outside the timed/captured region.

        `apply` does this on its own; calling it first keeps host-to-device copies out of a
        CUDA-graph capture.
        """
        dev = self.device_table(device)
        dev.sync(table)
        self._step = new_step(meta, dev, self.tiling)

    def begin_step(
        self,
        meta: LoRABatchMetadata,
        table: LoRASlotTable,
        device: torch.device | str,
        replayed: bool | None = None,
    ) -> None:
        """Called once per forward, before its first `apply` (inside a CUDA-graph capture when
        the step is captured): plans the step, and when the row-loop expand may run, finds every
        row's segment; for a step whose calls run as graph replays (`replayed`; by default a step
        with static metadata or one being captured), gathers the split launch's per-step segment
        tables now, for every layer at once. An eager step does not: its calls would build views
        of the gathered tables per (layer, group) on the host, about 0.7 ms a step on a 32-layer
        model, for one dependent load fewer per kernel program. Calls of a step that did not
        begin this way plan it themselves, read the slot tables and find the rows' segments."""
        dev = self.device_table(device)
        dev.sync(table)
        step = self._step = new_step(meta, dev, self.tiling)
        tiling = self.tiling or DECODE
        if not isinstance(tiling, DecodeTiling) or meta.num_segments == 0:
            return
        if row_loop_applies(tiling, meta.num_lora_rows, meta.num_segments):
            self._row_segments(step, step_begins=True)  # the row-loop expand may run this step
        if replayed is None:
            capturing = torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()
            replayed = meta.static is not None or capturing
        if replayed:
            step.seg = dev.segment_tables(meta.seg_slots)

    def _row_segments(self, step: TritonStep, step_begins: bool = False) -> torch.Tensor:
        """[num_lora_rows] int32: the segment of every row of the segment order (num_segments for
        rows past the last segment), for the row-loop expand. Computed on the device once per
        step: by `begin_step` (inside the capture of a captured step, so replays recompute it from
        the live offsets), else by the first call that needs it."""
        meta = step.meta
        device = meta.seg_offsets.device
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        # A call's own copy made outside a capture that now uses it (a warm-up call of the same
        # plan) is made again inside, or the replays would read the warm-up's rows.
        if step.row_seg is not None and (step.row_seg_fixed or not capturing):
            return step.row_seg
        rows = torch.arange(meta.num_lora_rows, device=device)
        step.row_seg = torch.searchsorted(meta.seg_offsets[1:], rows, right=True).to(torch.int32)
        step.row_seg_fixed = step_begins or capturing
        return step.row_seg

    def graph_epoch(self, table: LoRASlotTable, device: torch.device | str) -> tuple[int, int]:
        """Bring the device tables up to date (in place where they fit) and return what a
        captured graph depends on: (tables' epoch, null slot). A graph recorded under another
        epoch reads freed tables and must be recaptured."""
        dev = self.device_table(device)
        dev.sync(table)
        return dev.epoch, dev.null_slot

    def _num_sms(self, device: torch.device) -> int:
        if device not in self._sms:
            cuda = device.type == "cuda"
            self._sms[device] = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 4
        return self._sms[device]

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
        # y: [T, d_out_total] base output, updated in place; x: [T, d_in]
        call = self._plan_call(x, meta, table, layer, group, slice_offsets)
        if call is None:
            return
        self._check_y(y, x, slice_offsets)
        tiling = call.g.tiling
        if (
            isinstance(tiling, DecodeTiling)
            and call.g.step.block_r <= tiling.split_max_rank
            and self._launch_split(y, x, meta, call, tiling, slice_offsets)
        ):
            self.calls[group] += 1
            return
        self._launch_expand(y, self._launch_shrink(x, meta, call), meta, call)
        self.calls[group] += 1

    def _plan_call(
        self,
        x: torch.Tensor,
        meta: LoRABatchMetadata,
        table: LoRASlotTable,
        layer: int,
        group: str,
        slice_offsets: Sequence[int],
    ) -> CallPlan | None:
        """Everything both launches need, from host values only; None when nothing is launched.
        An eager step calls this for every layer and group: what the calls of one group share is
        derived once per step, the shape checks once per (layer, group) and table version."""
        if meta.num_lora_rows == 0 or not meta.targets_group(layer, group):
            return None
        dev = self.device_table(x.device)
        dev.sync(table)
        step = self._step
        if step is None or step.meta is not meta or step.dev is not dev or step.version != dev.version:
            step = self._step = new_step(meta, dev, self.tiling)  # a step that did not begin here
        slices = GROUP_SLICES[group]
        slice_mask = 0
        for i, t in enumerate(slices):
            if step.coverage & target_bit(layer, t):
                slice_mask |= 1 << i
        if slice_mask == 0:
            return None
        offsets = tuple(slice_offsets)
        if dev.version != self._checked_version:
            self._checked, self._checked_version = set(), dev.version
        checked = (layer, group, x.device, x.dtype, x.shape[1], offsets, slice_mask)
        if checked not in self._checked:
            self._check(x, dev, layer, slices, slice_mask, offsets)
            self._checked.add(checked)
        if step.tiling is not self.tiling:  # a bench or test changed the tiling mid-step
            step.groups.clear()
            step.tiling = self.tiling
        key = (group, x.device, x.shape[1], offsets)
        g = step.groups.get(key)
        if g is None:
            g = step.groups[key] = group_call(
                step, x.shape[1], slices, offsets, self.tiling, self._num_sms(x.device)
            )
        seg = step.seg if isinstance(g.tiling, DecodeTiling) else None
        return CallPlan(g, dev.group(layer, group), slice_mask, seg.group(layer, group) if seg else None)

    def _launch_shrink(self, x: torch.Tensor, meta: LoRABatchMetadata, c: CallPlan) -> torch.Tensor:
        # h: [n_split, n_slices, R, BLOCK_R] float32; every block the expand reads is written first
        g = c.g
        k, dev, step, tiling = self._k, g.dev, g.step, g.tiling
        num_rows, d_in = meta.num_lora_rows, x.shape[1]
        h = self._scratch((g.split.n_split, g.n_slices, num_rows, step.block_r), x.device)
        k.lora_shrink_kernel[k.shrink_grid(g.n_segs * g.r_chunks, g.row_tiles, g.split.n_split)](
            x, dev.base, h, meta.row_perm, meta.seg_offsets, meta.seg_slots, c.tabs.a_offs, c.tabs.ranks,
            dev.n_slots, d_in, x.stride(0), num_rows, g.row_tiles, c.slice_mask, g.split.k_chunk,
            N_SLICES=g.n_slices, W_ALIGN=16 // dev.base.element_size(),
            BLOCK_M=tiling.block_m, BLOCK_K=tiling.block_k, BLOCK_R=step.block_r,
            BLOCK_RC=step.block_r // g.r_chunks, FOR_LOOP=x.device.type == "cuda",
            num_warps=tiling.shrink_warps, num_stages=tiling.shrink_stages,
        )  # fmt: skip
        return h

    def _launch_expand(self, y: torch.Tensor, h: torch.Tensor, meta: LoRABatchMetadata, c: CallPlan) -> None:
        g = c.g
        k, dev, step, tiling, cols = self._k, g.dev, g.step, g.tiling, g.cols
        grid = k.expand_grid(g.n_segs, g.row_tiles, cdiv(g.widest, tiling.n_chunk), g.n_slices)
        k.lora_expand_kernel[grid](
            y, dev.base, h, meta.row_perm, meta.seg_offsets, meta.seg_slots,
            c.tabs.b_offs, c.tabs.ranks, c.tabs.scales, dev.n_slots, y.stride(0), meta.num_lora_rows,
            g.row_tiles, *cols, c.slice_mask, g.split.n_split,
            N_SLICES=g.n_slices, W_ALIGN=16 // dev.base.element_size(),
            COLS_ALIGNED=all(v % 8 == 0 for v in cols),
            BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n, BLOCK_R=step.block_r,
            N_SPLIT=split_cap(g.split.n_split, tiling.max_split), N_CHUNK=tiling.n_chunk,
            num_warps=tiling.expand_warps, num_stages=tiling.expand_stages,
        )  # fmt: skip

    def _scratch(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        h = torch.empty(shape, dtype=torch.float32, device=device)
        if self.poison_scratch:
            h.fill_(float("nan"))
        return h

    def _launch_split(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        meta: LoRABatchMetadata,
        call: CallPlan,
        tiling: DecodeTiling,
        slice_offsets: Sequence[int],
    ) -> bool:
        """The call as the split launch when its grid fits the budget (`plan_split`, cached per
        call shape); False (nothing launched) otherwise, and the caller takes the two-launch path.
        The shrink launch, then the expand launch: no program waits on another, so nothing needs
        to be resident at once. With PDL (CUDA) the expand's programs start while the shrink runs
        and load their B tiles before they wait for it."""
        g = call.g
        dev, step, cols = g.dev, g.step, g.cols
        tiles = g.n_segs * g.row_tiles
        n_slices = len(slice_offsets) - 1
        d_in = x.shape[1]
        # each slice's width, 0 for slices nobody adapts
        widths = tuple(
            slice_offsets[i + 1] - slice_offsets[i] if call.slice_mask >> i & 1 else 0
            for i in range(n_slices)
        )
        key = (tiling, tiles, g.r_chunks, d_in, widths, step.block_r, x.device, x.dtype)
        cached = self._plans.get(key, _UNPLANNED)
        if cached is _UNPLANNED:
            sms = self._num_sms(x.device)
            cached = self._plans[key] = plan_split(tiling, tiles, g.r_chunks, d_in, widths, step.block_r, sms)
        if not isinstance(cached, SplitPlan):
            return False
        plan = cached
        h = self._scratch((plan.split.n_split, n_slices, meta.num_lora_rows, step.block_r), x.device)
        pdl = {"launch_pdl": True} if x.device.type == "cuda" else {}
        use_pdl = 1 if pdl else 0
        # per-step segment tables (one column per segment) when the step began with them
        tabs, n_cols = call.tabs, dev.n_slots
        if call.seg_tabs is not None:
            tabs, n_cols = call.seg_tabs, meta.num_segments
        n_split = plan.split.n_split
        common = dict(
            N_SLICES=g.n_slices, W_ALIGN=16 // dev.base.element_size(), BLOCK_M=tiling.block_m,
            BLOCK_R=step.block_r, USE_PDL=use_pdl, SEG_TABLES=call.seg_tabs is not None,
            num_stages=tiling.split_stages, **pdl,
        )  # fmt: skip
        # row tiles per segment as a power of two (a shift in the kernels; 1 or 2 at the decode
        # tiling, where this pads nothing); the plan is the one made for the real count
        row_shift = (g.row_tiles - 1).bit_length()
        tiles = g.n_segs << row_shift
        shrink_stages = tiling.shrink_stages_for(step.block_r, plan.split.k_chunk // tiling.block_k)
        self._k.lora_shrink_pdl_kernel[(tiles * g.r_chunks, n_split)](
            x, dev.base, h, meta.row_perm, meta.seg_offsets, meta.seg_slots, tabs.a_offs, tabs.ranks,
            n_cols, x.shape[1], x.stride(0), meta.num_lora_rows, row_shift, call.slice_mask,
            plan.split.k_chunk, BLOCK_K=tiling.block_k, BLOCK_RC=step.block_r // g.r_chunks,
            num_warps=tiling.split_shrink_warps, FOR_LOOP=x.device.type == "cuda",
            **dict(common, num_stages=shrink_stages),
        )  # fmt: skip
        # the expands' unrolled partial loads, bucketed (`split_cap`)
        common["N_SPLIT"] = split_cap(n_split, tiling.split_max_k_chunks)
        if row_loop_applies(tiling, meta.num_lora_rows, meta.num_segments, step.block_r, sum(widths)):
            expand = dict(common, num_warps=tiling.split_expand_warps)
            self._launch_expand_rows(y, h, meta, call, tiling, tabs, n_cols, widths, n_split, expand)
            return True
        ch = plan.chunks
        self._k.lora_expand_pdl_kernel[(tiles * sum(ch),)](
            y, dev.base, h, meta.row_perm, meta.seg_offsets, meta.seg_slots, tabs.b_offs, tabs.ranks,
            tabs.scales, n_cols, y.stride(0), meta.num_lora_rows, row_shift, *cols,
            ch[0], ch[0] + ch[1], sum(ch), n_split,
            COLS_ALIGNED=all(c % 8 == 0 for c in cols), BLOCK_N=plan.block_n,
            num_warps=tiling.split_expand_warps, **common,
        )  # fmt: skip
        return True

    def _launch_expand_rows(
        self,
        y: torch.Tensor,
        h: torch.Tensor,
        meta: LoRABatchMetadata,
        call: CallPlan,
        tiling: DecodeTiling,
        tabs: GroupTables,
        n_cols: int,
        widths: tuple[int, ...],
        n_split: int,
        common: dict,
    ) -> None:
        """The split launch's expand as the row-loop kernel: row tiles of the segment order
        (spanning segments) x column tiles of the adapted slices, `row_loop_block_n` columns each."""
        g = call.g
        cols = g.cols
        block_n = tiling.row_loop_block_n
        ch = [cdiv(w, block_n) for w in widths] + [0] * (3 - len(widths))
        num_rows = meta.num_lora_rows
        cuda = y.device.type == "cuda"
        self._k.lora_expand_rows_kernel[(cdiv(num_rows, tiling.block_m) * sum(ch),)](
            y, g.dev.base, h, meta.row_perm, self._row_segments(g.step), meta.seg_slots, tabs.b_offs,
            tabs.ranks, tabs.scales, n_cols, y.stride(0), num_rows, meta.num_segments, *cols,
            ch[0], ch[0] + ch[1], sum(ch), n_split,
            COLS_ALIGNED=all(c % 8 == 0 for c in cols), BLOCK_N=block_n, FOR_LOOP=cuda, TABLE_ASM=cuda,
            **common,
        )  # fmt: skip

    @staticmethod
    def _check(
        x: torch.Tensor,
        dev: LoRADeviceTable,
        layer: int,
        slices: tuple[str, ...],
        slice_mask: int,
        slice_offsets: Sequence[int],
    ) -> None:
        """Shape/dtype guards: the kernels trust these, and a mismatch would read out of bounds."""
        assert len(slice_offsets) == len(slices) + 1, (slices, slice_offsets)
        assert x.dtype == dev.dtype, (x.dtype, dev.dtype)
        assert x.stride(1) == 1
        for i, t in enumerate(slices):
            if slice_mask >> i & 1 and (layer, t) in dev.dims:  # absent: no adapter has it (rank 0)
                want = (x.shape[1], slice_offsets[i + 1] - slice_offsets[i])
                assert dev.dims[(layer, t)] == want, (layer, t, dev.dims[(layer, t)], want)

    @staticmethod
    def _check_y(y: torch.Tensor, x: torch.Tensor | None, slice_offsets: Sequence[int]) -> None:
        assert y.stride(1) == 1 and slice_offsets[-1] <= y.shape[1]
        if x is not None:
            assert y.dtype == x.dtype and y.shape[0] == x.shape[0], (y.dtype, x.dtype, y.shape, x.shape)

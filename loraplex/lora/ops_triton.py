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
from dataclasses import dataclass

import torch

from loraplex.lora.layout import GROUP_SLICES
from loraplex.lora.metadata import LoRABatchMetadata
from loraplex.lora.triton_config import (
    DECODE,
    DecodeTiling,
    ShrinkSplit,
    SplitPlan,
    TwoLaunchTiling,
    block_r_for,
    pick_tiling,
    plan_split,
    row_loop_applies,
    split_k,
)
from loraplex.lora.triton_table import GroupTables, LoRADeviceTable, SegmentTables, target_bit
from loraplex.lora.weights import LoRASlotTable


@dataclass(frozen=True)
class _StepInfo:
    """What every call of one step shares, derived once from the metadata (host values only)."""

    coverage: int  # OR of target bits over the step's slots
    block_r: int
    max_seg_rows: int


@dataclass(slots=True)
class _CallPlan:
    """One call's launch parameters, shared by its shrink and expand launches (built for every
    call of an eager step, hence a slots class: a fifth of a frozen dataclass's build time)."""

    dev: LoRADeviceTable
    step: _StepInfo
    tiling: TwoLaunchTiling
    tabs: GroupTables
    slice_mask: int
    n_slices: int
    n_segs: int
    row_tiles: int
    split: ShrinkSplit
    r_chunks: int
    cols: list[int]
    widest: int
    # the split launch's per-step segment tables of this (layer, group) (`begin_step`), if any
    seg_tabs: GroupTables | None = None

    def with_layer(self, tabs: GroupTables, slice_mask: int, seg_tabs: GroupTables | None) -> _CallPlan:
        """This group's call for one layer: its tables and adapted slices, the rest shared."""
        return _CallPlan(
            self.dev, self.step, self.tiling, tabs, slice_mask, self.n_slices, self.n_segs,
            self.row_tiles, self.split, self.r_chunks, self.cols, self.widest, seg_tabs,
        )  # fmt: skip


_UNPLANNED = object()  # a call shape whose split plan is not made yet (None: no split plan fits)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
        self._step_meta: LoRABatchMetadata | None = None
        self._step_version = -1
        self._step: _StepInfo | None = None
        self._plans: dict[tuple, SplitPlan | None] = {}  # split grids per call shape (None: two launches)
        # What every layer's call of one group shares within a step (tiling, split, columns), and
        # the (layer, group) shapes already checked against the device tables' version.
        self._call_cache: dict[tuple, _CallPlan] = {}
        self._call_cache_of: tuple[_StepInfo, TwoLaunchTiling | None] | None = None
        self._checked: set[tuple] = set()
        self._checked_version = -1
        # the step's segment tables (`begin_step`): (metadata, table version, tables)
        self._seg: tuple[LoRABatchMetadata, int, SegmentTables] | None = None
        # `_row_segments`: (metadata, rows' segments, whether begin_step or a capture made them)
        self._row_seg: tuple[LoRABatchMetadata, torch.Tensor, bool] | None = None

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
        """Refresh the device tables and the per-step info outside the timed/captured region.

        `apply` does this on its own; calling it first keeps host-to-device copies out of a
        CUDA-graph capture.
        """
        dev = self.device_table(device)
        dev.sync(table)
        self._step_info(meta, dev)

    def begin_step(
        self,
        meta: LoRABatchMetadata,
        table: LoRASlotTable,
        device: torch.device | str,
        replayed: bool | None = None,
    ) -> None:
        """Called once per forward, before its first `apply` (inside a CUDA-graph capture when
        the step is captured): when the row-loop expand may run, find every row's segment; for
        a step whose calls run as graph replays (`replayed`; by default a step with static
        metadata or one being captured), gather the split launch's per-step segment tables now,
        for every layer at once. An eager step does not: its calls would build views of the
        gathered tables per (layer, group) on the host, about 0.7 ms a step on a 32-layer model,
        for one dependent load fewer per kernel program. Calls of a step that did
        not begin this way read the slot tables and find the rows' segments themselves."""
        self._seg = self._row_seg = None
        tiling = self.tiling or DECODE
        if not isinstance(tiling, DecodeTiling) or meta.num_segments == 0:
            return
        if row_loop_applies(tiling, meta.num_lora_rows, meta.num_segments):
            self._row_segments(meta, step_begins=True)  # the row-loop expand may run this step
        if replayed is None:
            capturing = torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()
            replayed = meta.static is not None or capturing
        if not replayed:
            return
        dev = self.device_table(device)
        dev.sync(table)
        self._seg = (meta, dev.version, dev.segment_tables(meta.seg_slots))

    def _row_segments(self, meta: LoRABatchMetadata, step_begins: bool = False) -> torch.Tensor:
        """[num_lora_rows] int32: the segment of every row of the segment order (num_segments for
        rows past the last segment), for the row-loop expand. Computed on the device once per
        step: by `begin_step` (inside the capture of a captured step, so replays recompute it from
        the live offsets), else by the first call that needs it."""
        device = meta.seg_offsets.device
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        cached = self._row_seg
        # A call's own copy made outside a capture that now uses it (a warm-up call of the same
        # metadata) is made again inside, or the replays would read the warm-up's rows.
        if cached is not None and cached[0] is meta and (cached[2] or not capturing):
            return cached[1]
        rows = torch.arange(meta.num_lora_rows, device=device)
        row_seg = torch.searchsorted(meta.seg_offsets[1:], rows, right=True).to(torch.int32)
        self._row_seg = (meta, row_seg, step_begins or capturing)
        return row_seg

    def _segment_tables(self, meta: LoRABatchMetadata, dev: LoRADeviceTable) -> SegmentTables | None:
        seg = self._seg
        if seg is None or seg[0] is not meta or seg[1] != dev.version:
            return None
        return seg[2]

    def graph_epoch(self, table: LoRASlotTable, device: torch.device | str) -> tuple[int, int]:
        """Bring the device tables up to date (in place where they fit) and return what a
        captured graph depends on: (tables' epoch, null slot). A graph recorded under another
        epoch reads freed tables and must be recaptured."""
        dev = self.device_table(device)
        dev.sync(table)
        return dev.epoch, dev.null_slot

    def _step_info(self, meta: LoRABatchMetadata, dev: LoRADeviceTable) -> _StepInfo:
        if meta is self._step_meta and dev.version == self._step_version and self._step is not None:
            return self._step
        if meta.static is not None:
            # a captured step: every slice of every group (a replay's adapters are unknown; slices
            # of rank 0 read nothing), the rank tile and segment length it was recorded with
            self._step = _StepInfo(-1, meta.static.block_r, meta.static.max_rows)
            self._step_meta, self._step_version = meta, dev.version
            return self._step
        coverage, max_rank = 0, 0
        for slot in meta.seg_slots_host:
            if slot not in dev.slot_coverage:
                raise ValueError(f"segment refers to slot {slot}, which holds no adapter")
            coverage |= dev.slot_coverage[slot]
            max_rank = max(max_rank, dev.slot_max_rank[slot])
        offs = meta.seg_offsets_host
        max_rows = max((offs[s + 1] - offs[s] for s in range(len(offs) - 1)), default=0)
        self._step = _StepInfo(coverage, block_r_for(max_rank), max_rows)
        self._step_meta, self._step_version = meta, dev.version
        return self._step

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
        tiling = call.tiling
        if (
            isinstance(tiling, DecodeTiling)
            and call.step.block_r <= tiling.split_max_rank
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
    ) -> _CallPlan | None:
        """Everything both launches need, from host values only; None when nothing is launched.
        An eager step calls this for every layer and group: what the calls of one group share is
        derived once per step, the shape checks once per (layer, group) and table version."""
        if meta.num_lora_rows == 0 or not meta.targets_group(layer, group):
            return None
        dev = self.device_table(x.device)
        dev.sync(table)
        step = self._step_info(meta, dev)
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
        owner = self._call_cache_of
        if owner is None or owner[0] is not step or owner[1] is not self.tiling:
            self._call_cache, self._call_cache_of = {}, (step, self.tiling)
        shared = self._call_cache.get((group, x.device, x.shape[1], offsets))
        if shared is None:
            shared = self._group_call(x, meta, dev, step, slices, offsets)
            self._call_cache[(group, x.device, x.shape[1], offsets)] = shared
        seg = self._segment_tables(meta, dev) if isinstance(shared.tiling, DecodeTiling) else None
        seg_tabs = seg.group(layer, group) if seg is not None else None
        return shared.with_layer(dev.group(layer, group), slice_mask, seg_tabs)

    def _group_call(
        self,
        x: torch.Tensor,
        meta: LoRABatchMetadata,
        dev: LoRADeviceTable,
        step: _StepInfo,
        slices: tuple[str, ...],
        slice_offsets: tuple[int, ...],
    ) -> _CallPlan:
        """The parts of a call that every layer's call of this group shares in a step (tabs and
        slice mask are the caller's to fill in)."""
        tiling = self.tiling or pick_tiling(step.max_seg_rows)
        n_segs = meta.num_segments
        row_tiles = _cdiv(step.max_seg_rows, tiling.block_m)
        return _CallPlan(
            dev=dev,
            step=step,
            tiling=tiling,
            tabs=None,  # type: ignore[arg-type]
            slice_mask=0,
            n_slices=len(slices),
            n_segs=n_segs,
            row_tiles=row_tiles,
            split=split_k(tiling, x.shape[1], n_segs * row_tiles, self._num_sms(x.device)),
            r_chunks=step.block_r // min(step.block_r, tiling.shrink_block_r),
            cols=list(slice_offsets) + [slice_offsets[-1]] * (4 - len(slice_offsets)),
            widest=max(slice_offsets[i + 1] - slice_offsets[i] for i in range(len(slices))),
        )

    def _launch_shrink(self, x: torch.Tensor, meta: LoRABatchMetadata, c: _CallPlan) -> torch.Tensor:
        # h: [n_split, n_slices, R, BLOCK_R] float32; every block the expand reads is written first
        k, dev, step, tiling = self._k, c.dev, c.step, c.tiling
        num_rows, d_in = meta.num_lora_rows, x.shape[1]
        h = self._scratch((c.split.n_split, c.n_slices, num_rows, step.block_r), x.device)
        k.lora_shrink_kernel[k.shrink_grid(c.n_segs * c.r_chunks, c.row_tiles, c.split.n_split)](
            x, dev.base, h, meta.row_perm, meta.seg_offsets, meta.seg_slots, c.tabs.a_offs, c.tabs.ranks,
            dev.n_slots, d_in, x.stride(0), num_rows, c.row_tiles,
            N_SLICES=c.n_slices, SLICE_MASK=c.slice_mask, RANK_ALIGNED=dev.rank_aligned,
            W_ALIGN=16 // dev.base.element_size(),
            BLOCK_M=tiling.block_m, BLOCK_K=tiling.block_k, BLOCK_R=step.block_r,
            BLOCK_RC=step.block_r // c.r_chunks, K_CHUNK=c.split.k_chunk,
            num_warps=tiling.shrink_warps, num_stages=tiling.shrink_stages,
        )  # fmt: skip
        return h

    def _launch_expand(self, y: torch.Tensor, h: torch.Tensor, meta: LoRABatchMetadata, c: _CallPlan) -> None:
        k, dev, step, tiling, cols = self._k, c.dev, c.step, c.tiling, c.cols
        grid = k.expand_grid(c.n_segs, c.row_tiles, _cdiv(c.widest, tiling.n_chunk), c.n_slices)
        k.lora_expand_kernel[grid](
            y, dev.base, h, meta.row_perm, meta.seg_offsets, meta.seg_slots,
            c.tabs.b_offs, c.tabs.ranks, c.tabs.scales, dev.n_slots, y.stride(0), meta.num_lora_rows,
            c.row_tiles, *cols,
            N_SLICES=c.n_slices, SLICE_MASK=c.slice_mask, RANK_ALIGNED=dev.rank_aligned,
            W_ALIGN=16 // dev.base.element_size(), COLS_ALIGNED=all(v % 8 == 0 for v in cols),
            BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n, BLOCK_R=step.block_r,
            N_SPLIT=c.split.n_split, N_CHUNK=tiling.n_chunk,
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
        call: _CallPlan,
        tiling: DecodeTiling,
        slice_offsets: Sequence[int],
    ) -> bool:
        """The call as the split launch when its grid fits the budget (`plan_split`, cached per
        call shape); False (nothing launched) otherwise, and the caller takes the two-launch path.
        The shrink launch, then the expand launch: no program waits on another, so nothing needs
        to be resident at once. With PDL (CUDA) the expand's programs start while the shrink runs
        and load their B tiles before they wait for it."""
        dev, step, cols = call.dev, call.step, call.cols
        tiles = call.n_segs * call.row_tiles
        n_slices = len(slice_offsets) - 1
        d_in = x.shape[1]
        # each slice's width, 0 for slices nobody adapts
        widths = tuple(
            slice_offsets[i + 1] - slice_offsets[i] if call.slice_mask >> i & 1 else 0
            for i in range(n_slices)
        )
        key = (tiling, tiles, call.r_chunks, d_in, widths, step.block_r, x.device, x.dtype)
        cached = self._plans.get(key, _UNPLANNED)
        if cached is _UNPLANNED:
            sms = self._num_sms(x.device)
            cached = self._plans[key] = plan_split(
                tiling, tiles, call.r_chunks, d_in, widths, step.block_r, sms
            )
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
        common = dict(
            N_SLICES=call.n_slices, RANK_ALIGNED=dev.rank_aligned, W_ALIGN=16 // dev.base.element_size(),
            BLOCK_M=tiling.block_m, BLOCK_R=step.block_r, N_SPLIT=plan.split.n_split, USE_PDL=use_pdl,
            SEG_TABLES=call.seg_tabs is not None, num_stages=tiling.split_stages, **pdl,
        )  # fmt: skip
        shrink_stages = tiling.shrink_stages_for(step.block_r, plan.split.k_chunk // tiling.block_k)
        self._k.lora_shrink_pdl_kernel[(plan.n_shrink,)](
            x, dev.base, h, meta.row_perm, meta.seg_offsets, meta.seg_slots, tabs.a_offs, tabs.ranks,
            n_cols, x.shape[1], x.stride(0), meta.num_lora_rows, call.row_tiles,
            SLICE_MASK=call.slice_mask, BLOCK_K=tiling.block_k, BLOCK_RC=step.block_r // call.r_chunks,
            K_CHUNK=plan.split.k_chunk, num_warps=tiling.split_shrink_warps,
            **dict(common, num_stages=shrink_stages),
        )  # fmt: skip
        if row_loop_applies(tiling, meta.num_lora_rows, meta.num_segments, step.block_r, sum(widths)):
            expand = dict(common, num_warps=tiling.split_expand_warps)
            self._launch_expand_rows(y, h, meta, call, tiling, tabs, n_cols, widths, expand)
            return True
        ch = plan.chunks
        self._k.lora_expand_pdl_kernel[(plan.n_expand,)](
            y, dev.base, h, meta.row_perm, meta.seg_offsets, meta.seg_slots, tabs.b_offs, tabs.ranks,
            tabs.scales, n_cols, y.stride(0), meta.num_lora_rows, call.row_tiles, *cols,
            ch[0], ch[0] + ch[1], sum(ch),
            COLS_ALIGNED=all(c % 8 == 0 for c in cols), BLOCK_N=plan.block_n,
            num_warps=tiling.split_expand_warps, **common,
        )  # fmt: skip
        return True

    def _launch_expand_rows(
        self,
        y: torch.Tensor,
        h: torch.Tensor,
        meta: LoRABatchMetadata,
        call: _CallPlan,
        tiling: DecodeTiling,
        tabs: GroupTables,
        n_cols: int,
        widths: tuple[int, ...],
        common: dict,
    ) -> None:
        """The split launch's expand as the row-loop kernel: row tiles of the segment order
        (spanning segments) x column tiles of the adapted slices, `row_loop_block_n` columns each."""
        cols = call.cols
        block_n = tiling.row_loop_block_n
        ch = [_cdiv(w, block_n) for w in widths] + [0] * (3 - len(widths))
        num_rows = meta.num_lora_rows
        cuda = y.device.type == "cuda"
        self._k.lora_expand_rows_kernel[(_cdiv(num_rows, tiling.block_m) * sum(ch),)](
            y, call.dev.base, h, meta.row_perm, self._row_segments(meta), meta.seg_slots, tabs.b_offs,
            tabs.ranks, tabs.scales, n_cols, y.stride(0), num_rows, meta.num_segments, *cols,
            ch[0], ch[0] + ch[1], sum(ch),
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

"""The Triton backend's launch plans, from host values only: a step's (`TritonStep`: what every call
of the step shares), a group's within a step (`GroupCall`: what every layer's call of one group
shares) and a call's (`CallPlan`). `ops_triton.py` makes them and launches from them; nothing here
launches or needs triton.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loraplex.lora.metadata import LoRABatchMetadata
from loraplex.lora.triton_config import ShrinkSplit, TwoLaunchTiling, block_r_for, pick_tiling, split_k
from loraplex.lora.triton_table import GroupTables, LoRADeviceTable, SegmentTables


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class TritonStep:
    """One step's plan: what every call of the step shares, made once per step by `begin_step`
    (or by the first call of a step that did not begin so). Host values, plus the device tensors
    the step's launches read besides the metadata."""

    meta: LoRABatchMetadata
    dev: LoRADeviceTable
    version: int  # the device tables' version the plan was made against
    coverage: int  # OR of target bits over the step's slots (-1: every slice, a captured step)
    block_r: int
    max_seg_rows: int
    tiling: TwoLaunchTiling | None  # the backend's tiling when the plan was made
    # the split launch's segment tables, gathered once for every layer (replayed steps only)
    seg: SegmentTables | None = None
    # every row's segment (`_row_segments`), and whether it was made by begin_step or in a capture
    row_seg: torch.Tensor | None = None
    row_seg_fixed: bool = False
    # what every layer's call of one group shares, per (group, device, d_in, slice offsets)
    groups: dict[tuple, GroupCall] = field(default_factory=dict)


@dataclass(slots=True)
class GroupCall:
    """The launch parameters every layer's call of one group shares within a step."""

    dev: LoRADeviceTable
    step: TritonStep
    tiling: TwoLaunchTiling
    n_slices: int
    n_segs: int
    row_tiles: int
    split: ShrinkSplit
    r_chunks: int
    cols: list[int]
    widest: int


@dataclass(slots=True)
class CallPlan:
    """One call: its group's shared parameters and this layer's tables and adapted slices (built
    for every call of an eager step, hence a small slots class)."""

    g: GroupCall
    tabs: GroupTables
    slice_mask: int
    # the split launch's per-step segment tables of this (layer, group) (`begin_step`), if any
    seg_tabs: GroupTables | None


def new_step(meta: LoRABatchMetadata, dev: LoRADeviceTable, tiling: TwoLaunchTiling | None) -> TritonStep:
    """The plan of the step `meta` describes, against the device tables as they are now;
    `tiling` is the backend's (None: picked per group call)."""
    if meta.static is not None:
        # a captured step: every slice of every group (a replay's adapters are unknown; slices
        # of rank 0 read nothing), the rank tile and segment length it was recorded with
        static = meta.static
        return TritonStep(meta, dev, dev.version, -1, static.block_r, static.max_rows, tiling)
    coverage, max_rank = 0, 0
    for slot in meta.seg_slots_host:
        if slot not in dev.slot_coverage:
            raise ValueError(f"segment refers to slot {slot}, which holds no adapter")
        coverage |= dev.slot_coverage[slot]
        max_rank = max(max_rank, dev.slot_max_rank[slot])
    offs = meta.seg_offsets_host
    max_rows = max((offs[s + 1] - offs[s] for s in range(len(offs) - 1)), default=0)
    return TritonStep(meta, dev, dev.version, coverage, block_r_for(max_rank), max_rows, tiling)


def group_call(
    step: TritonStep,
    d_in: int,
    slices: tuple[str, ...],
    slice_offsets: tuple[int, ...],
    tiling: TwoLaunchTiling | None,
    num_sms: int,
) -> GroupCall:
    """The parts of a call that every layer's call of this group shares in a step; `tiling` the
    backend's (None: by the step's longest segment)."""
    tiling = tiling or pick_tiling(step.max_seg_rows, step.meta.num_segments)
    n_segs = step.meta.num_segments
    row_tiles = cdiv(step.max_seg_rows, tiling.block_m)
    return GroupCall(
        dev=step.dev,
        step=step,
        tiling=tiling,
        n_slices=len(slices),
        n_segs=n_segs,
        row_tiles=row_tiles,
        split=split_k(tiling, d_in, n_segs * row_tiles, num_sms),
        r_chunks=step.block_r // min(step.block_r, tiling.shrink_block_r),
        cols=list(slice_offsets) + [slice_offsets[-1]] * (4 - len(slice_offsets)),
        widest=max(slice_offsets[i + 1] - slice_offsets[i] for i in range(len(slices))),
    )

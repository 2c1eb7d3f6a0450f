"""Triton LoRA kernels against the torch reference, on the CPU through the Triton interpreter.

Small shapes, so the whole file runs in a few seconds. Skipped without triton; skipped on
machines with CUDA (the GPU tests cover the same ground there, and the interpreter switch is
process-wide, so it is only set where there is no GPU to leak into).
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernels' import: @triton.jit reads it
pytest.importorskip("triton")
# Not a module-level skip: that would show as a skip in `pytest -m gpu` runs, which select none of these.
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CUDA present: test_triton_gpu.py covers this"
)

from lora.lora_cases import (  # noqa: E402
    SMALL_SHAPES,
    make_table,
    random_adapter,
    random_ranks,
    reference,
    row_errors,
    slice_offsets,
)
from loraplex.adapters.device_pool import AdapterPool  # noqa: E402
from loraplex.adapters.host_cache import HostCache  # noqa: E402
from loraplex.adapters.residency import AdapterResidency  # noqa: E402
from loraplex.bench.popularity import POPULARITIES, adapter_choices  # noqa: E402
from loraplex.lora.metadata import LoRABatchMetadata, StaticLoRAShape  # noqa: E402
from loraplex.lora.ops_triton import TritonLoRABackend  # noqa: E402
from loraplex.lora.triton_config import DECODE, PREFILL, DecodeTiling  # noqa: E402
from loraplex.lora.weights import AdapterWeights, LoRAPair, LoRASlotTable  # noqa: E402

DTYPE = torch.float32  # the interpreter runs fp32/fp16 only
# The split launch at these tiny sizes: K split in chunks of >= 2 steps of 16, 16-column expand
# tiles; at rank tile 16 the budget is 2 programs per SM, so `sms` bounds the K split.
SMALL_DECODE = replace(DECODE, block_k=16, split_block_n=16)
# ... with the row-loop expand for every group and rank tile (16-column tiles)
ROW_LOOP_DECODE = replace(SMALL_DECODE, row_loop_min_width=1, row_loop_max_rank=64, row_loop_block_n=16)
# The two-launch path on decode-shaped steps (split K even at these sizes, so the partial-sum path
# is exercised too): no rank tile is small enough for the split launch.
SPLIT_DECODE = replace(DECODE, block_k=16, max_split=4, split_max_rank=0)
SMALL_PREFILL = replace(PREFILL, block_m=16, block_k=16, block_n=32, n_chunk=64)
CPU = torch.device("cpu")


def _backend(tiling=None, sms: int = 4) -> TritonLoRABackend:  # noqa: ANN001
    be = TritonLoRABackend(tiling)
    be.poison_scratch = True
    be._sms[CPU] = sms  # the grid budget (programs per SM x SMs) the plans are made for
    return be


def _split_plans(be: TritonLoRABackend) -> list:
    return [p for p in be._plans.values() if p is not None]


def _seg_tables(be: TritonLoRABackend, meta: LoRABatchMetadata) -> object:
    """The current step plan's gathered segment tables, if the plan is `meta`'s."""
    step = be._step
    return step.seg if step is not None and step.meta is meta else None


def _check_all_groups(
    be: TritonLoRABackend,
    slots: list[int],
    table,  # noqa: ANN001
    seed: int = 0,
    groups: tuple[str, ...] = tuple(SMALL_SHAPES),
    replayed: bool = True,
) -> None:
    meta = LoRABatchMetadata.build(slots, table)
    be.begin_step(meta, table, CPU, replayed=replayed)  # as a captured step begins (or an eager one)
    if isinstance(be.tiling or DECODE, DecodeTiling):
        assert (_seg_tables(be, meta) is not None) == replayed
    gen = torch.Generator().manual_seed(seed)
    base_rows = [i for i, s in enumerate(slots) if s == -1]
    for group in groups:
        d_in, widths = SMALL_SHAPES[group]
        offs = slice_offsets(widths)
        x = torch.randn(len(slots), d_in, generator=gen, dtype=DTYPE)
        y0 = torch.randn(len(slots), offs[-1], generator=gen, dtype=DTYPE)  # poison: never zeros
        y = y0.clone()
        be.apply(y, x, meta, table, 0, group, offs)
        y_ref = reference(y0, x, meta, table, 0, group, offs)
        lora_rows = [i for i, s in enumerate(slots) if s != -1]
        assert row_errors(y[lora_rows], y_ref[lora_rows]).max() <= 1e-4, group
        assert torch.equal(y[base_rows], y0[base_rows]), group


@pytest.mark.parametrize("popularity", POPULARITIES)
def test_popularity_mixed_ranks(popularity: str) -> None:
    ranks = random_ranks(5, (8, 16, 32, 64), seed=1)
    table = make_table(ranks, DTYPE, "cpu", seed=2)
    slots = adapter_choices(12, len(ranks), popularity, seed=3)
    slots[5] = -1  # one base-only row in the middle
    # the fused groups (three and two slices); o and down run in the other tests
    _check_all_groups(_backend(SPLIT_DECODE), slots, table, groups=("qkv", "gate_up"))


def test_prefill_tiling_long_segments_and_segments_of_one() -> None:
    table = make_table([16, 8, 32], DTYPE, "cpu", seed=4)
    slots = [0] * 35 + [-1] * 3 + [1] + [2] * 18 + [1]  # long, length-1, and split segments
    _check_all_groups(_backend(SMALL_PREFILL), slots, table)


def test_default_tiling_picks_per_step() -> None:
    table = make_table([8, 16], DTYPE, "cpu", seed=5)
    be = _backend()

    def tilings() -> set:
        assert be._step is not None
        return {g.tiling for g in be._step.groups.values()}

    _check_all_groups(be, [0, 1, -1, 1], table)  # decode-shaped
    assert tilings() == {DECODE}
    # one popular adapter's long segment (5 row tiles, padded to 8) and a short one: still the
    # decode tiling, its split launch running several row tiles per segment
    _check_all_groups(be, [0] * 70 + [-1] + [1] * 3, table)
    assert tilings() == {DECODE}
    _check_all_groups(be, [0] * 300 + [1] * 3, table)  # prefill-shaped: 2 x 32 row tiles
    assert tilings() == {PREFILL}


def test_partial_targets_leave_untargeted_slices_untouched() -> None:
    # adapter 0 adapts q and up only, adapter 1 only v: k and gate columns must stay bit-identical
    table = make_table([16, 8], DTYPE, "cpu", seed=6, targets=[("q", "up"), ("v",)])
    slots = [0, 1, 0, 1, -1]
    meta = LoRABatchMetadata.build(slots, table)
    be = _backend(SPLIT_DECODE)
    x = torch.randn(5, 64)
    offs = slice_offsets(SMALL_SHAPES["qkv"][1])
    y0 = torch.randn(5, offs[-1])
    y = y0.clone()
    be.apply(y, x, meta, table, 0, "qkv", offs)
    assert torch.equal(y[:, offs[1] : offs[2]], y0[:, offs[1] : offs[2]])  # k
    y_ref = reference(y0, x, meta, table, 0, "qkv", offs)
    assert row_errors(y[:4], y_ref[:4]).max() <= 1e-4
    # o and down are adapted by no one: the backend launches nothing for them
    for group in ("o", "down"):
        d_in, widths = SMALL_SHAPES[group]
        before = be.total_calls
        yo = torch.randn(5, sum(widths))
        keep = yo.clone()
        be.apply(yo, torch.randn(5, d_in), meta, table, 0, group, slice_offsets(widths))
        assert be.total_calls == before and torch.equal(yo, keep)


KERNELS = (
    "lora_shrink_kernel",
    "lora_expand_kernel",
    "lora_shrink_pdl_kernel",
    "lora_expand_pdl_kernel",
    "lora_expand_rows_kernel",
)


class Boom:
    def __getitem__(self, grid):  # noqa: ANN001, ANN204
        raise AssertionError("kernel launched where none should be")


def test_no_lora_rows_launches_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    table = make_table([16], DTYPE, "cpu")
    meta = LoRABatchMetadata.build([-1, -1, -1], table)
    be = _backend()
    for name in KERNELS:
        monkeypatch.setattr(be._k, name, Boom())
    y = torch.randn(3, 128)
    be.begin_step(meta, table, CPU)
    for group, (d_in, widths) in SMALL_SHAPES.items():
        be.apply(y[:, : sum(widths)], torch.randn(3, d_in), meta, table, 0, group, slice_offsets(widths))
    assert be.total_calls == 0


def test_table_refresh_on_version_change_and_unaligned_weights() -> None:
    table = make_table([16, 8], DTYPE, "cpu", seed=7)
    be = _backend(SPLIT_DECODE)
    slots = [1, 0, 1]
    _check_all_groups(be, slots, table)
    # Replace slot 1 by an adapter whose tensors are unaligned, non-contiguous views.
    old = table.weights(1)
    pairs = {}
    for key, p in old.pairs.items():
        a_big = torch.randn(p.a.shape[0], p.a.shape[1] + 1)
        b_big = torch.randn(p.b.shape[1], p.b.shape[0])
        pairs[key] = LoRAPair(a_big[:, 1:], b_big.T, 2.0)  # offset by one element / transposed
    table.set(1, AdapterWeights(pairs))
    _check_all_groups(be, slots, table, seed=1)


def test_mixed_layers_use_each_layers_weights() -> None:
    table = make_table([16, 32], DTYPE, "cpu", num_layers=2, seed=8)
    slots = [0, 1, 1, 0]
    meta = LoRABatchMetadata.build(slots, table)
    be = _backend(SPLIT_DECODE)
    d_in, widths = SMALL_SHAPES["gate_up"]
    offs = slice_offsets(widths)
    x = torch.randn(4, d_in)
    y0 = torch.randn(4, offs[-1])
    for layer in (0, 1):
        y = y0.clone()
        be.apply(y, x, meta, table, layer, "gate_up", offs)
        assert row_errors(y, reference(y0, x, meta, table, layer, "gate_up", offs)).max() <= 1e-4


# --- the split launch (decode) ---------------------------------------------------------------------


@pytest.mark.parametrize("replayed", [True, False], ids=["segment-tables", "slot-tables"])
@pytest.mark.parametrize("tiling", [SMALL_DECODE, ROW_LOOP_DECODE], ids=["expand", "row-loop-expand"])
@pytest.mark.parametrize("popularity", POPULARITIES)
def test_split_launch_popularity_mixed_ranks(popularity: str, tiling, replayed: bool) -> None:  # noqa: ANN001
    # a step run as graph replays reads the per-step segment tables, an eager one the slot tables
    ranks = random_ranks(6, (8, 16, 32, 64), seed=11)
    table = make_table(ranks, DTYPE, "cpu", seed=12)
    slots = adapter_choices(14, len(ranks), popularity, seed=13)
    slots[4] = -1
    be = _backend(tiling, sms=8)
    _check_all_groups(be, slots, table, replayed=replayed)
    plans = _split_plans(be)
    assert len(plans) == 4 and any(p.split.n_split > 1 for p in plans)


@pytest.mark.parametrize("tiling", [SMALL_DECODE, ROW_LOOP_DECODE], ids=["expand", "row-loop-expand"])
def test_split_launch_segments_of_one_row_and_tail_tiles(tiling) -> None:  # noqa: ANN001
    # 9 adapters of one row each, plus one 20-row segment: two row tiles per segment, the second
    # one empty for every short segment; at rank tile 16 (the row loop's) too
    for ranks in (random_ranks(10, (8, 16, 32, 64), seed=14), [16, 8] * 5):
        table = make_table(ranks, DTYPE, "cpu", seed=15)
        slots = [0, 1, 2, -1, 3, 4, 5, 6, 7, 8] + [9] * 20 + [-1]
        be = _backend(tiling, sms=16)
        _check_all_groups(be, slots, table)
        assert len(_split_plans(be)) == 4


def test_split_launch_partial_targets_and_repeated_calls() -> None:
    # adapter 0 adapts q and up only, adapter 1 only v: compiled-out slices get no programs
    table = make_table([16, 8], DTYPE, "cpu", seed=17, targets=[("q", "up"), ("v",)])
    be = _backend(SMALL_DECODE, sms=8)
    for seed in range(3):  # later calls (plans cached) are as right as the first
        _check_all_groups(be, [0, 1, 0, 1, -1], table, seed=seed, groups=("qkv", "gate_up"))
    x = torch.randn(5, 64)
    offs = slice_offsets(SMALL_SHAPES["qkv"][1])
    y0 = torch.randn(5, offs[-1])
    y = y0.clone()
    meta = LoRABatchMetadata.build([0, 1, 0, 1, -1], table)
    be.apply(y, x, meta, table, 0, "qkv", offs)
    assert torch.equal(y[:, offs[1] : offs[2]], y0[:, offs[1] : offs[2]])  # k: nobody adapts it
    (plan,) = [p for k, p in be._plans.items() if k[4] == (64, 0, 32)]
    assert plan.chunks[1] == 0


def test_calls_are_planned_per_step_and_tiling() -> None:
    # the per-step cache of what a group's calls share: a new step (other adapters, so other
    # adapted slices and segments) or a new tiling must not reuse the previous step's plan, and
    # the calls of two layers share one entry
    table = make_table([16, 8], DTYPE, "cpu", num_layers=2, seed=41, targets=[("q",), ("k", "v")])
    be = _backend(SMALL_DECODE, sms=8)
    d_in, widths = SMALL_SHAPES["qkv"]
    offs = slice_offsets(widths)
    cases = (([0, 0, -1], SMALL_DECODE), ([1, 0, 1, 1], SMALL_DECODE), ([1, 0, 1, 1], SPLIT_DECODE))
    for slots, tiling in cases:
        be.tiling = tiling
        meta = LoRABatchMetadata.build(slots, table)
        for layer in (0, 1):
            x = torch.randn(len(slots), d_in, dtype=DTYPE)
            y0 = torch.randn(len(slots), offs[-1], dtype=DTYPE)
            y = y0.clone()
            be.apply(y, x, meta, table, layer, "qkv", offs)
            assert row_errors(y, reference(y0, x, meta, table, layer, "qkv", offs)).max() <= 1e-4
        assert be._step is not None and be._step.meta is meta
        (shared,) = be._step.groups.values()
        assert shared.tiling is tiling and shared.n_segs == meta.num_segments


def test_split_launch_falls_back_to_two_launches_when_the_grid_is_too_large(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    table = make_table([16, 64], DTYPE, "cpu", seed=18)
    # one program per SM on 2 SMs: fewer than the row tiles x rank chunks of one K chunk
    be = _backend(replace(SMALL_DECODE, split_per_sm=1, split_narrow_per_sm=1, split_long_k_per_sm=1), sms=2)
    for name in ("lora_shrink_pdl_kernel", "lora_expand_pdl_kernel", "lora_expand_rows_kernel"):
        monkeypatch.setattr(be._k, name, Boom())
    _check_all_groups(be, [0, 1, 1, -1, 0], table)
    assert be._plans and not _split_plans(be)


def _static_meta(slots: list[int], null_slot: int, cap: int, block_r: int) -> LoRABatchMetadata:
    """The metadata of a captured decode step, as `engine/cuda_graphs.py` writes it: segments of
    at most 16 rows, padded with empty segments on the null slot up to `cap`."""
    segs: list[tuple[int, list[int]]] = []
    by_slot: dict[int, list[int]] = {}
    for row, s in enumerate(slots):
        if s != -1:
            by_slot.setdefault(s, []).append(row)
    for s, rows in by_slot.items():
        segs += [(s, rows[i : i + 16]) for i in range(0, len(rows), 16)]
    perm = [r for _, rows in segs for r in rows] + [0] * (len(slots) - sum(len(r) for _, r in segs))
    offsets = [0]
    for _, rows in segs:
        offsets.append(offsets[-1] + len(rows))
    offsets += [offsets[-1]] * (cap - len(segs))
    return LoRABatchMetadata(
        num_rows=len(slots),
        row_perm=torch.tensor(perm),
        seg_offsets=torch.tensor(offsets),
        seg_slots=torch.tensor([s for s, _ in segs] + [null_slot] * (cap - len(segs))),
        seg_offsets_host=(),
        seg_slots_host=(),
        active_groups=frozenset(),
        static=StaticLoRAShape(rows=len(slots), segments=cap, block_r=block_r, max_rows=16),
    )


@pytest.mark.parametrize(
    "tiling", [DECODE, SMALL_DECODE, ROW_LOOP_DECODE, SPLIT_DECODE],
    ids=["default", "split-launch", "split-launch-row-loop", "two-launch"],
)  # fmt: skip
def test_static_metadata_reads_live_mapping_and_weights(tiling) -> None:  # noqa: ANN001
    # adapter 1 adapts only q and up: the static launch covers every slice, rank 0 elsewhere
    table = make_table([16, 8, 16], DTYPE, "cpu", seed=8, targets=[None, ("q", "up"), None])
    be = _backend(tiling)
    epoch, null_slot = be.graph_epoch(table, CPU)
    dev = be.device_table(CPU)
    a_tab = dev.group(0, "qkv").a_offs
    slots = [0] * 18 + [-1, 1, 2, -1, 1]  # 18 rows of slot 0: two segments
    meta = _static_meta(slots, null_slot, cap=8, block_r=16)
    gen = torch.Generator().manual_seed(9)

    def check(group: str) -> None:
        d_in, widths = SMALL_SHAPES[group]
        offs = slice_offsets(widths)
        if isinstance(tiling, DecodeTiling):  # gathered per step from the live tables (a graph replays it)
            assert _seg_tables(be, meta) is not None
        x = torch.randn(len(slots), d_in, generator=gen)
        y0 = torch.randn(len(slots), offs[-1], generator=gen)
        y = y0.clone()
        be.apply(y, x, meta, table, 0, group, offs)
        plain = LoRABatchMetadata.build(slots, table)
        y_ref = reference(y0, x, plain, table, 0, group, offs)
        lora_rows = [i for i, s in enumerate(slots) if s != -1]
        assert row_errors(y[lora_rows], y_ref[lora_rows]).max() <= 1e-4, group
        assert torch.equal(y[[18, 21]], y0[[18, 21]]), group  # base rows untouched

    be.begin_step(meta, table, CPU)  # each step (each replay) begins so
    for group in SMALL_SHAPES:
        check(group)
    # Change what is behind slot 2 and what slot 1 adapts; the same static metadata object (as a
    # replayed graph would) must read the new tables, which were updated in place.
    table.set(2, make_table([16], DTYPE, "cpu", seed=10).weights(0))
    table.set(1, make_table([8], DTYPE, "cpu", seed=11, targets=[("k", "down")]).weights(0))
    assert be.graph_epoch(table, CPU) == (epoch, null_slot)
    assert dev.group(0, "qkv").a_offs.data_ptr() == a_tab.data_ptr()
    be.begin_step(meta, table, CPU)
    for group in SMALL_SHAPES:
        check(group)
    # A slot beyond the tables' capacity reallocates them: a new epoch tells graphs to recapture.
    table.set(dev.n_slots + 3, make_table([8], DTYPE, "cpu", seed=12).weights(0))
    assert be.graph_epoch(table, CPU)[0] == epoch + 1


def test_segment_tables_only_for_replayed_steps() -> None:
    # an eager step reads the slot tables (building per-step table views would cost more host time
    # than the load it saves); a step run as graph replays gathers the per-step tables
    table = make_table([16, 8], DTYPE, "cpu", seed=40)
    meta = LoRABatchMetadata.build([0, 1, 1, -1, 0], table)
    be = _backend(SMALL_DECODE)
    be.begin_step(meta, table, CPU)
    assert _seg_tables(be, meta) is None
    be.begin_step(meta, table, CPU, replayed=True)
    assert _seg_tables(be, meta) is not None
    _check_all_groups(be, [0, 1, 1, -1, 0], table)  # and its calls give the reference's result


def test_adapters_in_the_device_pool_read_through_their_layouts() -> None:
    """Adapters placed in the device pool (their table columns written from the extent's place and
    the layout's offsets, no tensor views), moved by a compaction, evicted and reloaded: the
    kernels compute what the torch reference computes from the adapters' own tensors."""
    gen = torch.Generator().manual_seed(21)
    host = HostCache(1 << 30, DTYPE)
    copies = [host.host_copy(random_adapter(SMALL_SHAPES, 1, r, DTYPE, "cpu", gen)) for r in (8, 16, 8, 16)]
    unit = AdapterPool(1 << 20, DTYPE, "cpu").footprint(copies[1])  # a rank-16 one; rank 8: half
    table = LoRASlotTable(1, DTYPE, capacity=4)
    res = AdapterResidency(table, DTYPE, "cpu", AdapterPool(unit * 5 // 2, DTYPE, "cpu"))
    assert res.pool is not None
    be = _backend(SMALL_DECODE)

    def check(revisions: list[int], seed: int) -> None:
        slots = [res.facts(f"a{i}").slot for i in revisions for _ in range(3)]
        _check_all_groups(be, [*slots, -1], table, seed=seed)

    for i in range(3):
        res.load(f"a{i}", copies[i])
    check([0, 1, 2], 1)
    res.evict("a0")  # free: half a unit at each end
    res.load("a3", copies[3])  # a whole unit: the pool compacts
    assert res.pool.compactions == 1
    check([3, 1, 2], 2)
    res.evict("a1")
    res.load("a0", copies[0])  # reloaded into another place and slot
    check([0, 3, 2], 3)
    assert be.device_table(CPU).uploads == 4  # one column image per layout, none per load

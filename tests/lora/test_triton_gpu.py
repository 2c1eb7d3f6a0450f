"""Triton LoRA kernels on the GPU: bf16 against a float32 torch reference, launch counts, graphs."""

from __future__ import annotations

import pytest
import torch

from lora.lora_cases import (
    LLAMA3_8B_SHAPES,
    SMALL_SHAPES,
    make_table,
    random_ranks,
    reference,
    row_errors,
    slice_offsets,
)
from loraplex.bench.workloads import POPULARITIES, adapter_choices, row_slots, spread
from loraplex.lora.metadata import LoRABatchMetadata

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
DTYPE = torch.bfloat16
TOL = 1e-2  # per row: max|y - y_ref| / max|y_ref|, bf16 against float32
# A mid-size GQA layer: big enough for several K/N tiles, small enough for many cases.
MID_SHAPES = {"qkv": (1024, (1024, 256, 256)), "o": (1024, (1024,)), "gate_up": (1024, (2816, 2816)),
              "down": (2816, (1024,))}  # fmt: skip


def _backend(tiling=None):  # noqa: ANN001, ANN202
    from loraplex.lora.ops_triton import TritonLoRABackend

    be = TritonLoRABackend(tiling)
    be.poison_scratch = True
    return be


def _two_launch():  # noqa: ANN202
    from loraplex.lora.triton_config import DECODE, with_overrides

    return with_overrides(DECODE, fused=False)


def _fused_any_rank(**kw):  # noqa: ANN003, ANN202
    # the default takes the one-launch path for rank tiles up to 16 only; tests cover every rank
    from loraplex.lora.triton_config import DECODE, with_overrides

    return with_overrides(DECODE, fused_max_rank=64, **kw)


def _counters_zero(be) -> bool:  # noqa: ANN001
    return all(not c.any().item() for c in be._counters.values())


def _check(be, slots: list[int], table, shapes, seed: int = 0) -> None:  # noqa: ANN001
    meta = LoRABatchMetadata.build(slots, table, DEV)
    gen = torch.Generator(device=DEV).manual_seed(seed)
    lora_rows = torch.tensor([i for i, s in enumerate(slots) if s != -1], device=DEV, dtype=torch.long)
    base_rows = torch.tensor([i for i, s in enumerate(slots) if s == -1], device=DEV, dtype=torch.long)
    for group, (d_in, widths) in shapes.items():
        offs = slice_offsets(widths)
        x = torch.randn(len(slots), d_in, generator=gen, device=DEV).to(DTYPE)
        y0 = torch.randn(len(slots), offs[-1], generator=gen, device=DEV).to(DTYPE)
        y = y0.clone()
        be.apply(y, x, meta, table, 0, group, offs)
        torch.cuda.synchronize()
        y_ref = reference(y0, x, meta, table, 0, group, offs)
        err = row_errors(y[lora_rows], y_ref[lora_rows])
        assert not err.isnan().any(), group
        assert err.max().item() <= TOL, (group, err.max().item())
        # the LoRA increment alone, too (y0 can hide a wrong delta of small size)
        d_err = row_errors((y.float() - y0.float())[lora_rows], (y_ref - y0.float())[lora_rows])
        assert d_err.max().item() <= 2 * TOL, (group, d_err.max().item())
        assert torch.equal(y[base_rows], y0[base_rows]), group  # bit-identical
        assert _counters_zero(be), group  # the fused kernel leaves its arrival counters zeroed


@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("rows", [1, 37, 600])
def test_popularity_mixed_ranks(popularity: str, rows: int) -> None:
    ranks = random_ranks(24, (8, 16, 32, 64), seed=rows)
    table = make_table(ranks, DTYPE, DEV, shapes=MID_SHAPES, seed=1)
    slots = adapter_choices(rows, len(ranks), popularity, seed=2)
    if rows > 2:
        slots[1] = -1
    _check(_backend(), slots, table, MID_SHAPES)


@pytest.mark.parametrize("rows", [1, 2, 16, 64, 257, 1024, 8192])
def test_llama3_shapes_rows_1_to_8192(rows: int) -> None:
    table = make_table([8, 16, 32, 64, 16, 8, 64, 32], DTYPE, DEV, shapes=LLAMA3_8B_SHAPES, seed=3)
    if rows <= 256:  # decode-shaped: one row per request, rows interleaved
        slots = row_slots(spread(rows, 8, seed=4), 1, base_every=5)
    else:  # prefill-shaped: a few long requests
        n_req = 8
        lens = [rows // n_req] * (n_req - 1) + [rows - rows // n_req * (n_req - 1)]
        slots = row_slots(list(range(n_req)), lens, base_every=7)
    _check(_backend(), slots, table, LLAMA3_8B_SHAPES)


@pytest.mark.parametrize(
    "form",
    [
        dict(),
        dict(atomic_y=False),
        dict(row_loop_early_b=False, row_loop_table_asm=False),  # the night of 2026-11-29's form
        dict(row_loop_early_b=False, row_loop_stages=6),  # B tiles 5 ahead
    ],
    ids=str,
)
@pytest.mark.parametrize("rows", [24, 64])
def test_llama3_gate_up_row_loop_expand(rows: int, form: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    # the decode default at rank 16 with segments of about two rows: gate_up (2 x 14336 columns)
    # takes the row-loop expand, whose row tiles span several segments; the other groups do not.
    # Y updated by atomic adds (the default) and read and written.
    from loraplex.lora.triton_config import DECODE, with_overrides

    be = _backend(with_overrides(DECODE, **form))
    launched: list[object] = []
    real = be._k.lora_expand_rows_kernel

    class Spy:
        def __getitem__(self, grid: object) -> object:
            launched.append(grid)
            return real[grid]

    monkeypatch.setattr(be._k, "lora_expand_rows_kernel", Spy())
    table = make_table([16] * 32, DTYPE, DEV, shapes=LLAMA3_8B_SHAPES, seed=12)
    slots = row_slots(spread(rows, 32 if rows == 64 else 12, seed=13), 1, base_every=5)
    _check(be, slots, table, LLAMA3_8B_SHAPES)
    assert len(launched) == 1  # gate_up only


@pytest.mark.parametrize("path", ["split launch", "one launch", "two launches"])
def test_segments_of_one_row_many_adapters(path: str) -> None:
    # the fused plan as two PDL launches, as one launch with arrival counters, and the plain
    # shrink + expand pair: the decode default is one of the first two, the other stays covered
    table = make_table(random_ranks(64, (8, 16, 32, 64), seed=5), DTYPE, DEV, shapes=MID_SHAPES, seed=6)
    tiling = {
        "split launch": _fused_any_rank(fused_split_launch=True),
        "one launch": _fused_any_rank(fused_split_launch=False),
        "two launches": _two_launch(),
    }[path]
    be = _backend(tiling)
    _check(be, list(range(64)), table, MID_SHAPES)
    assert any(p is not None for p in be._plans.values()) == (path != "two launches")
    be.check_health()  # raises if an expand program of the one-launch form gave up waiting
    assert _counters_zero(be)


def test_decode_shapes_fused_plans_fit_and_two_launch_agree() -> None:
    # Llama-3-8B decode, 64 rows over 32 adapters: every group takes the one-launch path, and the
    # two-launch path on the same inputs gives the same result to bf16 rounding.
    table = make_table([16] * 32, DTYPE, DEV, shapes=LLAMA3_8B_SHAPES, seed=9)
    slots = spread(64, 32, seed=64)
    meta = LoRABatchMetadata.build(slots, table, DEV)
    fused, two = _backend(), _backend(_two_launch())
    for group, (d_in, widths) in LLAMA3_8B_SHAPES.items():
        offs = slice_offsets(widths)
        x = torch.randn(64, d_in, device=DEV).to(DTYPE)
        y0 = torch.randn(64, offs[-1], device=DEV).to(DTYPE)
        ya, yb = y0.clone(), y0.clone()
        fused.apply(ya, x, meta, table, 0, group, offs)
        two.apply(yb, x, meta, table, 0, group, offs)
        y_ref = reference(y0, x, meta, table, 0, group, offs)
        assert row_errors(ya, y_ref).max().item() <= TOL and row_errors(yb, y_ref).max().item() <= TOL
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    plans = [p for p in fused._plans.values() if p is not None]
    # the programs that must be resident at once fit (streamed expand programs start later)
    assert len(plans) == 4 and all(p.resident <= 32 * sms for p in plans)
    assert _counters_zero(fused)


def _kernel_launches(fn) -> int:  # noqa: ANN001
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def test_launch_counts_with_profiler() -> None:
    from loraplex.lora.ops_triton import TritonLoRABackend
    from loraplex.lora.triton_config import DECODE

    table = make_table([16, 8], DTYPE, DEV, shapes=SMALL_SHAPES, seed=7, targets=[("q", "v", "up"), ("k",)])
    be = TritonLoRABackend()
    meta = LoRABatchMetadata.build([0, 1, -1, 0, 1], table, DEV)
    ys = {g: torch.randn(5, sum(w), device=DEV, dtype=DTYPE) for g, (_, w) in SMALL_SHAPES.items()}
    xs = {g: torch.randn(5, d, device=DEV, dtype=DTYPE) for g, (d, _) in SMALL_SHAPES.items()}

    def run(meta: LoRABatchMetadata) -> None:
        for g, (_, widths) in SMALL_SHAPES.items():
            be.apply(ys[g], xs[g], meta, table, 0, g, slice_offsets(widths))

    run(meta)  # compile, build the device tables
    # decode-shaped: qkv (three slices) and gate_up (only up adapted) on the fused plan, as one
    # launch each or as two (shrink, expand: the split-launch form); o, down: none
    per_group = 2 if DECODE.fused_split_launch else 1
    assert _kernel_launches(lambda: run(meta)) == 2 * per_group
    empty = LoRABatchMetadata.build([-1, -1, -1, -1, -1], table, DEV)
    assert _kernel_launches(lambda: run(empty)) == 0
    # prefill-shaped (a 40-row segment) and the two-launch path: at most two launches per group
    long = LoRABatchMetadata.build([0] * 40 + [1, -1, 0, 1, 1], table, DEV)
    ys.update({g: torch.randn(45, sum(w), device=DEV, dtype=DTYPE) for g, (_, w) in SMALL_SHAPES.items()})
    xs.update({g: torch.randn(45, d, device=DEV, dtype=DTYPE) for g, (d, _) in SMALL_SHAPES.items()})
    run(long)
    assert _kernel_launches(lambda: run(long)) == 4
    be.tiling = _two_launch()
    run(meta)
    assert _kernel_launches(lambda: run(meta)) == 4


@pytest.mark.parametrize("pdl", [True, False])
def test_cuda_graph_replay_follows_new_inputs(pdl: bool) -> None:
    from loraplex.lora.ops_triton import TritonLoRABackend
    from loraplex.lora.triton_config import DECODE, with_overrides

    table = make_table([8, 64, 16], DTYPE, DEV, shapes=MID_SHAPES, seed=8)
    be = TritonLoRABackend(with_overrides(DECODE, pdl=pdl, fused_max_rank=64))
    slots = [2, 0, -1, 1, 1, 2, 0]
    meta = LoRABatchMetadata.build(slots, table, DEV)
    d_in, widths = MID_SHAPES["qkv"]
    offs = slice_offsets(widths)
    x = torch.randn(len(slots), d_in, device=DEV, dtype=DTYPE)
    y = torch.randn(len(slots), offs[-1], device=DEV, dtype=DTYPE)
    be.prepare(meta, table, DEV)
    be.apply(y.clone(), x, meta, table, 0, "qkv", offs)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        be.apply(y, x, meta, table, 0, "qkv", offs)
    for seed in (1, 2):
        g = torch.Generator(device=DEV).manual_seed(seed)
        x.copy_(torch.randn(x.shape, generator=g, device=DEV))
        y0 = torch.randn(y.shape, generator=g, device=DEV).to(DTYPE)
        y.copy_(y0)
        graph.replay()
        torch.cuda.synchronize()
        assert row_errors(y, reference(y0, x, meta, table, 0, "qkv", offs)).max().item() <= TOL


ROW_LOOP_EVERYWHERE = dict(
    fused_split_launch=True, row_loop_min_width=1, row_loop_max_rank=64, row_loop_max_avg_rows=64.0
)
WHOLE_LAYER_VARIANTS = {
    "one launch, pdl": dict(pdl=True, fused_split_launch=False, fused_warps=4),
    "one launch, no pdl": dict(pdl=False, fused_split_launch=False, fused_warps=4),
    "pdl, split launch, 4 warps": dict(pdl=True, fused_split_launch=True, fused_warps=4),
    "split launch": dict(pdl=False, fused_split_launch=True),
    "pdl, split launch, 2 warps": dict(pdl=True, fused_split_launch=True, fused_warps=2),
    "pdl, split launch, 4/2 warps": dict(
        pdl=True, fused_split_launch=True, fused_warps=4, split_expand_warps=2
    ),
    "pdl, split launch, segment tables": dict(pdl=True, fused_split_launch=True, seg_tables=True),
    "pdl, split launch, slot tables": dict(pdl=True, fused_split_launch=True, seg_tables=False),
    # the row-loop expand for every group at every rank tile (the mixed ranks here reach 64)
    "pdl, split launch, row-loop expand": dict(pdl=True, **ROW_LOOP_EVERYWHERE),
    "pdl, split launch, row-loop expand, segment tables": dict(
        pdl=True, seg_tables=True, **ROW_LOOP_EVERYWHERE
    ),
    "split launch, row-loop expand": dict(pdl=False, **ROW_LOOP_EVERYWHERE),
    "pdl, split launch, Y read and written": dict(pdl=True, fused_split_launch=True, atomic_y=False),
    "pdl, split launch, row-loop expand, Y read and written": dict(
        pdl=True, atomic_y=False, **ROW_LOOP_EVERYWHERE
    ),
    "pdl, split launch, 2 tiles per expand program": dict(
        pdl=True, fused_split_launch=True, fused_expand_sub=2
    ),
    # the row loop (every group, every rank tile) with its first B tile before the wait and table
    # entries by inline assembly, as the default has it for gate_up at rank tile 16; and without
    "pdl, split launch, row-loop expand, early B tile, table entries by inline assembly": dict(
        pdl=True, row_loop_early_b=True, row_loop_table_asm=True, **ROW_LOOP_EVERYWHERE
    ),
    "pdl, split launch, row-loop expand, pipelined table entries": dict(
        pdl=True, row_loop_early_b=False, row_loop_table_asm=False, **ROW_LOOP_EVERYWHERE
    ),
}


@pytest.mark.parametrize("variant", list(WHOLE_LAYER_VARIANTS))
def test_cuda_graph_whole_layer_back_to_back(variant: str) -> None:
    # the four groups' fused kernels back to back in one graph (with PDL each may start while the
    # one before finishes), replayed with new x and y; counters must be zero after every replay
    from loraplex.lora.ops_triton import TritonLoRABackend
    from loraplex.lora.triton_config import DECODE, with_overrides

    table = make_table(random_ranks(12, (8, 16, 32, 64), seed=20), DTYPE, DEV, shapes=MID_SHAPES, seed=21)
    be = TritonLoRABackend(with_overrides(DECODE, fused_max_rank=64, **WHOLE_LAYER_VARIANTS[variant]))
    slots = adapter_choices(24, 12, "zipf:1.1", seed=22)
    slots[3] = -1
    meta = LoRABatchMetadata.build(slots, table, DEV)
    offs = {g: slice_offsets(w) for g, (_, w) in MID_SHAPES.items()}
    xs = {g: torch.randn(24, d, device=DEV, dtype=DTYPE) for g, (d, _) in MID_SHAPES.items()}
    ys = {g: torch.randn(24, offs[g][-1], device=DEV, dtype=DTYPE) for g in MID_SHAPES}

    def layer() -> None:
        be.begin_step(meta, table, DEV)  # as the engine's forward does (captured with it)
        for g in MID_SHAPES:
            be.apply(ys[g], xs[g], meta, table, 0, g, offs[g])

    be.prepare(meta, table, DEV)
    layer()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer()
    assert all(p is not None for p in be._plans.values())
    for seed in (3, 4, 5):
        g = torch.Generator(device=DEV).manual_seed(seed)
        y0 = {}
        for grp in MID_SHAPES:
            xs[grp].copy_(torch.randn(xs[grp].shape, generator=g, device=DEV))
            y0[grp] = torch.randn(ys[grp].shape, generator=g, device=DEV).to(DTYPE)
            ys[grp].copy_(y0[grp])
        graph.replay()
        torch.cuda.synchronize()
        for grp in MID_SHAPES:
            y_ref = reference(y0[grp], xs[grp], meta, table, 0, grp, offs[grp])
            assert row_errors(ys[grp], y_ref).max().item() <= TOL, (seed, grp)
            assert torch.equal(ys[grp][3], y0[grp][3])
        assert _counters_zero(be)

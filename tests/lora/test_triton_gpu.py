"""Triton LoRA kernels on the GPU: bf16 against a float32 torch reference, launch counts, graphs."""

from __future__ import annotations

from dataclasses import replace

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
from loraplex.bench.popularity import POPULARITIES, adapter_choices, row_slots, spread
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
    # the decode tiling with no rank tile small enough for the split launch: the two-launch path
    from loraplex.lora.triton_config import DECODE

    return replace(DECODE, split_max_rank=0)


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


@pytest.mark.parametrize("rows", [24, 64])
def test_llama3_gate_up_row_loop_expand(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # the decode default at rank 16 with segments of about two rows: gate_up (2 x 14336 columns)
    # takes the row-loop expand, whose row tiles span several segments; the other groups do not
    be = _backend()
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


@pytest.mark.parametrize("path", ["split launch", "two launches"])
def test_segments_of_one_row_many_adapters(path: str) -> None:
    # the decode default (the split launch, PDL-chained) and the plain shrink + expand pair
    table = make_table(random_ranks(64, (8, 16, 32, 64), seed=5), DTYPE, DEV, shapes=MID_SHAPES, seed=6)
    be = _backend(None if path == "split launch" else _two_launch())
    _check(be, list(range(64)), table, MID_SHAPES)
    assert any(p is not None for p in be._plans.values()) == (path != "two launches")


def test_decode_shapes_split_plans_fit_and_two_launch_agree() -> None:
    # Llama-3-8B decode, 64 rows over 32 adapters: every group takes the split launch, and the
    # two-launch path on the same inputs gives the same result to bf16 rounding.
    table = make_table([16] * 32, DTYPE, DEV, shapes=LLAMA3_8B_SHAPES, seed=9)
    slots = spread(64, 32, seed=64)
    meta = LoRABatchMetadata.build(slots, table, DEV)
    split, two = _backend(), _backend(_two_launch())
    for group, (d_in, widths) in LLAMA3_8B_SHAPES.items():
        offs = slice_offsets(widths)
        x = torch.randn(64, d_in, device=DEV).to(DTYPE)
        y0 = torch.randn(64, offs[-1], device=DEV).to(DTYPE)
        ya, yb = y0.clone(), y0.clone()
        split.apply(ya, x, meta, table, 0, group, offs)
        two.apply(yb, x, meta, table, 0, group, offs)
        y_ref = reference(y0, x, meta, table, 0, group, offs)
        assert row_errors(ya, y_ref).max().item() <= TOL and row_errors(yb, y_ref).max().item() <= TOL
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    plans = [p for p in split._plans.values() if p is not None]
    # the shrink grids keep to the budget (expand programs start as shrink programs finish)
    assert len(plans) == 4 and all(p.n_shrink <= 6 * sms for p in plans)


def _kernel_launches(fn) -> int:  # noqa: ANN001
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def test_launch_counts_with_profiler() -> None:
    from loraplex.lora.ops_triton import TritonLoRABackend

    table = make_table([16, 8], DTYPE, DEV, shapes=SMALL_SHAPES, seed=7, targets=[("q", "v", "up"), ("k",)])
    be = TritonLoRABackend()
    meta = LoRABatchMetadata.build([0, 1, -1, 0, 1], table, DEV)
    ys = {g: torch.randn(5, sum(w), device=DEV, dtype=DTYPE) for g, (_, w) in SMALL_SHAPES.items()}
    xs = {g: torch.randn(5, d, device=DEV, dtype=DTYPE) for g, (d, _) in SMALL_SHAPES.items()}

    def run(meta: LoRABatchMetadata) -> None:
        for g, (_, widths) in SMALL_SHAPES.items():
            be.apply(ys[g], xs[g], meta, table, 0, g, slice_offsets(widths))

    run(meta)  # compile, build the device tables
    # decode-shaped: qkv (three slices) and gate_up (only up adapted) on the split launch (shrink,
    # expand); o, down: none
    assert _kernel_launches(lambda: run(meta)) == 4
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


def test_cuda_graph_replay_follows_new_inputs() -> None:
    from loraplex.lora.ops_triton import TritonLoRABackend

    table = make_table([8, 64, 16], DTYPE, DEV, shapes=MID_SHAPES, seed=8)
    be = TritonLoRABackend()
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


# the row-loop expand for every group at every rank tile (the mixed ranks here reach 64)
ROW_LOOP_EVERYWHERE = dict(row_loop_min_width=1, row_loop_max_rank=64, row_loop_max_avg_rows=64.0)
# (decode tiling overrides, whether the captured step gathers per-step segment tables)
WHOLE_LAYER_VARIANTS = {
    "split launch, segment tables": ({}, None),
    "split launch, slot tables": ({}, False),
    "split launch, row-loop expand, segment tables": (ROW_LOOP_EVERYWHERE, None),
    "split launch, row-loop expand, slot tables": (ROW_LOOP_EVERYWHERE, False),
    "two launches": ({"split_max_rank": 0}, None),
}


@pytest.mark.parametrize("variant", list(WHOLE_LAYER_VARIANTS))
def test_cuda_graph_whole_layer_back_to_back(variant: str) -> None:
    # the four groups' launches back to back in one graph (with PDL each may start while the one
    # before finishes), replayed with new x and y
    from loraplex.lora.ops_triton import TritonLoRABackend
    from loraplex.lora.triton_config import DECODE

    overrides, replayed = WHOLE_LAYER_VARIANTS[variant]
    table = make_table(random_ranks(12, (8, 16, 32, 64), seed=20), DTYPE, DEV, shapes=MID_SHAPES, seed=21)
    be = TritonLoRABackend(replace(DECODE, **overrides))
    slots = adapter_choices(24, 12, "zipf:1.1", seed=22)
    slots[3] = -1
    meta = LoRABatchMetadata.build(slots, table, DEV)
    offs = {g: slice_offsets(w) for g, (_, w) in MID_SHAPES.items()}
    xs = {g: torch.randn(24, d, device=DEV, dtype=DTYPE) for g, (d, _) in MID_SHAPES.items()}
    ys = {g: torch.randn(24, offs[g][-1], device=DEV, dtype=DTYPE) for g in MID_SHAPES}

    def layer() -> None:
        be.begin_step(meta, table, DEV, replayed)  # as the engine's forward does (captured with it)
        for g in MID_SHAPES:
            be.apply(ys[g], xs[g], meta, table, 0, g, offs[g])

    be.prepare(meta, table, DEV)
    layer()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer()
    plans = list(be._plans.values())
    assert all(p is not None for p in plans) and bool(plans) == ("split_max_rank" not in overrides)
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


@pytest.mark.parametrize("two_launch", [False, True])
def test_float32_operands_are_multiplied_in_float32(two_launch: bool) -> None:
    """A float32 engine's LoRA increment is float32 to rounding, as its base GEMMs are (TF32 off):
    TF32, Triton's default for float32 dot operands, keeps 10 mantissa bits and is ~1e-3 off."""
    table = make_table([16, 32, 8], torch.float32, DEV, shapes=MID_SHAPES, seed=3)
    slots = [0, 1, -1, 2] * 10
    meta = LoRABatchMetadata.build(slots, table, DEV)
    lora_rows = torch.tensor([i for i, s in enumerate(slots) if s != -1], device=DEV)
    be = _backend(_two_launch() if two_launch else None)
    gen = torch.Generator(device=DEV).manual_seed(4)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference in float32 too
    try:
        for group, (d_in, widths) in MID_SHAPES.items():
            offs = slice_offsets(widths)
            x = torch.randn(len(slots), d_in, generator=gen, device=DEV)
            y0 = torch.randn(len(slots), offs[-1], generator=gen, device=DEV)
            y = y0.clone()
            be.apply(y, x, meta, table, 0, group, offs)
            y_ref = reference(y0, x, meta, table, 0, group, offs)
            err = row_errors((y - y0)[lora_rows], (y_ref - y0)[lora_rows])
            assert err.max().item() <= 2e-5, (group, err.max().item())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32

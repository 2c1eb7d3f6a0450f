"""Backend choice per device, and the promise that CPU-only installs never need triton."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from loraplex.lora.backend import make_lora_backend
from loraplex.lora.ops_torch import TorchLoRABackend
from loraplex.lora.triton_config import (
    DECODE,
    PREFILL,
    block_r_for,
    blocks_per_sm,
    pick_tiling,
    plan_fused,
    row_loop_applies,
    split_k,
    with_overrides,
)


def test_cpu_gets_the_torch_reference() -> None:
    assert isinstance(make_lora_backend(torch.device("cpu")), TorchLoRABackend)


def test_lora_package_imports_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"  # any `import triton` now raises ImportError
        "import loraplex.lora, loraplex.lora.backend, loraplex.lora.ops_torch\n"
        "import loraplex.lora.triton_config, loraplex.lora.triton_table, loraplex.lora.ops_triton\n"
        "import loraplex.bench.workloads, loraplex.bench.cli\n"
        "from loraplex.lora.backend import make_lora_backend\n"
        "assert make_lora_backend('cpu').name == 'torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tiling_choice_and_split() -> None:
    assert pick_tiling(1) is DECODE and pick_tiling(2) is DECODE
    assert pick_tiling(4096) is PREFILL
    assert [block_r_for(r) for r in (1, 8, 16, 17, 64)] == [16, 16, 16, 32, 64]
    s = split_k(DECODE, 4096, programs=32, num_sms=132)  # 32 decode segments: split K 8 ways
    assert s.n_split == 8 and s.k_chunk * s.n_split >= 4096 and s.k_chunk % DECODE.block_k == 0
    assert split_k(PREFILL, 4096, programs=512, num_sms=132).n_split == 1  # enough row tiles
    s = split_k(DECODE, 14336, programs=1, num_sms=132)
    assert s.n_split == DECODE.max_split and (s.n_split - 1) * s.k_chunk < 14336


@pytest.mark.parametrize("expand_sub", [0, 1, 2], ids=["all-resident", "streamed1", "streamed2"])
def test_fused_plan_fits_the_budget_and_covers_every_column(expand_sub: int) -> None:
    llama = {"qkv": (4096, (4096, 1024, 1024)), "gate_up": (4096, (14336, 14336)), "down": (14336, (4096,))}
    tiling = with_overrides(DECODE, fused_expand_sub=expand_sub)
    for tiles, block_r in ((1, 16), (32, 16), (32, 64), (64, 16), (128, 32)):
        r_chunks = block_r // DECODE.shrink_block_r
        for d_in, widths in llama.values():
            plan = plan_fused(tiling, tiles, r_chunks, d_in, widths, block_r, num_sms=132)
            assert plan is not None and plan.resident <= 132 * DECODE.fused_per_sm
            # all resident: every program at once; streamed: only the shrinks (expands start later)
            assert plan.resident == (plan.n_shrink if expand_sub else plan.programs)
            assert not expand_sub or plan.n_sub == expand_sub
            assert plan.n_shrink == tiles * r_chunks * plan.split.n_split
            n, k = plan.split.n_split, plan.split.k_chunk
            assert n * k >= d_in > (n - 1) * k
            assert plan.block_n * block_r <= DECODE.fused_tile_elems
            cols = plan.block_n * plan.n_sub
            for w, c in zip(widths, plan.chunks, strict=False):
                assert c * cols >= w > (c - 1) * cols  # every column once, no idle program
            assert plan.n_expand == tiles * sum(plan.chunks)
    # a slice nobody adapts (width 0) gets no expand programs
    plan = plan_fused(tiling, 8, 1, 4096, (4096, 0, 1024), 16, num_sms=132)
    assert plan is not None and plan.chunks[1] == 0
    # no room: the two-launch path; not fused at all: likewise
    assert plan_fused(tiling, 64, 4, 4096, (4096,), 64, num_sms=4, per_sm=1) is None
    assert plan_fused(with_overrides(DECODE, fused=False), 1, 1, 4096, (4096,), 16, num_sms=132) is None
    assert plan_fused(PREFILL, 1, 1, 4096, (4096,), 16, num_sms=132) is None


def test_blocks_per_sm_from_resources() -> None:
    class Hopper:  # torch.cuda.get_device_properties fields used
        regs_per_multiprocessor = 65536
        shared_memory_per_multiprocessor = 233472
        max_threads_per_multi_processor = 2048

    assert blocks_per_sm(104, 32768, 4, Hopper()) == 4  # registers bound: 13 x 256 per warp
    assert blocks_per_sm(64, 16384, 4, Hopper()) == 8  # registers bound
    assert blocks_per_sm(32, 100_000, 4, Hopper()) == 2  # shared memory bound
    assert blocks_per_sm(16, 0, 8, Hopper()) == 8  # threads bound


def test_row_loop_applies_to_wide_groups_with_short_segments_at_small_rank_tiles() -> None:
    # the decode default: gate_up (2 x 14336 columns) at rank tile 16 with about two rows per segment
    assert row_loop_applies(DECODE, rows=64, segments=32, block_r=16, width=28672)
    assert row_loop_applies(DECODE, rows=64, segments=16)  # the step may use it (4 rows per segment)
    assert not row_loop_applies(DECODE, rows=64, segments=8)  # 8 rows per segment: tiles of one segment
    assert not row_loop_applies(DECODE, rows=64, segments=0)
    assert not row_loop_applies(DECODE, rows=64, segments=32, block_r=64, width=28672)  # mixed ranks
    assert not row_loop_applies(DECODE, rows=64, segments=32, block_r=16, width=6144)  # qkv
    assert not row_loop_applies(with_overrides(DECODE, row_loop_min_width=0), rows=64, segments=32)


def test_narrow_budget_and_stages_apply_at_rank_tile_16_only() -> None:
    tiling = with_overrides(
        DECODE, fused_per_sm=6, narrow_per_sm=2, split_shrink_stages=4, narrow_shrink_stages=6
    )
    assert (tiling.per_sm_for(16), tiling.shrink_stages_for(16)) == (2, 6)
    assert (tiling.per_sm_for(64), tiling.shrink_stages_for(64)) == (6, 4)
    # the decode target's gate_up (K = 4096, 32 row tiles, 132 SMs): a budget of 2 per SM leaves
    # 8 K chunks of 512; at rank tile 64 (4 rank chunks per K chunk) the budget of 6 still applies
    narrow = plan_fused(tiling, 32, 1, 4096, (14336, 14336), 16, 132)
    assert narrow is not None and narrow.split.n_split == 8 and narrow.n_shrink == 256
    wide = plan_fused(tiling, 32, 4, 4096, (14336, 14336), 64, 132)
    assert (
        wide is not None
        and wide.split.n_split == plan_fused(DECODE, 32, 4, 4096, (14336, 14336), 64, 132).split.n_split
    )
    assert tiling.shrink_stages_for(16, k_steps=2) == 4  # no more buffers than K steps need
    unset = with_overrides(tiling, narrow_per_sm=0, narrow_shrink_stages=0)
    assert (unset.per_sm_for(16), unset.shrink_stages_for(16)) == (6, 4)


def test_long_k_budget_applies_to_long_reductions_at_rank_tile_16() -> None:
    # down (K = 14336) gets 3 programs per SM at rank tile 16; qkv/o/gate_up (K = 4096) keep 2, and
    # rank tile 64 keeps the wide budget whatever K is
    tiling = with_overrides(DECODE, fused_per_sm=6, narrow_per_sm=2, long_k_min=8192, long_k_per_sm=3)
    assert (tiling.per_sm_for(16, 14336), tiling.per_sm_for(16, 4096), tiling.per_sm_for(64, 14336)) == (
        3,
        2,
        6,
    )
    down = plan_fused(tiling, 32, 1, 14336, (4096,), 16, 132)
    assert down is not None and down.n_shrink == 384 and down.split.k_chunk == 1280  # 12 chunks of 10 steps
    without = plan_fused(with_overrides(tiling, long_k_per_sm=0), 32, 1, 14336, (4096,), 16, 132)
    assert without is not None and without.n_shrink == 256

"""Backend choice per device, and the promise that CPU-only installs never need triton."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import fields, replace

import torch

from loraplex.lora.backend import make_lora_backend
from loraplex.lora.ops_torch import TorchLoRABackend
from loraplex.lora.triton_config import (
    DECODE,
    PREFILL,
    DecodeTiling,
    block_r_for,
    pick_tiling,
    plan_split,
    row_loop_applies,
    split_k,
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
    # one popular adapter's long segment: the decode tiling (split K) up to 16 row tiles in all
    assert pick_tiling(64, segments=1) is DECODE and pick_tiling(256, segments=1) is DECODE
    assert pick_tiling(257, segments=1) is PREFILL
    assert pick_tiling(64, segments=4) is DECODE and pick_tiling(64, segments=8) is PREFILL
    assert pick_tiling(33, segments=5) is PREFILL  # 5 segments x 4 tiles (3 padded to 4)
    assert pick_tiling(32, segments=64) is DECODE  # short segments: decode, however many
    assert [block_r_for(r) for r in (1, 8, 16, 17, 64)] == [16, 16, 16, 32, 64]
    s = split_k(DECODE, 4096, programs=32, num_sms=132)  # 32 decode segments: split K 8 ways
    assert s.n_split == 8 and s.k_chunk * s.n_split >= 4096 and s.k_chunk % DECODE.block_k == 0
    assert split_k(PREFILL, 4096, programs=512, num_sms=132).n_split == 1  # enough row tiles
    s = split_k(DECODE, 14336, programs=1, num_sms=132)
    assert s.n_split == DECODE.max_split and (s.n_split - 1) * s.k_chunk < 14336


def test_tilings_hash_by_value() -> None:
    # the backend's per-call caches key on the tiling: equal tilings must share entries
    assert hash(replace(DECODE)) == hash(DECODE) and replace(DECODE) == DECODE
    assert hash(replace(DECODE, split_per_sm=5)) != hash(DECODE)
    assert isinstance(DECODE, DecodeTiling) and not isinstance(PREFILL, DecodeTiling)
    assert len(fields(PREFILL)) < len(fields(DECODE))


def test_split_plan_fits_the_budget_and_covers_every_column() -> None:
    llama = {"qkv": (4096, (4096, 1024, 1024)), "gate_up": (4096, (14336, 14336)), "down": (14336, (4096,))}
    for tiles, block_r in ((1, 16), (32, 16), (32, 64), (64, 16), (128, 32)):
        r_chunks = block_r // DECODE.shrink_block_r
        for d_in, widths in llama.values():
            plan = plan_split(DECODE, tiles, r_chunks, d_in, widths, block_r, num_sms=132)
            assert plan is not None and plan.n_shrink <= 132 * DECODE.per_sm_for(block_r, d_in)
            assert plan.n_shrink == tiles * r_chunks * plan.split.n_split
            n, k = plan.split.n_split, plan.split.k_chunk
            assert n * k >= d_in > (n - 1) * k
            assert k // DECODE.block_k >= DECODE.split_min_k_steps or n == 1
            for w, c in zip(widths, plan.chunks, strict=False):
                assert c * plan.block_n >= w > (c - 1) * plan.block_n  # every column once, no idle program
            assert plan.n_expand == tiles * sum(plan.chunks)
    # a slice nobody adapts (width 0) gets no expand programs
    plan = plan_split(DECODE, 8, 1, 4096, (4096, 0, 1024), 16, num_sms=132)
    assert plan is not None and plan.chunks[1] == 0
    # no room for even one K chunk per row tile: the two-launch path
    assert plan_split(DECODE, 64, 4, 4096, (4096,), 64, num_sms=4) is None


def test_row_loop_applies_to_wide_groups_with_short_segments_at_small_rank_tiles() -> None:
    # the decode default: gate_up (2 x 14336 columns) at rank tile 16 with about two rows per segment
    assert row_loop_applies(DECODE, rows=64, segments=32, block_r=16, width=28672)
    assert row_loop_applies(DECODE, rows=64, segments=16)  # the step may use it (4 rows per segment)
    assert not row_loop_applies(DECODE, rows=64, segments=8)  # 8 rows per segment: tiles of one segment
    assert not row_loop_applies(DECODE, rows=64, segments=0)
    assert not row_loop_applies(DECODE, rows=64, segments=32, block_r=64, width=28672)  # mixed ranks
    assert not row_loop_applies(DECODE, rows=64, segments=32, block_r=16, width=6144)  # qkv


def test_narrow_budget_and_stages_apply_at_rank_tile_16_only() -> None:
    assert (DECODE.per_sm_for(16, 4096), DECODE.shrink_stages_for(16, 8)) == (2, 8)
    assert (DECODE.per_sm_for(64, 4096), DECODE.shrink_stages_for(64, 8)) == (6, 4)
    # the decode target's gate_up (K = 4096, 32 row tiles, 132 SMs): a budget of 2 per SM leaves
    # 8 K chunks of 512; at rank tile 64 (4 rank chunks per K chunk) the budget of 6 applies
    narrow = plan_split(DECODE, 32, 1, 4096, (14336, 14336), 16, 132)
    assert narrow is not None and narrow.split.n_split == 8 and narrow.n_shrink == 256
    wide = plan_split(DECODE, 32, 4, 4096, (14336, 14336), 64, 132)
    assert wide is not None and wide.split.n_split == 6 and wide.n_shrink == 768
    assert DECODE.shrink_stages_for(16, k_steps=2) == 4  # no more buffers than K steps need


def test_long_k_budget_applies_to_long_reductions_at_rank_tile_16() -> None:
    # down (K = 14336) gets 3 programs per SM at rank tile 16; qkv/o/gate_up (K = 4096) keep 2, and
    # rank tile 64 keeps the wide budget whatever K is
    assert (DECODE.per_sm_for(16, 14336), DECODE.per_sm_for(16, 4096), DECODE.per_sm_for(64, 14336)) == (
        3,
        2,
        6,
    )
    down = plan_split(DECODE, 32, 1, 14336, (4096,), 16, 132)
    assert down is not None and down.n_shrink == 384 and down.split.k_chunk == 1280  # 12 chunks of 10 steps
    without = plan_split(replace(DECODE, split_long_k_per_sm=2), 32, 1, 14336, (4096,), 16, 132)
    assert without is not None and without.n_shrink == 256

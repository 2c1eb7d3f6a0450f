"""Launch shapes of the paged-attention kernels (`attention_kernels_triton.py` and its
siblings): tiles per head size and the decode launch's split-K factor. Pure Python (no triton
import), so the graph runner and tests read them anywhere."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class AttentionTiling:
    decode_block_n: int = 64  # keys per decode tile
    prefill_block_m: int = 64  # query rows per prefill tile
    # Keys per prefill tile, and the prefill launch's pipeline depth. The K/V loads go through the
    # block table, so the compiler's pipeliner puts the table read a stage ahead of them: at its
    # default of 3 stages K/V are fetched only one tile ahead and the loop waits on every fetch;
    # 5 stages fetch them two tiles ahead. Small key tiles keep the shared memory (~66 KB) low
    # enough for a mixed step's decode programs to run beside the prefill ones (docs/attention.md).
    prefill_block_n: int = 32
    prefill_num_stages: int = 5
    min_keys_per_split: int = 256  # decode split-K: no split smaller than this
    programs_per_sm: int = 2  # decode split-K: split until S * Hkv * splits reaches this many per SM
    max_splits: int = 32
    num_warps: int = 4
    # A captured mixed step's one launch (`attention_mixed_triton.py`): registers per thread at
    # most (0: the compiler's choice). Uncapped it takes ~196 at head size 128, two programs an
    # SM; at 168 (a 16-byte spill) three fit, as shared memory allows. At head size 256 shared
    # memory allows one whatever the registers, so no cap there.
    one_launch_max_registers: int = 168


DEFAULT_TILING = AttentionTiling()


def tiling_for(head_dim: int, base: AttentionTiling | None = None) -> AttentionTiling:
    """Halve the key tiles and double the warps for head_dim > 128 (register and shared-memory
    pressure). `base` defaults to the module's DEFAULT_TILING as it is at the call, so a benchmark
    can compare tilings by replacing it before it builds an engine
    (`benchmarks/attention_tiling_ab.py`)."""
    base = base or DEFAULT_TILING
    if head_dim > 128:
        return replace(
            base, decode_block_n=32, prefill_block_n=min(base.prefill_block_n, 32), num_warps=8,
            one_launch_max_registers=0,
        )  # fmt: skip
    return base


_SM_COUNT: dict[torch.device, int] = {}


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: small, so tests exercise split-K
    if device not in _SM_COUNT:
        _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device]


def decode_splits(num_seqs: int, n_kv: int, keys: int, sms: int, tiling: AttentionTiling) -> int:
    """Split-K factor (a power of two) for the decode launch: split long contexts until the grid
    has `programs_per_sm` programs per SM, never below `min_keys_per_split` keys per split."""
    splits = 1
    while (
        splits < tiling.max_splits
        and num_seqs * n_kv * splits < tiling.programs_per_sm * sms
        and keys >= 2 * splits * tiling.min_keys_per_split
    ):
        splits *= 2
    return splits

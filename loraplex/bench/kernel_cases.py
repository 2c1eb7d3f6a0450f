"""The cases of `bench kernels` and what each must move at least: pure Python, no GPU needed.

Shapes are one Llama-3-8B decoder layer (hidden 4096, GQA q/k/v = 4096/1024/1024, intermediate
14336). Every adapter adapts all seven targets at its own rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from loraplex.bench.popularity import row_slots, spread
from loraplex.lora.layout import GROUP_SLICES

GROUPS: tuple[str, ...] = ("qkv", "o", "gate_up", "down")
LAYER = "layer"  # all four groups, i.e. all seven targets, back to back

# group -> (d_in, slice widths)
LLAMA3_8B: dict[str, tuple[int, tuple[int, ...]]] = {
    "qkv": (4096, (4096, 1024, 1024)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
}


def slice_offsets(widths: tuple[int, ...]) -> tuple[int, ...]:
    """Column offsets of a group's slices: (0, w0, w0 + w1, ...)."""
    out = [0]
    for w in widths:
        out.append(out[-1] + w)
    return tuple(out)


# rank label -> the ranks adapters cycle through (adapter i gets ranks[i % len(ranks)])
RANK_MIXES: dict[str, tuple[int, ...]] = {
    "8": (8,),
    "16": (16,),
    "32": (32,),
    "64": (64,),
    "mixed": (8, 16, 32, 64),
}

DECODE_ROWS = (1, 16, 64, 256)
DECODE_ADAPTERS = (1, 8, 32, 64)
PREFILL_ROWS, PREFILL_ADAPTERS = 4096, 8


@dataclass(frozen=True)
class KernelCase:
    phase: str  # "decode": one row per request; "prefill": PREFILL_ROWS / adapters rows per request
    rows: int
    adapters: int  # distinct adapters in the batch
    ranks: str  # a RANK_MIXES key

    @property
    def label(self) -> str:
        return f"{self.phase} M={self.rows} D={self.adapters} r={self.ranks}"

    def adapter_ranks(self) -> list[int]:
        mix = RANK_MIXES[self.ranks]
        return [mix[i % len(mix)] for i in range(self.adapters)]

    def row_slots(self) -> list[int]:
        """Slot of every token row; slot i holds adapter i."""
        if self.phase == "decode":
            return spread(self.rows, self.adapters, seed=self.rows)
        per = self.rows // self.adapters
        return row_slots(
            list(range(self.adapters)), [per] * (self.adapters - 1) + [self.rows - per * (self.adapters - 1)]
        )


def all_cases() -> list[KernelCase]:
    cases = [
        KernelCase("decode", m, d, r)
        for m in DECODE_ROWS
        for d in DECODE_ADAPTERS
        if d <= m
        for r in RANK_MIXES
    ]
    cases += [KernelCase("prefill", PREFILL_ROWS, PREFILL_ADAPTERS, r) for r in RANK_MIXES]
    return cases


TARGET_DECODE = KernelCase("decode", 64, 32, "16")
TARGET_MIXED = KernelCase("decode", 64, 32, "mixed")
TARGET_PREFILL = KernelCase("prefill", PREFILL_ROWS, PREFILL_ADAPTERS, "16")


# one popular adapter's rows in one segment, and the most µs each may take (graph replay)
TARGET_SINGLE: dict[KernelCase, float] = {
    KernelCase("decode", 64, 1, "16"): 25.0,
    KernelCase("decode", 256, 1, "16"): 40.0,
}


def quick_cases() -> list[KernelCase]:
    return [TARGET_DECODE, TARGET_MIXED, TARGET_PREFILL, *TARGET_SINGLE]


def group_min_bytes(group: str, rows: int, ranks: Sequence[int], elem: int = 2) -> int:
    """Fewest bytes one call must move: A and B of each distinct adapter at its own rank, the
    LoRA rows of X read once, and their Y read and written once."""
    d_in, widths = LLAMA3_8B[group]
    weights = sum(r * (d_in * len(widths) + sum(widths)) for r in ranks)
    return elem * (weights + rows * d_in + 2 * rows * sum(widths))


def group_flops(group: str, rows_per_adapter: Sequence[int], ranks: Sequence[int]) -> int:
    d_in, widths = LLAMA3_8B[group]
    return sum(
        2 * n * r * (d_in * len(widths) + sum(widths)) for n, r in zip(rows_per_adapter, ranks, strict=True)
    )


def case_min_bytes(case: KernelCase, group: str) -> int:
    groups = GROUPS if group == LAYER else (group,)
    return sum(group_min_bytes(g, case.rows, case.adapter_ranks()) for g in groups)


def case_flops(case: KernelCase, group: str) -> int:
    slots = case.row_slots()
    per = [slots.count(i) for i in range(case.adapters)]
    groups = GROUPS if group == LAYER else (group,)
    return sum(group_flops(g, per, case.adapter_ranks()) for g in groups)


def slices_of(group: str) -> tuple[str, ...]:
    return GROUP_SLICES[group]

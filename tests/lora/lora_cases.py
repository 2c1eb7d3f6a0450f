"""Shared builders for LoRA op tests: a small model's layer shapes, random adapters, a reference run."""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from loraplex.lora.layout import GROUP_SLICES
from loraplex.lora.metadata import LoRABatchMetadata
from loraplex.lora.ops_torch import lora_expand, lora_shrink, segment_pairs
from loraplex.lora.weights import AdapterWeights, LoRAPair, LoRASlotTable

# group -> (d_in, slice widths): a GQA attention block (k/v narrower than q) and an MLP
SMALL_SHAPES: dict[str, tuple[int, tuple[int, ...]]] = {
    "qkv": (64, (64, 32, 32)),
    "o": (64, (64,)),
    "gate_up": (64, (96, 96)),
    "down": (96, (64,)),
}
LLAMA3_8B_SHAPES: dict[str, tuple[int, tuple[int, ...]]] = {
    "qkv": (4096, (4096, 1024, 1024)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
}


def slice_offsets(widths: Sequence[int]) -> tuple[int, ...]:
    out = [0]
    for w in widths:
        out.append(out[-1] + w)
    return tuple(out)


def random_adapter(
    shapes: dict[str, tuple[int, tuple[int, ...]]],
    num_layers: int,
    rank: int,
    dtype: torch.dtype,
    device: torch.device | str,
    gen: torch.Generator,
    targets: Sequence[str] | None = None,
) -> AdapterWeights:
    """Every (layer, target) adapted unless targets restricts them; scale differs per adapter."""
    pairs: dict[tuple[int, str], LoRAPair] = {}
    scale = 0.5 + torch.rand((), generator=gen).item()
    for layer in range(num_layers):
        for group, (d_in, widths) in shapes.items():
            for t, d_out in zip(GROUP_SLICES[group], widths, strict=True):
                if targets is not None and t not in targets:
                    continue
                a = torch.randn(rank, d_in, generator=gen) / d_in**0.5
                b = torch.randn(d_out, rank, generator=gen) / rank**0.5
                pairs[(layer, t)] = LoRAPair(a.to(device, dtype), b.to(device, dtype), scale)
    return AdapterWeights(pairs)


def make_table(
    ranks: Sequence[int],
    dtype: torch.dtype,
    device: torch.device | str,
    shapes: dict[str, tuple[int, tuple[int, ...]]] = SMALL_SHAPES,
    num_layers: int = 1,
    seed: int = 0,
    targets: Sequence[Sequence[str] | None] | None = None,
    slots: Sequence[int] | None = None,
) -> LoRASlotTable:
    gen = torch.Generator().manual_seed(seed)
    table = LoRASlotTable(num_layers)
    for i, r in enumerate(ranks):
        tg = targets[i] if targets is not None else None
        table.set(slots[i] if slots else i, random_adapter(shapes, num_layers, r, dtype, device, gen, tg))
    return table


def random_ranks(n: int, choices: Sequence[int], seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice(list(choices)) for _ in range(n)]


def reference(
    y0: torch.Tensor,
    x: torch.Tensor,
    meta: LoRABatchMetadata,
    table: LoRASlotTable,
    layer: int,
    group: str,
    offsets: Sequence[int],
) -> torch.Tensor:
    """The torch reference op in float32 (inputs and weights upcast) on x's device, as y_ref."""
    pairs = [
        [None if p is None else LoRAPair(p.a.float(), p.b.float(), p.scale) for p in seg]
        for seg in segment_pairs(meta, table, layer, group)
    ]
    y = y0.float().clone()
    h = lora_shrink(x.float(), meta, pairs)
    lora_expand(y, h, meta, pairs, offsets)
    return y


def row_errors(y: torch.Tensor, y_ref: torch.Tensor) -> torch.Tensor:
    """Per row: max|y - y_ref| / max|y_ref|."""
    diff = (y.float() - y_ref).abs().amax(dim=1)
    return diff / y_ref.abs().amax(dim=1).clamp_min(1e-12)

"""Host time of the Triton LoRA backend's `apply`, per call, with the kernel launches stubbed.

    python -m loraplex.bench.lora_host [--layers 8] [--rows 64] [--adapters 32] [--steps 50]

What an eager step pays in Python around each of its 4 LoRA calls per layer: planning, checks,
argument assembly (Triton's own launcher is not included: the kernels are replaced by no-ops).
Every pass is a new step (fresh metadata) over every layer and group, as in the engine. Small
layer shapes on the CPU: the host work does not depend on them. Needs triton importable (no GPU).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from loraplex.bench.kernel_cases import slice_offsets
from loraplex.bench.kernels import build_table
from loraplex.lora.metadata import LoRABatchMetadata

SHAPES = {"qkv": (64, (64, 16, 16)), "o": (64, (64,)), "gate_up": (64, (128, 128)), "down": (128, (64,))}


class _NoLaunch:
    """A kernel whose launches do nothing."""

    def __getitem__(self, grid: Any) -> Any:
        return lambda *args, **kwargs: None


def measure(layers: int = 8, rows: int = 64, adapters: int = 32, steps: int = 50) -> float:
    """Median µs of host time per `apply` call."""
    from loraplex.lora.ops_triton import TritonLoRABackend  # lazy: needs triton

    table = build_table((16,), torch.device("cpu"), adapters, SHAPES, layers, torch.float32)
    backend = TritonLoRABackend()
    backend._sms[torch.device("cpu")] = 132  # an H200's SM count: the plans of the real shapes
    kernels = backend._k
    backend._k = type(
        "NoLaunchKernels",
        (),
        {
            "lora_shrink_kernel": _NoLaunch(),
            "lora_expand_kernel": _NoLaunch(),
            "lora_shrink_pdl_kernel": _NoLaunch(),
            "lora_expand_pdl_kernel": _NoLaunch(),
            "lora_expand_rows_kernel": _NoLaunch(),
            "shrink_grid": kernels.shrink_grid,
            "expand_grid": kernels.expand_grid,
        },
    )()
    slots = [i % adapters for i in range(rows)]
    xs = {g: torch.randn(rows, d) for g, (d, _) in SHAPES.items()}
    ys = {g: torch.randn(rows, sum(w)) for g, (_, w) in SHAPES.items()}
    offsets = {g: slice_offsets(widths) for g, (_, widths) in SHAPES.items()}
    per_call = []
    for step in range(steps + 2):
        meta = LoRABatchMetadata.build(slots, table)  # a new step: fresh metadata
        t0 = time.perf_counter()
        for layer in range(layers):
            for g in SHAPES:
                backend.apply(ys[g], xs[g], meta, table, layer, g, offsets[g])
        if step >= 2:  # the first steps fill the per-shape caches
            per_call.append((time.perf_counter() - t0) / (layers * len(SHAPES)))
    return statistics.median(per_call) * 1e6


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    us = measure(args.layers, args.rows, args.adapters, args.steps)
    print(
        f"{args.rows} rows over {args.adapters} adapters, {args.layers} layers x 4 groups per step: "
        f"host time per LoRA apply (launches stubbed) median {us:.1f} us"
    )


if __name__ == "__main__":
    main()

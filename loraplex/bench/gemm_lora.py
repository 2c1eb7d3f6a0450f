"""`bench kernels`' "GEMM + LoRA" table: one decoder layer's base GEMMs with the LoRA op scheduled
several ways, timed as CUDA-graph replays with L2 flushed, so the cost LoRA adds to a layer of a
decode step is measured with the GEMM it runs next to (the engine's real situation), not alone.

Modes:
- `base only`: the four GEMMs (qkv, o, gate_up, down), the baseline of the ratios;
- `in place`: each GEMM, then the LoRA op adding into its output (the engine's eager steps);
- `side stream, delta`: the whole LoRA op on a side stream into a zeroed delta buffer while the
  GEMM runs, joined after. The delta is never added: the engine's captured decode steps add it
  for free in the consumer (`lora/step.py`), so this bounds them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from loraplex.bench.kernel_cases import GROUPS, LLAMA3_8B, KernelCase, slice_offsets
from loraplex.bench.timing import GpuTimer
from loraplex.lora.metadata import LoRABatchMetadata
from loraplex.lora.ops_triton import TritonLoRABackend
from loraplex.lora.triton_config import TwoLaunchTiling
from loraplex.lora.weights import LoRASlotTable

DTYPE = torch.bfloat16
MODES = ("base only", "in place", "side stream, delta")


def layer_modes(
    timer: GpuTimer,
    case: KernelCase,
    table: LoRASlotTable,
    base_w: dict[str, torch.Tensor],
    tilings: Mapping[str, TwoLaunchTiling | None],
) -> list[dict]:
    """One row per (mode, tiling): graph-replay time of the layer and its ratio to `base only`."""
    device = timer.device
    meta = LoRABatchMetadata.build(case.row_slots(), table, device)
    xs = {g: torch.randn(case.rows, d, device=device, dtype=DTYPE) for g, (d, _) in LLAMA3_8B.items()}
    ys = {g: torch.empty(case.rows, sum(w), device=device, dtype=DTYPE) for g, (_, w) in LLAMA3_8B.items()}
    deltas = {g: torch.zeros_like(y) for g, y in ys.items()}
    offs = {g: slice_offsets(w) for g, (_, w) in LLAMA3_8B.items()}
    side = torch.cuda.Stream(device)

    def make(mode: str, be: TritonLoRABackend) -> Callable[[], None]:
        def gemm(g: str) -> None:
            torch.matmul(xs[g], base_w[g].t(), out=ys[g])

        def layer() -> None:
            main = torch.cuda.current_stream(device)
            for g in GROUPS:
                args = (meta, table, 0, g, offs[g])
                if mode == "base only":
                    gemm(g)
                elif mode == "in place":
                    gemm(g)
                    be.apply(ys[g], xs[g], *args)
                else:  # side stream, delta
                    side.wait_stream(main)
                    with torch.cuda.stream(side):
                        deltas[g].zero_()
                        be.apply(deltas[g], xs[g], *args)
                    gemm(g)
                    main.wait_stream(side)

        return layer

    rows: list[dict[str, Any]] = []
    base_us: float | None = None
    for mode in MODES:
        for name, tiling in tilings.items() if mode != "base only" else [("-", None)]:
            be = TritonLoRABackend(tiling)
            be.prepare(meta, table, device)
            be.begin_step(meta, table, device, replayed=True)  # per step in the engine, not per layer
            us = 1e3 * timer.graph_median_ms(make(mode, be))
            base_us = us if mode == "base only" else base_us
            rows.append({"case": case.label, "mode": mode, "tiling": name, "graph_us": us})
    for r in rows:
        r["over_base"] = r["graph_us"] / base_us if base_us else None
    return rows


__all__ = ["MODES", "layer_modes"]

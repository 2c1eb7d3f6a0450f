"""Run the decode target layer's LoRA op (M=64, D=32, r=16, all four groups) a few times, for
Nsight Compute, from the repository root (without an installed package, PYTHONPATH=. finds it).
The decode tiling runs each group as two launches (shrink, expand), so one layer is 8 launches:
`PYTHONPATH=. ncu --clock-control none --kernel-name regex:lora_ --launch-skip 16 --launch-count 8 \
--section SpeedOfLight --section Occupancy --section WarpStateStats python scripts/ncu_lora_decode.py`
(the first two layers compile and warm up; the profiled ones are the third layer's calls).
Per-instruction stall samples: add `--section SourceCounters -o rep`, then
`ncu -i rep.ncu-rep --page source --csv --print-source sass`.

    usage: python scripts/ncu_lora_decode.py
"""

from __future__ import annotations

import torch

from loraplex.bench.kernel_cases import GROUPS, LLAMA3_8B, RANK_MIXES, TARGET_DECODE, slice_offsets
from loraplex.bench.kernels import build_table
from loraplex.lora.metadata import LoRABatchMetadata
from loraplex.lora.ops_triton import TritonLoRABackend


def main() -> None:
    dev = torch.device("cuda")
    case = TARGET_DECODE
    table = build_table(RANK_MIXES[case.ranks], dev)
    meta = LoRABatchMetadata.build(case.row_slots(), table, dev)
    be = TritonLoRABackend()
    bf16 = torch.bfloat16
    xs = {g: torch.randn(case.rows, d, device=dev, dtype=bf16) for g, (d, _) in LLAMA3_8B.items()}
    ys = {g: torch.randn(case.rows, sum(w), device=dev, dtype=bf16) for g, (_, w) in LLAMA3_8B.items()}
    be.begin_step(meta, table, dev, replayed=True)  # as a captured step begins (per-step tables)
    for _ in range(4):
        for g in GROUPS:
            be.apply(ys[g], xs[g], meta, table, 0, g, slice_offsets(LLAMA3_8B[g][1]))
    torch.cuda.synchronize()
    for g, n in be.calls.items():
        print(g, n)


if __name__ == "__main__":
    main()

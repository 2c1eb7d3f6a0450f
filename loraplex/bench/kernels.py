"""`loraplex bench kernels`: the Triton LoRA op on Llama-3-8B layer shapes, against the ceilings
(copy bandwidth, bf16 matrix rate) and the base GEMM measured in the same run.

For every case and layer (qkv, o, gate_up, down and the whole layer): median CUDA-event time
with L2 flushed, eager and as a CUDA-graph replay; the minimal bytes; achieved bandwidth as a
fraction of the measured copy bandwidth; the base GEMM of the same layer. Then the three targets,
and a tiling table (decode vs prefill tiling and variants on several shapes) that backs the
tiling choice in `loraplex.lora.triton_config`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from loraplex.bench.gemm_lora import layer_modes
from loraplex.bench.kernel_cases import (
    GROUPS,
    LAYER,
    LLAMA3_8B,
    RANK_MIXES,
    TARGET_DECODE,
    TARGET_MIXED,
    TARGET_PREFILL,
    KernelCase,
    all_cases,
    case_flops,
    case_min_bytes,
    quick_cases,
    slice_offsets,
)
from loraplex.bench.timing import GpuTimer, copy_bandwidth, matmul_rate
from loraplex.lora.layout import GROUP_SLICES
from loraplex.lora.metadata import LoRABatchMetadata
from loraplex.lora.triton_config import DECODE, PREFILL, LoRATiling, with_overrides
from loraplex.lora.weights import AdapterWeights, LoRAPair, LoRASlotTable

DTYPE = torch.bfloat16
MAX_ADAPTERS = 64
# `run_layers`: layers captured in one graph, to time a layer without the graph's fixed cost
LAYERS_PER_GRAPH = 4
# the decode default of the night of 2026-11-29, before the row loop's early B tile and table
# entries by inline assembly and down's own shrink budget
NIGHT_DECODE = with_overrides(
    DECODE, row_loop_early_b=False, row_loop_table_asm=False, long_k_min=0, long_k_per_sm=0
)
# the decode default of the evening of 2026-11-29, before atomic Y updates, the rank-16 shrink
# budget and per-step segment tables: the base of the earlier defaults below
EVENING_DECODE = with_overrides(
    NIGHT_DECODE, atomic_y=False, narrow_per_sm=0, narrow_shrink_stages=0, seg_tables=False
)

TILING_VARIANTS: dict[str, LoRATiling] = {
    # today's default: the fused plan as two PDL launches (2-warp shrink, 4-warp expand) for rank
    # tiles up to 64, 256-column expand tiles, 4 stages, Y updated by atomic adds; gate_up at rank
    # tile 16 with short segments on the row-loop expand (128-column tiles, table entries by
    # inline assembly, first B tile before the wait); at rank tile 16 a shrink budget of 2
    # programs per SM (3 for down) with up to 8 stages
    "decode": DECODE,
    # earlier defaults, to compare against: one launch with arrival counters and 4 warps (rank
    # tile 16 only); the split launch as first made the default (2-warp expands, 64-column tiles
    # at rank tile 64, mixed ranks on the two-launch path); the morning of 2026-11-29 (3 stages,
    # no row-loop expand); the evening of 2026-11-29 ("decode previous")
    "decode fused w4": with_overrides(
        EVENING_DECODE,
        fused_warps=4,
        fused_split_launch=False,
        split_expand_warps=0,
        fused_max_rank=16,
        fused_tile_elems=4096,
        fused_stages=3,
        row_loop_min_width=0,
    ),
    "decode split w2 r16": with_overrides(
        EVENING_DECODE,
        split_expand_warps=0,
        fused_max_rank=16,
        fused_tile_elems=4096,
        fused_stages=3,
        row_loop_min_width=0,
    ),
    "decode stages=3 no row-loop": with_overrides(EVENING_DECODE, fused_stages=3, row_loop_min_width=0),
    # one change each, on top of the default
    "decode no row-loop": with_overrides(DECODE, row_loop_min_width=0),
    "decode no-pdl": with_overrides(DECODE, pdl=False),
    "decode stages=3": with_overrides(DECODE, fused_stages=3),
    "decode two-launch": with_overrides(DECODE, fused=False),
    "decode w4": with_overrides(DECODE, fused_warps=4),  # 4-warp shrink programs
    "decode w2e": with_overrides(DECODE, split_expand_warps=2),  # 2-warp expand programs
    "decode bn512": with_overrides(DECODE, fused_block_n=512, fused_tile_elems=32768),
    # 2 tiles per expand program, both B tiles loaded before the PDL wait
    "decode sub2": with_overrides(DECODE, fused_expand_sub=2),
    "decode te4096": with_overrides(DECODE, fused_tile_elems=4096),  # 64-column tiles at rank tile 64
    # the shrink's grid share by bytes, at most 16 K chunks (gate_up's shrink then had 5 chunks of
    # 7 K steps, and its expand programs spent a quarter of their time waiting)
    "decode byte-share": with_overrides(DECODE, fused_min_share=0.2, fused_max_share=0.8, fused_max_split=16),
    # K chunks of one step (up to 64 per row tile) with a 16-programs-per-SM budget, or a budget of 8
    "decode k1 budget16": with_overrides(DECODE, fused_min_k_steps=1, fused_max_split=64, fused_per_sm=16),
    "decode budget8": with_overrides(DECODE, fused_per_sm=8),
    # one 256-column K step per chunk: all of a shrink program's loads issued at once
    "decode bk256": with_overrides(DECODE, block_k=256, fused_min_k_steps=1),
    # per-step segment tables (one dependent load fewer per program; the default since the night
    # of 2026-11-29, so this name now equals "decode" and "decode no seg-tables" is the other form)
    "decode seg-tables": with_overrides(DECODE, seg_tables=True),
    # the row-loop expand: 256- or 64-column tiles; for every group; at any rank tile; for long
    # segments too
    "decode row-loop te4096": with_overrides(DECODE, row_loop_tile_elems=4096),
    "decode row-loop te1024": with_overrides(DECODE, row_loop_tile_elems=1024),
    "decode row-loop all": with_overrides(DECODE, row_loop_min_width=1),
    "decode row-loop any rank": with_overrides(DECODE, row_loop_max_rank=64),
    # ... at any rank tile with 128-column tiles at rank tile 64 (32 KB of B per pipeline stage)
    "decode row-loop any rank te8192": with_overrides(DECODE, row_loop_max_rank=64, row_loop_tile_elems=8192),
    "decode row-loop long segments": with_overrides(DECODE, row_loop_max_avg_rows=64.0),
    # the row loop's pipeline with more stages: with the default's inline-assembly table loads,
    # num_stages - 1 B tiles in flight (measured when the table loads were pipelined, which
    # drained B every step, and lost). (B tiles prefetched in registers, 1-4 deep, were slower
    # still and were removed: docs/kernels.md.)
    "decode row-loop stages=6": with_overrides(DECODE, row_loop_stages=6),
    "decode row-loop stages=8": with_overrides(DECODE, row_loop_stages=8),
    # ... with the registers capped so that all of gate_up's row-loop programs stay resident at
    # once (the deeper forms above need more than 72 per thread, which makes two waves)
    **{
        f"decode row-loop stages={st} maxnreg{mr}": with_overrides(
            DECODE, row_loop_stages=st, row_loop_maxnreg=mr
        )
        for st, mr in ((4, 64), (6, 72), (8, 72), (10, 72), (8, 64))
    },
    # the shrink with 3 stages (2 buffers: its K chunks are 2-5 steps) and less shared memory
    "decode shrink stages=3": with_overrides(DECODE, split_shrink_stages=3),
    # Y read and written instead of atomic adds; K chunks of at least 4 steps (half the h partials
    # to sum)
    "decode no atomic-y": with_overrides(DECODE, atomic_y=False),
    "decode no narrow": with_overrides(DECODE, narrow_per_sm=0, narrow_shrink_stages=0),
    "decode no seg-tables": with_overrides(DECODE, seg_tables=False),
    "decode previous": EVENING_DECODE,
    "decode k4": with_overrides(DECODE, fused_min_k_steps=4),
    # fewer, longer shrink programs (a grid budget of 2-4 per SM: all resident beside the expand
    # before them, so none pays its metadata loads after the wait), with deeper pipelines
    "decode budget2 shrink-st6": with_overrides(DECODE, fused_per_sm=2, split_shrink_stages=6),
    "decode budget3 shrink-st5": with_overrides(DECODE, fused_per_sm=3, split_shrink_stages=5),
    "decode budget4": with_overrides(DECODE, fused_per_sm=4),
    "decode budget2": with_overrides(DECODE, fused_per_sm=2),
    # ... at rank tile 16 only
    **{
        f"decode r16 budget{b} shrink-st{st}": with_overrides(
            DECODE, narrow_per_sm=b, narrow_shrink_stages=st
        )
        for b, st in ((2, 6), (2, 8), (2, 5), (3, 6), (3, 8), (2, 10))
    },
    "decode row-loop te4096 w8": with_overrides(DECODE, row_loop_tile_elems=4096, row_loop_warps=8),
    # the default before the night of 2026-11-29 (no early B tile, no long-K budget, table entries
    # by pipelined loads), and each of those three changes taken back alone
    "decode night": NIGHT_DECODE,
    "decode no early-b": with_overrides(DECODE, row_loop_early_b=False),
    "decode no long-k": with_overrides(DECODE, long_k_min=0, long_k_per_sm=0),
    "decode no table-asm": with_overrides(DECODE, row_loop_table_asm=False),
    # the row loop with its B tiles 4 ahead instead of 3 (5 stages; "decode row-loop stages=6"
    # above: 5 ahead)
    "decode row-loop stages=5": with_overrides(DECODE, row_loop_stages=5),
    "prefill": PREFILL,
}
TILING_CASES = (
    TARGET_DECODE,
    TARGET_MIXED,
    KernelCase("decode", 1, 1, "16"),  # the fixed cost per layer
    KernelCase("decode", 256, 8, "16"),  # 32 rows per adapter: the cut-over region
    TARGET_PREFILL,
)


def build_table(
    ranks: tuple[int, ...],
    device: torch.device,
    n: int = MAX_ADAPTERS,
    shapes: dict[str, tuple[int, tuple[int, ...]]] = LLAMA3_8B,
    layers: int = 1,
    dtype: torch.dtype = DTYPE,
) -> LoRASlotTable:
    """n adapters on `layers` layers of `shapes` (group -> (d_in, slice widths)), adapter i at rank
    ranks[i % len(ranks)], every target adapted."""
    table = LoRASlotTable(layers)
    for i in range(n):
        r = ranks[i % len(ranks)]
        pairs = {}
        for layer in range(layers):
            for group, (d_in, widths) in shapes.items():
                for t, d_out in zip(GROUP_SLICES[group], widths, strict=True):
                    a = torch.randn(r, d_in, device=device, dtype=dtype) * d_in**-0.5
                    b = torch.randn(d_out, r, device=device, dtype=dtype) * r**-0.5
                    pairs[(layer, t)] = LoRAPair(a, b, 2.0)
        table.set(i, AdapterWeights(pairs))
    return table


class KernelBench:
    def __init__(self, device: torch.device, reps: int, warmup: int) -> None:
        from loraplex.lora.ops_triton import TritonLoRABackend

        self.device = device
        self.timer = GpuTimer(device, reps, warmup)
        self.backend_cls = TritonLoRABackend
        self.tables: dict[tuple[str, int], LoRASlotTable] = {}  # (rank mix, layers) -> adapters
        self.base_weights = {
            g: torch.randn(sum(w), d, device=device, dtype=DTYPE) * d**-0.5 for g, (d, w) in LLAMA3_8B.items()
        }
        self._base_cache: dict[int, dict[str, dict[str, float]]] = {}

    def table(self, ranks: str, layers: int = 1) -> LoRASlotTable:
        key = (ranks, layers)
        if key not in self.tables:
            self.tables = {}  # one table resident at a time keeps memory flat
            torch.cuda.empty_cache()
            self.tables[key] = build_table(RANK_MIXES[ranks], self.device, layers=layers)
        return self.tables[key]

    def _prepared(self, case: KernelCase, table: LoRASlotTable, tiling: LoRATiling | None) -> tuple:
        """(metadata, its build time in µs, a backend ready for it): device tables synced and
        `begin_step` run, which the engine does once per step, so outside the per-layer timing."""
        t0 = time.perf_counter()
        meta = LoRABatchMetadata.build(case.row_slots(), table, self.device)
        build_us = 1e6 * (time.perf_counter() - t0)
        be = self.backend_cls(tiling)
        be.prepare(meta, table, self.device)
        be.begin_step(meta, table, self.device, replayed=True)  # every case is timed as graph replays
        return meta, build_us, be

    def _io(self, rows: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        xs = {g: torch.randn(rows, d, device=self.device, dtype=DTYPE) for g, (d, _) in LLAMA3_8B.items()}
        ys = {
            g: torch.randn(rows, sum(w), device=self.device, dtype=DTYPE) for g, (_, w) in LLAMA3_8B.items()
        }
        return xs, ys

    def _time_pair(self, fn: Callable[[], object]) -> dict[str, float]:
        return {"eager_us": 1e3 * self.timer.median_ms(fn), "graph_us": 1e3 * self.timer.graph_median_ms(fn)}

    def base_gemm(self, rows: int) -> dict[str, dict[str, float]]:
        """Base linear layers of the same shapes (cuBLAS through F.linear), cached per row count."""
        if rows not in self._base_cache:
            xs, _ = self._io(rows)
            fns: dict[str, Callable[..., object]] = {
                g: (lambda g=g: F.linear(xs[g], self.base_weights[g])) for g in GROUPS
            }
            fns[LAYER] = lambda: [fns[g]() for g in GROUPS]
            self._base_cache[rows] = {g: self._time_pair(fn) for g, fn in fns.items()}
        return self._base_cache[rows]

    def graph_floor_us(self) -> float:
        """A CUDA-graph replay of one tiny kernel, timed like every case: the fixed cost (event,
        graph launch, first kernel start) inside each graph time, which a layer inside a whole
        captured step does not pay."""
        one = torch.zeros(1, device=self.device)
        return 1e3 * self.timer.graph_median_ms(lambda: one.add_(1))

    def layers_fn(self, case: KernelCase, tiling: LoRATiling | None, layers: int = 1) -> Callable[[], None]:
        """The whole-layer op (every group) for `layers` consecutive layers, each with its own
        weights (as in a captured decode step, where no layer finds its adapters in L2), on the
        case's inputs, with the step begun as the engine begins it."""
        table = self.table(case.ranks, layers)
        meta, _, be = self._prepared(case, table, tiling)
        xs, ys = self._io(case.rows)
        offs = {g: slice_offsets(w) for g, (_, w) in LLAMA3_8B.items()}

        def step() -> None:
            for layer in range(layers):
                for g in GROUPS:
                    be.apply(ys[g], xs[g], meta, table, layer, g, offs[g])

        return step

    def run_layers(self, case: KernelCase, tiling: LoRATiling | None, layers: int = LAYERS_PER_GRAPH) -> dict:
        """The whole-layer op for `layers` consecutive layers in one graph (`layers_fn`); time per
        layer."""
        us = 1e3 * self.timer.graph_median_ms(self.layers_fn(case, tiling, layers)) / layers
        return {"graph_us": us, "min_bytes": case_min_bytes(case, LAYER), "layers": layers}

    def run_case(self, case: KernelCase, tiling: LoRATiling | None = None, groups: bool = True) -> dict:
        table = self.table(case.ranks)
        meta, build_us, be = self._prepared(case, table, tiling)
        xs, ys = self._io(case.rows)
        offs = {g: slice_offsets(w) for g, (_, w) in LLAMA3_8B.items()}

        def one(g: str) -> Callable[[], None]:
            return lambda: be.apply(ys[g], xs[g], meta, table, 0, g, offs[g])

        fns: dict[str, Callable[[], object]] = {g: one(g) for g in GROUPS} if groups else {}
        fns[LAYER] = lambda: [be.apply(ys[g], xs[g], meta, table, 0, g, offs[g]) for g in GROUPS]
        out = {"case": asdict(case), "label": case.label, "meta_build_us": build_us, "layers": {}}
        for g, fn in fns.items():
            m = self._time_pair(fn)
            m["min_bytes"] = case_min_bytes(case, g)
            m["flops"] = case_flops(case, g)
            out["layers"][g] = m
        return out


def _add_ratios(res: dict, copy_bw: float, mm_rate: float, base: dict[str, dict[str, float]]) -> None:
    for g, m in res["layers"].items():
        for mode in ("eager", "graph"):
            t = m[f"{mode}_us"] * 1e-6
            m[f"{mode}_copy_frac"] = m["min_bytes"] / t / copy_bw
            m[f"{mode}_mm_frac"] = m["flops"] / t / mm_rate
        m["base_eager_us"] = base[g]["eager_us"]
        m["base_graph_us"] = base[g]["graph_us"]


def evaluate_targets(results: list[dict], copy_bw: float, mm_rate: float) -> list[dict]:
    by = {r["label"]: r["layers"][LAYER] for r in results}
    out = []
    d = by.get(TARGET_DECODE.label)
    if d:
        frac = d["graph_copy_frac"]
        out.append({"name": "decode layer M=64 D=32 r=16: copy-bw fraction (graph)", "value": frac,
                    "threshold": ">= 0.50", "pass": frac >= 0.5})  # fmt: skip
    mx = by.get(TARGET_MIXED.label)
    if d and mx:
        allowed = 1.15 * d["graph_us"] * mx["min_bytes"] / d["min_bytes"]
        out.append({"name": "mixed ranks M=64 D=32: time / (r=16 time x bytes ratio) (graph)",
                    "value": mx["graph_us"] / (allowed / 1.15), "threshold": "<= 1.15",
                    "pass": mx["graph_us"] <= allowed})  # fmt: skip
    p = by.get(TARGET_PREFILL.label)
    if p:
        t = min(p["eager_us"], p["graph_us"]) * 1e-6
        bytes_floor, flops_floor = p["min_bytes"] / copy_bw, p["flops"] / mm_rate
        bound = "copy bandwidth" if bytes_floor >= flops_floor else "matrix rate"
        frac = max(bytes_floor, flops_floor) / t
        out.append({"name": f"prefill layer M=4096 D=8 r=16: fraction of {bound}", "value": frac,
                    "threshold": ">= 0.50", "pass": frac >= 0.5})  # fmt: skip
    return out


def run(
    out_dir: Path,
    quick: bool = False,
    reps: int = 40,
    warmup: int = 5,
    sweep: bool = True,
    variants: set[str] | None = None,
    gemm_lora: bool = True,
) -> dict:
    """variants: the tiling variants the sweep times (None: all of TILING_VARIANTS)."""
    import triton

    from loraplex.bench.report import write_report

    if not torch.cuda.is_available():
        raise SystemExit("bench kernels needs a CUDA device")
    device = torch.device("cuda")
    bench = KernelBench(device, reps, warmup)
    copy_bw = copy_bandwidth(bench.timer)
    mm_rate = matmul_rate(bench.timer)
    print(
        f"copy bandwidth {copy_bw / 1e9:.0f} GB/s, bf16 matrix rate {mm_rate / 1e12:.0f} TFLOP/s", flush=True
    )
    report: dict = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_bw_GBps": copy_bw / 1e9,
        "matmul_TFLOPs": mm_rate / 1e12,
        "reps": reps,
        "results": [],
        "tiling": [],
        "targets": [],
    }
    report["graph_floor_us"] = bench.graph_floor_us()
    print(f"graph replay of one tiny kernel {report['graph_floor_us']:.1f} us (the fixed cost in every "
          "graph time)", flush=True)  # fmt: skip
    first = quick_cases()  # the target cases first, so a cut-short run still has them
    for case in first if quick else first + [c for c in all_cases() if c not in first]:
        try:
            res = bench.run_case(case)
        except Exception as e:  # report it and go on: the other cases and the sweep still run
            print(f"{case.label}: {type(e).__name__}: {e}", flush=True)
            continue
        _add_ratios(res, copy_bw, mm_rate, bench.base_gemm(case.rows))
        lay = res["layers"][LAYER]
        print(f"{case.label:28s} layer {lay['eager_us']:8.1f} us eager {lay['graph_us']:8.1f} us graph "
              f"{lay['graph_copy_frac']:5.2f} of copy bw", flush=True)  # fmt: skip
        report["results"].append(res)
        report["targets"] = evaluate_targets(report["results"], copy_bw, mm_rate)
        write_report(report, out_dir, plot_png=False)  # partial results survive a cut-short run
    if gemm_lora:
        # the default decode tiling, plus the decode variants asked for
        tilings = {
            n: t
            for n, t in TILING_VARIANTS.items()
            if n == "decode" or (n.startswith("decode") and variants is not None and n in variants)
        }
        try:
            report["gemm_lora"] = layer_modes(
                bench.timer, TARGET_DECODE, bench.table(TARGET_DECODE.ranks), bench.base_weights, tilings
            )
        except Exception as e:  # the table is extra: its failure must not cost the sweep
            print(f"GEMM + LoRA table: {type(e).__name__}: {e}", flush=True)
        for r in report.get("gemm_lora", []):
            print(f"  gemm+lora {r['mode']:20s} {r['tiling']:22s} graph {r['graph_us']:8.1f} us "
                  f"{r['over_base']:6.3f} x base", flush=True)  # fmt: skip
        write_report(report, out_dir, plot_png=False)
    if sweep:
        for case in TILING_CASES:
            for name, tiling in TILING_VARIANTS.items():
                if variants is not None and name not in variants:
                    continue
                if case.phase == "prefill" and name not in ("decode", "prefill"):
                    continue  # the decode variants differ only where the fused path applies
                try:
                    lay = bench.run_case(case, tiling, groups=False)["layers"][LAYER]
                except Exception as e:  # one broken variant must not cost the rest of the sweep
                    print(f"tiling {name} on {case.label}: {type(e).__name__}: {e}", flush=True)
                    continue
                row = {
                    "case": case.label,
                    "tiling": name,
                    "eager_us": lay["eager_us"],
                    "graph_us": lay["graph_us"],
                }
                print(f"  tiling {case.label:26s} {name:24s} graph {row['graph_us']:8.1f} us", flush=True)
                report["tiling"].append(row)
        # the decode target again, per layer of a multi-layer graph (informational, not a target)
        report["layers_per_graph"] = []
        for name, tiling in TILING_VARIANTS.items():
            if not name.startswith("decode") or (variants is not None and name not in variants):
                continue
            try:
                r = bench.run_layers(TARGET_DECODE, tiling)
            except Exception as e:
                print(f"layers per graph, {name}: {type(e).__name__}: {e}", flush=True)
                continue
            r.update(
                case=TARGET_DECODE.label,
                tiling=name,
                copy_frac=r["min_bytes"] / (r["graph_us"] * 1e-6) / copy_bw,
            )
            print(f"  layers x{r['layers']} {r['case']:22s} {name:24s} graph {r['graph_us']:8.1f} us "
                  f"per layer {r['copy_frac']:.3f} of copy bw", flush=True)  # fmt: skip
            report["layers_per_graph"].append(r)
    write_report(report, out_dir)
    return report

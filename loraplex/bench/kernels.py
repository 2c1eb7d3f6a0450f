"""`loraplex bench kernels`: the Triton LoRA op on Llama-3-8B layer shapes, against the ceilings
(copy bandwidth, bf16 matrix rate) and the base GEMM measured in the same run.

For every case and layer (qkv, o, gate_up, down and the whole layer): median CUDA-event time
with L2 flushed, eager and as a CUDA-graph replay; the minimal bytes; achieved bandwidth as a
fraction of the measured copy bandwidth; the base GEMM of the same layer. Then the three targets,
and a tiling table (the decode and the prefill tiling, each forced on several shapes) that backs
the tiling choice in `loraplex.lora.triton_config`.
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
    TARGET_SINGLE,
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
from loraplex.lora.triton_config import DECODE, PREFILL, TwoLaunchTiling
from loraplex.lora.weights import AdapterWeights, LoRAPair, LoRASlotTable

DTYPE = torch.bfloat16
MAX_ADAPTERS = 64
# `run_layers`: layers captured in one graph, to time a layer without the graph's fixed cost
LAYERS_PER_GRAPH = 4
# the tiling table's rows: each shipped tiling forced on every step of the case
TILINGS: dict[str, TwoLaunchTiling] = {"decode": DECODE, "prefill": PREFILL}
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

    def _prepared(self, case: KernelCase, table: LoRASlotTable, tiling: TwoLaunchTiling | None) -> tuple:
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

    def layers_fn(
        self, case: KernelCase, tiling: TwoLaunchTiling | None, layers: int = 1
    ) -> Callable[[], None]:
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

    def run_layers(
        self, case: KernelCase, tiling: TwoLaunchTiling | None, layers: int = LAYERS_PER_GRAPH
    ) -> dict:
        """The whole-layer op for `layers` consecutive layers in one graph (`layers_fn`); time per
        layer."""
        us = 1e3 * self.timer.graph_median_ms(self.layers_fn(case, tiling, layers)) / layers
        return {"graph_us": us, "min_bytes": case_min_bytes(case, LAYER), "layers": layers}

    def run_case(self, case: KernelCase, tiling: TwoLaunchTiling | None = None, groups: bool = True) -> dict:
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
    for case, most_us in TARGET_SINGLE.items():
        one = by.get(case.label)
        if one:
            out.append({"name": f"single adapter {case.label.removeprefix('decode ')}: µs (graph)",
                        "value": one["graph_us"], "threshold": f"<= {most_us:g}",
                        "pass": one["graph_us"] <= most_us})  # fmt: skip
    return out


def run(
    out_dir: Path,
    quick: bool = False,
    reps: int = 40,
    warmup: int = 5,
    sweep: bool = True,
    gemm_lora: bool = True,
) -> dict:
    """sweep: also the tiling table and the decode target per layer of a multi-layer graph."""
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
        try:
            report["gemm_lora"] = layer_modes(
                bench.timer,
                TARGET_DECODE,
                bench.table(TARGET_DECODE.ranks),
                bench.base_weights,
                {"decode": DECODE},
            )
        except Exception as e:  # the table is extra: its failure must not cost the sweep
            print(f"GEMM + LoRA table: {type(e).__name__}: {e}", flush=True)
        for r in report.get("gemm_lora", []):
            print(f"  gemm+lora {r['mode']:20s} {r['tiling']:22s} graph {r['graph_us']:8.1f} us "
                  f"{r['over_base']:6.3f} x base", flush=True)  # fmt: skip
        write_report(report, out_dir, plot_png=False)
    if sweep:
        for case in TILING_CASES:
            for name, tiling in TILINGS.items():
                try:
                    lay = bench.run_case(case, tiling, groups=False)["layers"][LAYER]
                except Exception as e:  # one broken case must not cost the rest of the table
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
        try:
            r = bench.run_layers(TARGET_DECODE, DECODE)
            r.update(
                case=TARGET_DECODE.label,
                tiling="decode",
                copy_frac=r["min_bytes"] / (r["graph_us"] * 1e-6) / copy_bw,
            )
            print(f"  layers x{r['layers']} {r['case']:22s} {'decode':24s} graph {r['graph_us']:8.1f} us "
                  f"per layer {r['copy_frac']:.3f} of copy bw", flush=True)  # fmt: skip
            report["layers_per_graph"].append(r)
        except Exception as e:
            print(f"layers per graph: {type(e).__name__}: {e}", flush=True)
    write_report(report, out_dir)
    return report

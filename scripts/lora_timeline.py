"""When each launch of a LoRA layer starts and ends inside a CUDA-graph replay, from the profiler's
kernel trace: the critical path of the decode layer (8 launches chained by PDL waits), which the
graph replay time alone does not show.

For each case (the shipped tilings, as the engine picks them): the layer's graph is replayed
`--reps` times under
`torch.profiler`, each replay after the same L2 flush as `bench kernels`; per launch (in layer
order), the median start and end relative to the replay's first LoRA kernel start, the median
duration, the grid and the registers per thread. Also the span (first start to last end) and
the gap from the flush's end to the first LoRA kernel (the graph launch's share of the fixed cost).
A short table per case goes to stdout; everything to --out as JSON.

    usage: PYTHONPATH=. python scripts/lora_timeline.py [--cases target,m1] [--reps 30] [--out timeline.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from loraplex.bench.kernel_cases import GROUPS, TARGET_DECODE, TARGET_MIXED, KernelCase
from loraplex.bench.kernels import KernelBench

CASES = {"target": TARGET_DECODE, "m1": KernelCase("decode", 1, 1, "16"), "mixed": TARGET_MIXED}


def _kernel_events(trace_path: Path) -> list[dict]:
    events = json.loads(trace_path.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    return sorted(kernels, key=lambda e: e["ts"])


def _replays(kernels: list[dict]) -> list[tuple[dict | None, list[dict]]]:
    """Split the trace into (the last other kernel before: the flush, LoRA kernels of one replay)."""
    out: list[tuple[dict | None, list[dict]]] = []
    before: dict | None = None
    cur: list[dict] = []
    for k in kernels:
        if k["name"].startswith("lora_"):
            if not cur:
                out.append((before, cur))
            cur.append(k)
        else:
            before, cur = k, []
    return out


def timeline(bench: KernelBench, case: KernelCase, reps: int) -> dict:
    # the step function holds the backend, metadata and inputs the graph's kernels read: it must
    # outlive the graph (freed, their memory is reused by the next allocations, such as the
    # flush's result, and the replays read whatever lands there)
    step = bench.layers_fn(case, None)
    graph = bench.timer.capture(step)
    for _ in range(5):
        bench.timer.flush_l2()
        graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            bench.timer.flush_l2()
            graph.replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        replays = _replays(_kernel_events(path))
    n = statistics.mode(len(r) for _, r in replays)
    replays = [(f, r) for f, r in replays if len(r) == n]
    rows = []
    for i in range(n):
        starts = [r[i]["ts"] - r[0]["ts"] for _, r in replays]
        ends = [r[i]["ts"] + r[i]["dur"] - r[0]["ts"] for _, r in replays]
        args = replays[0][1][i].get("args", {})
        rows.append({
            "launch": i, "group": GROUPS[i * len(GROUPS) // n] if n % len(GROUPS) == 0 else "",
            "name": replays[0][1][i]["name"], "grid": args.get("grid"),
            "registers": args.get("registers per thread"),
            "start_us": statistics.median(starts), "end_us": statistics.median(ends),
            "dur_us": statistics.median(r[i]["dur"] for _, r in replays),
        })  # fmt: skip
    span = statistics.median(max(k["ts"] + k["dur"] for k in r) - r[0]["ts"] for _, r in replays)
    gaps = [r[0]["ts"] - (f["ts"] + f["dur"]) for f, r in replays if f is not None]
    # cross-checks: the flush must take a 512 MB read's time, and the same graph timed by CUDA
    # events outside the profiler should be about the span plus the graph launch
    flush_us = [f["dur"] for f, _ in replays if f is not None]
    graph_us = 1e3 * bench.timer.median_ms(graph.replay)
    del graph, step  # the graph first: nothing may replay it once its buffers are gone
    return {"case": case.label, "replays": len(replays), "launches": rows,
            "span_us": span, "flush_to_first_us": statistics.median(gaps) if gaps else None,
            "flush_us": statistics.median(flush_us) if flush_us else None,
            "flush_kernel": replays[0][0]["name"] if replays[0][0] else None,
            "graph_us": graph_us}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="target,m1")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="timeline.json")
    a = ap.parse_args()
    bench = KernelBench(torch.device("cuda"), reps=a.reps, warmup=5)
    results = []
    for case_name in a.cases.split(","):
        r = timeline(bench, CASES[case_name], a.reps)
        results.append(r)
        print(f"\n{r['case']}: span {r['span_us']:.1f} us, flush end -> first LoRA kernel "
              f"{r['flush_to_first_us']} us ({r['replays']} replays); graph replay "
              f"{r['graph_us']:.1f} us by events; flush {r['flush_us']} us "
              f"({str(r['flush_kernel'])[:40]})")  # fmt: skip
        # after: from the end of the launch before (the first: from the first start), which a
        # PDL-launched kernel's own start and duration (its programs wait early) do not show
        heads = ("start", "end", "dur", "after")
        print(f"  {'launch':28s} {'grid':>12s} {'regs':>5s} " + " ".join(f"{h:>7s}" for h in heads))
        prev_end = 0.0
        for k in r["launches"]:
            label = f"{k['group']} {k['name'].replace('lora_', '').replace('_kernel', '')}"
            print(f"  {label:28s} {str(k['grid']):>12s} {str(k['registers']):>5s} {k['start_us']:7.1f} "
                  f"{k['end_us']:7.1f} {k['dur_us']:7.1f} {k['end_us'] - prev_end:7.1f}")  # fmt: skip
            prev_end = k["end_us"]
    Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

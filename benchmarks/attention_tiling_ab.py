"""Serving A/B of attention tilings on a GPU: the issue-16 workload with every request on the base
model, one engine per tiling, all in one process, in the order given and then in reverse (so that
neither side always runs first); prints each run's output tokens/s against pure decode of a full
batch, and a table last.

    python benchmarks/attention_tiling_ab.py "" "prefill_num_stages=4" [--requests 1000]

Each spec is `field=value[,field=value]` over `AttentionTiling`'s integer fields
(`layers/attention_tiling.py`); "" is the shipped tiling. Each run writes `bench serve`'s JSON,
markdown and plot under --out. One 1,000-request run takes ~2 minutes on an H200 (a warm-up,
then ~30 s of serving).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

from serve_base_run import run_base_only  # benchmarks/, this script's folder

from loraplex.layers import attention_tiling


def parse_spec(spec: str) -> dict[str, int]:
    """`a=1,b=2` -> {"a": 1, "b": 2} over AttentionTiling's (integer) fields."""
    names = [f.name for f in dataclasses.fields(attention_tiling.AttentionTiling)]
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, value = part.partition("=")
        if name not in names:
            raise SystemExit(f"unknown AttentionTiling field {name!r}; fields: {', '.join(names)}")
        out[name] = int(value)
    return out


def run_one(spec: str, index: int, args: argparse.Namespace) -> dict[str, Any]:
    shipped = attention_tiling.AttentionTiling()
    attention_tiling.DEFAULT_TILING = dataclasses.replace(shipped, **parse_spec(spec))
    run = run_base_only(Path(args.out) / f"run{index}", args.requests, args.seed, args.device, args.smoke)
    result = {"spec": spec or "(shipped)", **run}
    print("RESULT", json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("specs", nargs="+", help='AttentionTiling overrides per run; "" = shipped')
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="bench-results/attention-tiling-ab")
    parser.add_argument("--once", action="store_true", help="the given order only, not reversed too")
    parser.add_argument("--smoke", action="store_true", help="the CPU demo model, to check the script")
    args = parser.parse_args()
    order = list(args.specs) + ([] if args.once else list(reversed(args.specs)))
    results = [run_one(spec, i, args) for i, spec in enumerate(order)]
    print("\n| tiling | output tok/s | / pure decode | steady part | mixed-step median ms |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in results:
        print(f"| {r['spec']} | {r['output_tokens_per_s']:.0f} | {r['ratio']:.4f} | {r['steady_ratio']:.4f} "
              f"| {r['mixed_median_ms']:.2f} |")  # fmt: skip
    by_spec: dict[str, list[float]] = {}
    for r in results:
        by_spec.setdefault(r["spec"], []).append(r["output_tokens_per_s"])
    base = statistics.fmean(by_spec[results[0]["spec"]])
    for spec, values in by_spec.items():
        mean = statistics.fmean(values)
        print(f"{spec}: mean {mean:.0f} tok/s, {mean / base:.4f}x the first")


if __name__ == "__main__":
    main()

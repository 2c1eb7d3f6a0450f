"""One serving run of the issue-16 workload with every request on the base model, in this tree:
prints one `RESULT {json}` line last (output tokens/s, against pure decode of a full batch over
the whole run and the steady part, what the run's step costs allow, mixed and decode step
medians). The unit of a serving A/B between commits on a GPU:

    scripts/ab.sh prepare OLD NEW                      # development machine; carry .ab
    scripts/ab.sh run 1 'PYTHONPATH=$PWD python3 $AB_ROOT/benchmarks/serve_base_run.py' OLD NEW
    scripts/ab.sh run 1 'PYTHONPATH=$PWD python3 $AB_ROOT/benchmarks/serve_base_run.py' NEW OLD

(the second call in the other order, on the same machine start where the budget allows). Compare
tokens/s: the ratio's denominator, the run's own full decode step, moves by ~1% from run to run.
`benchmarks/attention_tiling_ab.py` runs the same workload per tiling in one process.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from loraplex.bench.cli import main as bench_main

WORKLOAD = [
    "--random-layers", "32", "--num-adapters", "32", "--ranks", "16", "--popularity", "zipf:1.0",
    "--base-share", "1.0", "--prompt-len", "uniform:128:1024", "--output-len", "uniform:64:256",
    "--arrivals", "closed:64", "--no-base-compare", "--quiet",
]  # fmt: skip

# The script's own check on a CPU (the demo model; the plumbing, not the numbers)
SMOKE = ["--smoke", "--base-share", "1.0", "--no-base-compare", "--quiet"]


def run_base_only(out: Path, requests: int, seed: int, device: str, smoke: bool) -> dict[str, Any]:
    """`bench serve` of the workload into `out`; returns the run's summary numbers."""
    workload = SMOKE if smoke else ["--device", device, *WORKLOAD]
    bench_main(["serve", *workload, "--num-requests", str(requests), "--seed", str(seed), "--out", str(out)])
    report = json.loads((out / "serve.json").read_text())
    run = report["adapters"]  # the one measured run (every request on the base model)
    steps = run["steps"]
    nan = float("nan")
    decode = steps["full_batch_decode"]["output_tokens_per_s"] or nan  # None: no full decode batch
    bound = steps.get("decode_bound") or {}
    by_kind = steps["by_kind"]
    return {
        "output_tokens_per_s": run["output_tokens_per_s"],
        "ratio": run["output_tokens_per_s"] / decode,
        "steady_ratio": ((run.get("steady") or {}).get("output_tokens_per_s") or nan) / decode,
        "bound": bound.get("fraction_of_full_batch_decode", nan),
        "mixed_median_ms": by_kind.get("mixed", {}).get("median_s", nan) * 1e3,
        "decode_median_ms": by_kind.get("decode", {}).get("median_s", nan) * 1e3,
        "mixed_full_batch_by_rows": steps.get("mixed_full_batch_by_rows"),
        "after_startup": report.get("after_startup"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=os.environ.get("AB_OUT", "bench-results/serve-base-run"))
    parser.add_argument("--smoke", action="store_true", help="the CPU demo model, to check the script")
    args = parser.parse_args()
    result = run_base_only(Path(args.out), args.requests, args.seed, args.device, args.smoke)
    result["version"] = os.environ.get("AB_VERSION")
    print("RESULT", json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

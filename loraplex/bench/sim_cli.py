"""`loraplex bench simulate`: a workload through each scheduling policy on the simulator, one table
and one PNG comparing them; optionally the step-cost model fitted to `bench serve` results first,
and checked against results (held back from the fit when they are other files)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

from loraplex.bench.workloads import add_workload_flags

# A few seconds of CPU: 3 tenants (one at twice the others' rate), 16 adapters, Zipf, bursts,
# deadlines for one tenant, fewer device slots than adapters.
SMOKE = {
    "num_requests": 600,
    "num_adapters": 16,
    "arrivals": "burst:12:3:10:2",
    "tenants": "a:2,b:1,c:1",
    "deadlines": "b:2000",
    "prompt_len": "uniform:64:512",
    "output_len": "uniform:16:128",
}
DEFAULT = {"num_requests": 10000, "arrivals": "poisson:16", "tenants": "a:2,b:1,c:1"}


def _run(args: argparse.Namespace) -> int:
    from loraplex.bench import sim_fit
    from loraplex.bench.sim_cost import H200, StepCost
    from loraplex.bench.sim_report import markdown, plot, summarize
    from loraplex.bench.simulate import POLICIES, SimConfig, simulate
    from loraplex.bench.workloads import WorkloadSpec, generate

    try:
        given = {
            f.name: getattr(args, f.name) for f in fields(WorkloadSpec) if getattr(args, f.name) is not None
        }
        spec = WorkloadSpec(**{**(SMOKE if args.smoke else DEFAULT), **given})
        policies = [POLICIES[name] for name in args.policies.split(",")]
    except KeyError as err:
        raise SystemExit(f"error: unknown policy {err}; known: {', '.join(POLICIES)}") from None
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    cost = StepCost.from_dict(json.loads(args.cost.read_text())) if args.cost else H200
    one_ahead = not args.serial_steps
    fit_runs = args.fit_runs or sim_fit.MAIN_RUNS
    fitted = sim_fit.load_runs(args.fit, fit_runs, one_ahead, args.steps_timed_next) if args.fit else []
    check_paths = args.check if args.check is not None else args.fit
    checked = (
        sim_fit.load_runs(check_paths, args.check_runs or fit_runs, one_ahead, args.steps_timed_next)
        if check_paths
        else []
    )
    if (args.fit and not fitted) or (check_paths and not checked):
        raise SystemExit("error: no run of the --fit or --check files matches --fit-runs or --check-runs")
    if fitted:
        cost = sim_fit.fit(fitted)
    if args.step_costs:
        cost = _measured(cost, args.step_costs)
    sim = SimConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_blocks=args.kv_blocks,
        device_slots=args.device_slots,
        host_slots=args.host_slots,
        one_ahead=one_ahead,
    )
    if args.smoke and args.device_slots is None:
        sim = replace(sim, device_slots=8, host_slots=12)
    workload = generate(spec)
    report: dict[str, Any] = {
        "workload": asdict(spec),
        "engine": asdict(sim),
        "cost": cost.to_dict(),
        "policies": [summarize(simulate(workload, p, cost, sim), args.starvation_s) for p in policies],
    }
    if checked:
        report["fit_check"] = sim_fit.check(checked, cost)
        report["fit_check_held_back"] = bool(fitted) and {r.identity for r in checked}.isdisjoint(
            r.identity for r in fitted
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "simulate.json").write_text(json.dumps(report, indent=1))
    text = markdown(report)
    if not plot(report, args.out / "simulate.png"):
        text += "\n(no simulate.png: matplotlib is not installed)\n"
    (args.out / "simulate.md").write_text(text)
    for p in report["policies"]:
        t = p["ttft_s"]
        print(
            f"{p['policy']:14s} tok/s {p['output_tokens_per_s']:8.0f}  TTFT p50/p99 "
            f"{t['p50'] * 1e3:.1f}/{t['p99'] * 1e3:.1f} ms  segments/step {p['steps']['segments_mean']:.1f}  "
            f"starved {p['starved']}  ({p['requests']} requests simulated in {p['runtime_s']:.1f} s)"
        )
    print(f"wrote {args.out}/simulate.json, simulate.md, simulate.png")
    return 0


def _measured(cost: Any, where: str) -> Any:  # noqa: ANN401 (StepCost, imported lazily)
    """`cost` with its steps priced by the run `FILE[:RUN]` of a serve.json (default base_only)."""
    from loraplex.bench.sim_cost import with_measured_steps

    path, _, run = where.partition(":")
    report = json.loads(Path(path).read_text())
    key = run or "base_only"
    summary = report.get(key)
    if summary is None:  # a further run, by its name (`more_runs`)
        summary = next((m["run"] for m in report.get("more_runs", []) if m["name"] == key), None)
    if summary is None:
        raise SystemExit(f"error: {path} has no run {key!r}")
    try:
        return with_measured_steps(cost, summary["steps"], report["model"]["max_num_seqs"], f"{path}:{key}")
    except ValueError as err:
        raise SystemExit(f"error: {path}:{key}: {err}") from None


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="the real scheduler on a virtual clock with a fitted step-cost model (CPU; compares policies)",
        description="Workload fields follow bench/workloads.py's syntax (default: 10,000 requests).",
    )
    p.add_argument("--smoke", action="store_true", help="a small bursty multi-tenant workload (seconds)")
    p.add_argument(
        "--policies", default="fcfs,fcfs-batched,adaptive", help="comma list (fcfs, fcfs-batched, adaptive)"
    )
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, help="step token budget (default: the engine's)")
    p.add_argument("--kv-blocks", type=int, help="KV blocks of 16 tokens (default: no preemption)")
    p.add_argument("--device-slots", type=int, help="adapters resident at once (default: all, preloaded)")
    p.add_argument("--host-slots", type=int, help="adapters in host memory (default: all)")
    p.add_argument("--starvation-s", type=float, default=10.0, help="TTFT past which a request starves")
    p.add_argument("--cost", type=Path, help="step-cost coefficients (JSON, as in simulate.json's cost)")
    p.add_argument("--fit", type=Path, nargs="+", help="fit the step costs to these serve.json results")
    p.add_argument(
        "--step-costs",
        metavar="FILE[:RUN]",
        help="price steps by a serve.json run's measured steps (default run base_only; a run of "
        "--more-runs by its name): mixed steps by their medians by rows, decode steps by the full one",
    )
    p.add_argument(
        "--check", type=Path, nargs="+", help="report predicted against measured for these serve.json"
    )
    runs = (
        "a run's key (adapters, base_only, or a more_runs entry's name in lower case with '-' between "
        "words) or of <file stem>:<key>"
    )
    p.add_argument(
        "--fit-runs",
        nargs="+",
        metavar="PATTERN",
        help=f"which runs of the --fit files (fnmatch patterns of {runs}; default: adapters base_only)",
    )
    p.add_argument(
        "--check-runs",
        nargs="+",
        metavar="PATTERN",
        help="which runs of the --check files (as --fit-runs; default: those of --fit-runs), "
        "e.g. 'poisson-*' for the Poisson runs of bench serve --poisson-factor",
    )
    p.add_argument(
        "--serial-steps",
        action="store_true",
        help="the engine.step() serving loop (each step planned once the last one completed), as "
        "in serve results before 2026-12-01-overlapped; default: one step ahead (step_overlapped)",
    )
    p.add_argument(
        "--steps-timed-next",
        action="store_true",
        help="the --fit and --check results time each step by the next one (the engine whose loop "
        "one step ahead waited for the step it launched: serve-h200-2026-12-01-lookahead-sync.json)",
    )
    add_workload_flags(p)
    p.add_argument("--out", type=Path, default=Path("bench-results/simulate"), help="output directory")
    p.set_defaults(run=_run)

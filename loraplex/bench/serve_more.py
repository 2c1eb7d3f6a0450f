"""`bench serve`'s further runs on the engine of its main runs, each after the other: other
workload seeds and Poisson arrivals (`more_runs`), and other step token budgets (`budget_sweep`).
Same engine, same process: these compare with the main runs as no run on another machine can.
`replay(workload, base_only)` runs a workload on that engine and returns its summary."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

from loraplex.bench.serve_model import ServeBenchArgs
from loraplex.bench.workloads import Workload, generate

Replayer = Callable[[Workload, bool], dict[str, Any]]


def more_runs(report: dict[str, Any], args: ServeBenchArgs, replay: Replayer) -> None:
    """`more_seeds` and `poisson_factor`: further workloads, one after the other, each as
    `report["more_runs"]` entries (name, workload spec, summary) and a ratio to its base-only run."""
    specs = [(f"seed {seed}", replace(args.workload, seed=seed)) for seed in args.more_seeds]
    if args.poisson_factor is not None:
        rate = args.poisson_factor * report["adapters"]["requests_per_s"]
        specs.append((f"Poisson {rate:.2f} req/s", replace(args.workload, arrivals=f"poisson:{rate:.4f}")))
    for label, spec in specs:
        workload = generate(spec)
        runs = report.setdefault("more_runs", [])
        lora = replay(workload, False)
        runs.append({"name": f"{label}, with adapters", "spec": asdict(spec), "run": lora})
        if args.base_compare:
            base = replay(workload, True)
            runs.append({"name": f"{label}, base-only", "spec": asdict(spec), "run": base})
            report.setdefault("ratios", {})[f"{label}: with adapters / base-only"] = (
                lora["output_tokens_per_s"] / base["output_tokens_per_s"]
            )


def budget_sweep(
    report: dict[str, Any],
    args: ServeBenchArgs,
    scheduler: Any,  # noqa: ANN401 (the engine's Scheduler)
    replay: Replayer,
) -> None:
    """`budget_sweep`: the main workload base-only again at each of these step token budgets,
    admission batching off (`Scheduler.set_step_budget`; the graphs captured for the configured
    budget cover every smaller one), each as a `report["more_runs"]` entry with its output
    against pure decode of a full batch in the same run. Restores the scheduler's settings."""
    if not args.budget_sweep:
        return
    before = (scheduler.token_budget, scheduler.admission_batch_tokens)
    workload = generate(args.workload)
    try:
        for tokens in args.budget_sweep:
            scheduler.set_step_budget(tokens, 0)
            base = replay(workload, True)
            label = f"budget {tokens}, admission batching off"
            report.setdefault("more_runs", []).append(
                {"name": f"{label}, base-only", "spec": asdict(args.workload), "run": base}
            )
            decode = base["steps"]["full_batch_decode"]["output_tokens_per_s"]
            if decode:
                report.setdefault("ratios", {})[f"{label}: base-only / pure decode of a full batch"] = (
                    base["output_tokens_per_s"] / decode
                )
    finally:
        scheduler.set_step_budget(*before)

"""Fit the step-cost model (bench/sim_cost.py) to `bench serve` results, and check it against them.

What a serve.json holds per run (`adapters`, `base_only`): the workload (spec and requests), the
engine's batch limits, wall time, output tokens/s, TTFT/TPOT percentiles, and the steps only as a
summary: count and total seconds, and per kind (decode, mixed, prefill) a count and a median.

The fit, per run: replay the run's workload through the simulator (the real scheduler, the same
batch limits, admission batching as the engine sets it on CUDA) with the current coefficients;
take the simulated step at the median of each measured kind (three or more steps) and the sum of
every simulated step's features; ask that these cost what the run measured (the kind's median,
the total step seconds). That is a small linear system in the six coefficients, solved in
relative terms (every equation as a ratio to its measurement) by least squares with a weak pull
toward the priors (sim_cost.PRIOR) in the directions the runs leave unmeasured (for instance
the fixed against the per-row part of a decode step, when every decode step has ~64 rows), with
no coefficient negative. Step shapes depend on the coefficients (admission batching waits on the
clock), so the replay and the solve alternate a few times. The host gap between steps is
measured directly: (wall - step seconds) / steps.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from loraplex.bench.serve_metrics import percentiles
from loraplex.bench.sim_cost import FITTED, PRIOR, StepCost
from loraplex.bench.simulate import Policy, SimConfig, SimRun, simulate
from loraplex.bench.workloads import Workload, WorkloadRequest, WorkloadSpec

RIDGE = 0.1  # weight of the pull toward the priors, against a 100% miss of one equation
ITERATIONS = 4


@dataclass(frozen=True)
class MeasuredRun:
    label: str  # "<file stem>:<run>"
    workload: Workload
    sim: SimConfig
    policy: Policy
    summary: dict[str, Any]  # the run's section of serve.json


def load_runs(paths: list[Path]) -> list[MeasuredRun]:
    """Every in-process run (with adapters, base-only) of these serve.json files."""
    out = []
    for path in paths:
        raw = json.loads(Path(path).read_text())
        w = raw["workload"]
        spec = WorkloadSpec(**w["spec"])
        names = {f for f in WorkloadRequest.__dataclass_fields__}
        reqs = [WorkloadRequest(**{k: v for k, v in r.items() if k in names}) for r in w["requests"]]
        args = raw.get("args", {})
        sim = SimConfig(
            max_num_seqs=int(args.get("max_num_seqs") or 64),
            max_num_batched_tokens=int(args.get("max_num_batched_tokens") or 2048),
        )
        on_cuda = str(args.get("device", "cuda")).startswith("cuda")
        # The engine's default there: admission batching on CUDA (graph-replayed decode), else off.
        policy = Policy("engine default", admission_batch_tokens=None if on_cuda else 0)
        for run, base_only in (("adapters", False), ("base_only", True)):
            if run not in raw:
                continue
            mine = [replace(r, adapter=None) for r in reqs] if base_only else reqs
            workload = Workload(spec, w["adapter_ranks"], mine)
            out.append(MeasuredRun(f"{Path(path).stem}:{run}", workload, sim, policy, raw[run]))
    return out


def fit(runs: list[MeasuredRun], prior: StepCost = PRIOR, iterations: int = ITERATIONS) -> StepCost:
    if not runs:
        raise ValueError("nothing to fit: no in-process runs in the files")
    gaps = [(r.summary["wall_s"] - r.summary["steps"]["seconds"]) / r.summary["steps"]["count"] for r in runs]
    cost = replace(prior, gap_s=max(0.0, statistics.fmean(gaps)))
    theta0 = np.array([getattr(prior, n) for n in FITTED])
    for _ in range(iterations):
        rows: list[list[float]] = []
        targets: list[float] = []
        for run in runs:
            r, t = _equations(run, cost)
            rows += r
            targets += t
        x = _solve(np.array(rows) * theta0, np.array(targets))
        labels = ", ".join(r.label for r in runs)
        cost = cost.with_fitted([float(v) for v in x * theta0], f"fitted to {labels}")
    return cost


def _equations(run: MeasuredRun, cost: StepCost) -> tuple[list[list[float]], list[float]]:
    sim = simulate(run.workload, run.policy, cost, run.sim)
    steps = run.summary["steps"]
    rows, targets = [], []
    for kind, measured in steps["by_kind"].items():
        mine = sorted((s for s in sim.steps if s.shape.kind == kind), key=lambda s: s.seconds)
        if measured["count"] >= 3 and mine:
            rows.append(cost.features(mine[len(mine) // 2].shape))
            targets.append(measured["median_s"])
    total = np.sum([cost.features(s.shape) for s in sim.steps], axis=0)
    rows.append([float(v) for v in total])
    targets.append(steps["seconds"])
    return rows, targets


def _solve(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min |A x / b - 1|^2 + RIDGE^2 |x - 1|^2 over x >= 0 (x: each coefficient over its prior);
    a coefficient the unconstrained solution drives negative is fixed at 0 and the rest refitted."""
    rel = a / b[:, None]
    n = a.shape[1]
    free = np.ones(n, dtype=bool)
    x = np.zeros(n)
    while free.any():
        m = np.vstack([rel[:, free], RIDGE * np.eye(n)[free][:, free]])
        y = np.concatenate([np.ones(len(b)), RIDGE * np.ones(int(free.sum()))])
        sol = np.linalg.lstsq(m, y, rcond=None)[0]
        if (sol >= 0).all():
            x[free] = sol
            return x
        idx = np.flatnonzero(free)
        free[idx[sol < 0]] = False
    return x


def check(runs: list[MeasuredRun], cost: StepCost) -> list[dict[str, Any]]:
    """Predicted against measured, per run: throughput, TTFT, TPOT, steps."""
    out = []
    for run in runs:
        sim = simulate(run.workload, run.policy, cost, run.sim)
        out.append({"run": run.label, **_compare(run.summary, sim)})
    return out


def _compare(measured: dict[str, Any], sim: SimRun) -> dict[str, Any]:
    done = [q for q in sim.requests if q.finish_s is not None]
    ttft = percentiles([q.ttft for q in done])
    tpot = percentiles(
        [(q.finish_s - q.first_token_s) / (q.output_len - 1) for q in done if q.output_len > 1]  # type: ignore[operator]
    )
    out_tokens = sum(q.output_len for q in done)
    kinds: dict[str, list[float]] = {}
    for s in sim.steps:
        kinds.setdefault(s.shape.kind, []).append(s.seconds)
    lat = measured["latency"]
    pairs = {
        "output_tokens_per_s": (measured["output_tokens_per_s"], out_tokens / sim.wall_s),
        "wall_s": (measured["wall_s"], sim.wall_s),
        "ttft_p50_s": (lat["ttft_s"]["p50"], ttft["p50"]),
        "ttft_p90_s": (lat["ttft_s"]["p90"], ttft["p90"]),
        "ttft_p99_s": (lat["ttft_s"]["p99"], ttft["p99"]),
        "ttft_mean_s": (lat["ttft_s"]["mean"], ttft["mean"]),
        "tpot_p50_s": (lat["tpot_s"]["p50"], tpot["p50"]),
        "steps": (measured["steps"]["count"], len(sim.steps)),
    }
    for kind, m in measured["steps"]["by_kind"].items():
        if kind in kinds:
            pairs[f"{kind}_steps"] = (m["count"], len(kinds[kind]))
            pairs[f"{kind}_step_median_s"] = (m["median_s"], statistics.median(kinds[kind]))
    return {
        name: {"measured": m, "predicted": p, "error": (p - m) / m if m and p is not None else None}
        for name, (m, p) in pairs.items()
    }

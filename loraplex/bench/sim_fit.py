"""Fit the step-cost model (bench/sim_cost.py) to `bench serve` results, and check it against them.

What a serve.json holds per run (`adapters`, `base_only`, and `more_runs` entries: other seeds,
Poisson arrivals): the workload (spec and requests), the engine's batch limits, wall time, output
tokens/s, TTFT/TPOT percentiles, and the steps only as a summary: count and total seconds, and
per kind (decode, mixed, prefill) a count and a median. `load_runs` picks runs by key.

The fit, per run: replay the run's workload through the simulator (the real scheduler, the same
batch limits and admission batching as the run, its serving loop) with the current coefficients;
take the simulated step at the median of each measured kind (three or more steps) and the sum of
every simulated step's features; ask that these cost what the run measured (the kind's median,
the total step seconds). That is a small linear system in the six coefficients, solved in
relative terms (every equation as a ratio to its measurement) by least squares with a weak pull
toward the priors (sim_cost.PRIOR) in the directions the runs leave unmeasured (for instance
the fixed against the per-row part of a decode step, when every decode step has ~64 rows), with
no coefficient negative. Step shapes depend on the coefficients (admission batching waits on the
clock), so the replay and the solve alternate a few times. The host gap between steps is
measured directly where the engine stepped one step at a time (engine.step(): bench serve timed
each call, so the host time between calls is outside every step): (wall - step seconds) / steps.
Where the serving loop ran one step ahead (Engine.step_overlapped), bench serve times a step as
the interval between two completions, host work included, so the steps cover the run: the gap is
0, and what the wall holds beyond the steps is what the bench left out (in the results up to
2026-12-02: the profiler's start and stop inside the measured runs), not engine time.
"""

from __future__ import annotations

import fnmatch
import itertools
import json
import re
import statistics
from collections.abc import Sequence as SeqView
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from loraplex.bench.serve_metrics import percentiles
from loraplex.bench.sim_cost import FITTED, PRIOR, StepCost
from loraplex.bench.simulate import Policy, SimConfig, SimRun, SimStep, simulate
from loraplex.bench.workloads import Workload, WorkloadRequest, WorkloadSpec, generate

RIDGE = 0.1  # weight of the pull toward the priors, against a 100% miss of one equation
ITERATIONS = 4


@dataclass(frozen=True)
class MeasuredRun:
    label: str  # "<file stem>:<run>"
    workload: Workload
    sim: SimConfig
    policy: Policy
    summary: dict[str, Any]  # the run's section of serve.json
    # bench serve's time for each step was the next step's: the engine from 79b98e8 to 92bf97b,
    # whose loop one step ahead waited for the step it had just launched (.tolist() on the stream)
    timed_next: bool = False
    path: str = ""  # the file's resolved path: runs of two files of one stem are distinct runs

    @property
    def identity(self) -> tuple[str, str]:
        return self.path, self.label


MAIN_RUNS = ("adapters", "base_only")


def run_key(name: str) -> str:
    """A `more_runs` entry's key: its name in lower case, each run of other characters than
    letters, digits and dots one '-' ("Poisson 19.40 req/s, base-only" -> poisson-19.40-req-s-base-only)."""
    return re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-")


def load_runs(
    paths: list[Path], select: SeqView[str] = MAIN_RUNS, one_ahead: bool = True, timed_next: bool = False
) -> list[MeasuredRun]:
    """The in-process runs of these serve.json files whose key, or label `<file stem>:<key>`,
    matches one of the `select` patterns (fnmatch): `adapters` and `base_only` (the file's
    workload with adapters and base-only) and each `more_runs` entry by its `run_key`
    (seed-2-with-adapters, poisson-19.40-req-s-base-only; its workload regenerated from its spec,
    as bench serve made it). `one_ahead`: the serving loop ran one step ahead
    (Engine.step_overlapped: the results from 2026-12-01-overlapped on); False: engine.step(),
    the results before it. `timed_next`: each step's time in the results is the next step's
    (`MeasuredRun.timed_next`: serve-h200-2026-12-01-lookahead-sync.json)."""
    out = []
    for path in paths:
        raw = json.loads(Path(path).read_text())
        w = raw["workload"]
        names = {f for f in WorkloadRequest.__dataclass_fields__}
        reqs = [WorkloadRequest(**{k: v for k, v in r.items() if k in names}) for r in w["requests"]]
        args, model = raw.get("args", {}), raw.get("model", {})
        # The settings in force, as the report records them; results from before it did hold only
        # the arguments, where None meant that engine's defaults: 2048 tokens a step, and admission
        # batching on CUDA at half the budget (Policy's None), elsewhere off.
        budget = model.get("step_token_budget") or args.get("max_num_batched_tokens") or 2048
        sim = SimConfig(
            max_num_seqs=int(args.get("max_num_seqs") or 64),
            max_num_batched_tokens=int(budget),
            one_ahead=one_ahead,
        )
        batch = model.get("admission_batch_tokens", args.get("admission_batch_tokens"))
        if batch is None and not str(args.get("device", "cuda")).startswith("cuda"):
            batch = 0
        policy = Policy("engine default", admission_batch_tokens=batch)
        runs = [
            (key, Workload(WorkloadSpec(**w["spec"]), w["adapter_ranks"], reqs), raw[key])
            for key in MAIN_RUNS
            if key in raw
        ]
        for more in raw.get("more_runs", ()):
            runs.append((run_key(more["name"]), generate(WorkloadSpec(**more["spec"])), more["run"]))
        for key, workload, summary in runs:
            label = f"{Path(path).stem}:{key}"
            if not any(fnmatch.fnmatchcase(key, p) or fnmatch.fnmatchcase(label, p) for p in select):
                continue
            if key == "base_only" or key.endswith("-base-only"):
                workload = replace(workload, requests=[replace(r, adapter=None) for r in workload.requests])
            out.append(
                MeasuredRun(label, workload, sim, policy, summary, timed_next, str(Path(path).resolve()))
            )
    return out


def fit(runs: list[MeasuredRun], prior: StepCost = PRIOR, iterations: int = ITERATIONS) -> StepCost:
    if not runs:
        raise ValueError("nothing to fit: no in-process runs in the files")
    gaps = [
        0.0
        if r.sim.one_ahead
        else (r.summary["wall_s"] - r.summary["steps"]["seconds"]) / r.summary["steps"]["count"]
        for r in runs
    ]
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
    timed = _timed(run, sim)
    for kind, measured in steps["by_kind"].items():
        mine = sorted((s for k, s in timed if k == kind), key=lambda s: s.seconds)
        if measured["count"] >= 3 and mine:
            rows.append(cost.features(mine[len(mine) // 2].shape))
            targets.append(measured["median_s"])
    total = np.sum([cost.features(s.shape) for s in sim.steps], axis=0)
    rows.append([float(v) for v in total])
    targets.append(steps["seconds"])
    return rows, targets


def _timed(run: MeasuredRun, sim: SimRun) -> list[tuple[str, SimStep]]:
    """Each simulated step's kind, with the step whose cost bench serve's time of it measured:
    its own, or the next one's where the run was timed so (`MeasuredRun.timed_next`)."""
    if run.timed_next:
        return [(a.shape.kind, b) for a, b in itertools.pairwise(sim.steps)]
    return [(s.shape.kind, s) for s in sim.steps]


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
        out.append({"run": run.label, **_compare(run, sim)})
    return out


def _compare(run: MeasuredRun, sim: SimRun) -> dict[str, Any]:
    measured = run.summary
    done = [q for q in sim.requests if q.finish_s is not None]
    ttft = percentiles([q.ttft for q in done])
    tpot = percentiles(
        [(q.finish_s - q.first_token_s) / (q.output_len - 1) for q in done if q.output_len > 1]  # type: ignore[operator]
    )
    out_tokens = sum(q.output_len for q in done)
    kinds: dict[str, list[float]] = {}
    for kind, s in _timed(run, sim):
        kinds.setdefault(kind, []).append(s.seconds)
    lat = measured["latency"]
    pairs = {
        "output_tokens_per_s": (measured["output_tokens_per_s"], out_tokens / sim.wall_s),
        "wall_s": (measured["wall_s"], sim.wall_s),
        # over the summed step time instead of the wall: without what the wall holds beyond the
        # steps (idle time, host gaps, and what bench serve left out: in the results up to
        # 2026-12-02 the profiler's start and stop inside the measured runs)
        "output_tokens_per_step_s": (
            measured["output_tokens"] / measured["steps"]["seconds"],
            out_tokens / sum(s.seconds for s in sim.steps),
        ),
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

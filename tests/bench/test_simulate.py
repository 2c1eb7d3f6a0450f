"""`loraplex bench simulate`: the real scheduler on a virtual clock. Deterministic from the seed,
shares that add up, adapter loads behind the ready gate, the fitted step-cost model against the
H200 run it was fitted to, and the CLI's smoke run."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from loraplex.bench.sim_cost import H200
from loraplex.bench.sim_fit import check, fit, load_runs
from loraplex.bench.sim_report import summarize
from loraplex.bench.simulate import POLICIES, SimConfig, simulate
from loraplex.bench.workloads import WorkloadSpec, generate
from loraplex.cli import main

H200_RUN = Path(__file__).parents[2] / "docs/results/serve-h200-2026-12-01.json"
SPEC = WorkloadSpec(
    seed=5,
    num_requests=400,
    num_adapters=12,
    arrivals="burst:14:3:5:1",
    tenants="a:3,b:1",
    deadlines="b:500",
    prompt_len="uniform:32:600",
    output_len="uniform:8:96",
)


def _summary(spec: WorkloadSpec, policy: str = "fcfs-batched", sim: SimConfig | None = None) -> dict:
    out = summarize(simulate(generate(spec), POLICIES[policy], H200, sim), starvation_s=10.0)
    del out["runtime_s"]  # real time: the one thing that may differ
    return out


def test_deterministic_from_the_seed() -> None:
    sim = SimConfig(device_slots=4, host_slots=6)
    first = _summary(SPEC, sim=sim)
    assert first == _summary(SPEC, sim=sim)
    assert first != _summary(replace(SPEC, seed=6), sim=sim)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_request_finishes_and_the_tenant_shares_sum_to_one(policy: str) -> None:
    s = _summary(SPEC, policy)
    assert s["requests"] == SPEC.num_requests and s["starved"] == 0
    shares = [t["service_share"] for t in s["by_tenant"].values()]
    assert sum(shares) == pytest.approx(1.0) and all(x > 0 for x in shares)
    assert s["with_deadline"] == s["by_tenant"]["b"]["requests"]
    assert set(s["by_popularity"]) == {"base", "hot", "cold"}


def test_adapter_loads_gate_admission_and_cost_time() -> None:
    resident = _summary(SPEC)
    scarce = _summary(SPEC, sim=SimConfig(device_slots=2, host_slots=8))
    assert resident["adapter_loads"] == {"host": 0, "disk": 0}
    assert scarce["adapter_loads"]["disk"] >= SPEC.num_adapters - 2 and scarce["adapter_loads"]["host"] > 0
    assert scarce["steps"]["segments_max"] <= 2  # never more adapters in a step than slots
    assert scarce["by_popularity"]["cold"]["ttft_p99_s"] > resident["by_popularity"]["cold"]["ttft_p99_s"]


def test_the_h200_coefficients_reproduce_the_run_they_were_fitted_to() -> None:
    # Tolerances: throughput within 10%, TTFT p50 within 20% (the bound), both runs.
    for row in check(load_runs([H200_RUN]), H200):
        assert abs(row["output_tokens_per_s"]["error"]) < 0.10, row["run"]
        assert abs(row["ttft_p50_s"]["error"]) < 0.20, row["run"]
        assert abs(row["steps"]["error"]) < 0.05, row["run"]


def test_the_fit_lands_on_the_stored_coefficients() -> None:
    fitted = fit(load_runs([H200_RUN]))
    for name in ("graph_step_s", "eager_step_s", "prefill_token_s", "decode_row_s", "gap_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(H200, name), rel=0.02), name


def test_smoke_through_the_cli(tmp_path: Path) -> None:
    assert main(["bench", "simulate", "--smoke", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "simulate.json").read_text())
    assert [p["policy"] for p in report["policies"]] == ["fcfs", "fcfs-batched", "adaptive"]
    assert (tmp_path / "simulate.md").read_text().startswith("# bench simulate")

"""`bench simulate --step-costs`: steps priced by a `bench serve` run's measured steps
(sim_cost.with_measured_steps). A step with prefill costs the measured median at its rows rounded
up to 64 (linear between measured row counts, along the nearest two past either end, the full
decode step as the point without prompt rows), less the decode rows it lacks against the measured
steps; a pure decode step of a full batch costs the measured full decode step; LoRA terms add."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loraplex.bench.sim_cost import H200, StepCost, StepShape, with_measured_steps
from loraplex.cli import main

# ms, as bench serve reports them (seconds in the JSON)
STEPS = {
    "mixed_full_batch_by_rows": {
        "128": {"count": 40, "median_s": 7.8e-3, "decode_rows_mean": 62.0},
        "256": {"count": 60, "median_s": 10.0e-3, "decode_rows_mean": 62.0},
        "384": {"count": 900, "median_s": 12.4e-3, "decode_rows_mean": 61.0},
    },
    "full_batch_decode": {"count": 500, "median_s": 7.0e-3},
}


def _mixed(rows: int, decode: int, lora_rows: int = 0, segments: int = 0) -> StepShape:
    return StepShape(rows - decode, decode, lora_rows, segments, decode + 1, False)


def test_measured_steps_price_steps_with_prefill_by_rows() -> None:
    cost = with_measured_steps(H200, STEPS, 64, "test")
    d = H200.decode_row_s
    assert cost.seconds(_mixed(384, 61)) == pytest.approx(12.4e-3)
    # 300 rows round up to 320: halfway between the 256 and 384 points, and their decode rows
    assert cost.seconds(_mixed(300, 62)) == pytest.approx(
        10.0e-3 + 0.5 * (12.4e-3 - 10.0e-3) - d * (61.5 - 62)
    )
    # below the smallest mixed point: between the full decode step (64 rows) and it
    assert cost.seconds(_mixed(64, 40)) == pytest.approx(7.0e-3 - d * (64 - 40))
    # past the largest: along the last two (their decode rows too: 62, 61 -> 60)
    assert cost.seconds(_mixed(512, 61)) == pytest.approx(12.4e-3 + (12.4e-3 - 10.0e-3) - d * (60 - 61))
    # LoRA terms add; pure decode: the full batch costs the measured median
    assert cost.seconds(_mixed(384, 61, lora_rows=100, segments=3)) == pytest.approx(
        12.4e-3 + 100 * H200.lora_row_s + 3 * H200.segment_s
    )
    assert cost.seconds(StepShape(0, 64, 0, 0, 64, True)) == pytest.approx(7.0e-3)
    assert StepCost.from_dict(json.loads(json.dumps(cost.to_dict()))) == cost


def test_a_run_without_full_batch_steps_is_refused() -> None:
    with pytest.raises(ValueError, match="no mixed steps beside a full decode batch"):
        with_measured_steps(H200, {"mixed_full_batch_by_rows": {}, "full_batch_decode": {}}, 64, "x")


def test_the_cli_prices_by_a_serve_json_run(tmp_path: Path) -> None:
    serve = tmp_path / "serve.json"
    serve.write_text(json.dumps({"model": {"max_num_seqs": 64}, "base_only": {"steps": STEPS}}))
    out = tmp_path / "sim"
    args = ["bench", "simulate", "--smoke", "--policies", "fcfs", "--out", str(out)]
    assert main([*args, "--step-costs", str(serve)]) == 0
    cost = json.loads((out / "simulate.json").read_text())["cost"]
    assert cost["source"] == f"{serve}:base_only" and len(cost["mixed_by_rows"]) == 4
    with pytest.raises(SystemExit, match="no run 'adapters'"):
        main([*args, "--step-costs", f"{serve}:adapters"])

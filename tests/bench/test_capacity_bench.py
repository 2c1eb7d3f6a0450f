"""`bench capacity`: adapter bytes per rank from the model shape, against arithmetic written out
here, and the fits per tier; the command writes its JSON and markdown."""

from __future__ import annotations

import json
from pathlib import Path

from loraplex.bench.cli import main


def test_capacity_report_matches_the_shape_arithmetic(tmp_path: Path) -> None:
    out = tmp_path / "cap"
    device, host = 1 << 20, 1 << 24
    args = ["capacity", "--shape", "tiny", "--ranks", "4:1,8:3", "--targets", "q,v,down"]
    budgets = ["--adapter-device-bytes", str(device), "--adapter-host-bytes", str(host)]
    assert main([*args, *budgets, "--out", str(out)]) == 0
    report = json.loads((out / "capacity.json").read_text())
    assert (out / "capacity.md").read_text().startswith("# Adapter capacity per tier")
    m = report["model"]
    layers, hidden = m["layers"], m["hidden"]
    for row in report["per_rank"]:
        r = row["rank"]
        # bf16 A [r, d_in] and B [d_out, r] on every layer for q (h -> q_size), v (h -> kv_size)
        # and down (intermediate -> h): r * (d_in + d_out) elements of 2 bytes per target
        assert row["actual_bytes"] == layers * 2 * r * _dims_sum(hidden)
        assert row["actual_bytes"] <= row["allocated_bytes"] <= 1.05 * row["actual_bytes"]
        assert row["fit_device"] == device // row["allocated_bytes"]
        assert row["fit_host"] == host // row["actual_bytes"]
    shares = [row["share"] for row in report["per_rank"]]
    assert shares == [0.25, 0.75]


def _dims_sum(hidden: int) -> int:
    from loraplex.bench.random_weights import tiny_hf_dict
    from loraplex.config import ModelConfig

    mc = ModelConfig.from_hf_dict(tiny_hf_dict())
    assert mc.hidden_size == hidden
    h, q, kv, i = mc.hidden_size, mc.q_size, mc.kv_size, mc.intermediate_size
    return (h + q) + (h + kv) + (i + h)

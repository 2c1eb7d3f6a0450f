"""The kernel bench's bookkeeping on the CPU: cases, minimal bytes, targets, report files."""

from __future__ import annotations

import json
from pathlib import Path

from loraplex.bench.kernel_cases import (
    GROUPS,
    LAYER,
    TARGET_DECODE,
    TARGET_MIXED,
    all_cases,
    case_flops,
    case_min_bytes,
    quick_cases,
)
from loraplex.bench.kernels import _add_ratios, evaluate_targets
from loraplex.bench.report import write_report


def test_cases_cover_the_issue() -> None:
    cases = all_cases()
    decode = [c for c in cases if c.phase == "decode"]
    assert {(c.rows, c.adapters) for c in decode} >= {(1, 1), (64, 32), (256, 64)}
    assert all(c.adapters <= c.rows for c in decode)
    assert {c.ranks for c in cases} == {"8", "16", "32", "64", "mixed"}
    prefill = [c for c in cases if c.phase == "prefill"]
    assert all(c.rows == 4096 and c.adapters == 8 for c in prefill)
    assert all(sorted(set(c.row_slots())) == list(range(c.adapters)) for c in cases)
    assert len(prefill[0].row_slots()) == 4096


def test_minimal_bytes_are_rank_exact() -> None:
    # one adapter, all seven targets, rank 16: r * sum(d_in + d_out) * 2 bytes = 2.62 MB
    per_adapter = 16 * (3 * 4096 + 6144 + 4096 + 4096 + 2 * 4096 + 2 * 14336 + 14336 + 4096) * 2
    io = 64 * 2 * (4096 + 2 * 6144 + 4096 + 2 * 4096 + 4096 + 2 * 28672 + 14336 + 2 * 4096)
    assert case_min_bytes(TARGET_DECODE, LAYER) == 32 * per_adapter + io
    assert sum(case_min_bytes(TARGET_DECODE, g) for g in GROUPS) == case_min_bytes(TARGET_DECODE, LAYER)
    # mixed {8,16,32,64} averages rank 30: weights cost 30/16 of r=16
    w16 = case_min_bytes(TARGET_DECODE, LAYER) - io
    assert case_min_bytes(TARGET_MIXED, LAYER) - io == w16 * 30 // 16
    assert case_flops(TARGET_DECODE, "o") == 64 * 2 * 16 * (4096 + 4096)


def _fake_result(case, scale: float) -> dict:  # noqa: ANN001
    layers = {}
    for g in (*GROUPS, LAYER):
        b = case_min_bytes(case, g)
        t_us = b / 2.0e12 * 1e6 * scale  # 2 TB/s
        layers[g] = {"eager_us": 1.5 * t_us, "graph_us": t_us, "min_bytes": b, "flops": case_flops(case, g)}
    return {"case": case.__dict__, "label": case.label, "meta_build_us": 30.0, "layers": layers}


def test_targets_and_report_files(tmp_path: Path) -> None:
    copy_bw, mm = 4.0e12, 7.5e14
    results = [_fake_result(c, 1.0) for c in quick_cases()]
    base = {g: {"eager_us": 10.0, "graph_us": 8.0} for g in (*GROUPS, LAYER)}
    for r in results:
        _add_ratios(r, copy_bw, mm, base)
    targets = evaluate_targets(results, copy_bw, mm)
    assert [t["pass"] for t in targets] == [True] * 5
    assert [t["threshold"] for t in targets[3:]] == ["<= 25", "<= 40"]  # the single-adapter cases
    single = results[3]["layers"][LAYER]
    single["graph_us"] = 30.0  # slower than its 25 µs
    assert [t["pass"] for t in evaluate_targets(results, copy_bw, mm)][3:] == [False, True]
    single["graph_us"] = targets[3]["value"]
    assert abs(targets[0]["value"] - 0.5) < 1e-9  # 2 TB/s of 4
    report = {"device": "fake", "torch": "x", "triton": "y", "copy_bw_GBps": 4000.0, "matmul_TFLOPs": 750.0,
              "reps": 1, "results": results, "tiling": [], "targets": targets}  # fmt: skip
    write_report(report, tmp_path)
    assert json.loads((tmp_path / "kernels.json").read_text())["targets"] == targets
    md = (tmp_path / "kernels.md").read_text()
    assert "| decode M=64 D=32 r=16 |" in md and "Targets" in md
    assert "multi-layer graph" not in md  # no rows, no section


def test_report_lists_layers_per_graph(tmp_path: Path) -> None:
    row = {
        "case": "decode M=64 D=32 r=16",
        "tiling": "decode",
        "layers": 4,
        "graph_us": 47.5,
        "copy_frac": 0.48,
    }
    report = {"device": "fake", "torch": "x", "triton": "y", "copy_bw_GBps": 4000.0, "matmul_TFLOPs": 750.0,
              "reps": 1, "results": [], "tiling": [], "targets": [], "graph_floor_us": 4.2,
              "layers_per_graph": [row]}  # fmt: skip
    write_report(report, tmp_path)
    md = (tmp_path / "kernels.md").read_text()
    assert "| decode M=64 D=32 r=16 | decode | 4 | 47.5 | 0.480 |" in md
    assert "timed the same way: 4.2 µs" in md

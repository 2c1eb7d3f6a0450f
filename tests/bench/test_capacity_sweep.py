"""`bench capacity --sweep --smoke` and `--load-latency` on the CPU: the real engine behind a tiny
random model, every point and report written; thrash shows up as loads and evictions once the
registered adapters outnumber the device room; the H200 preset's flags resolve as the issue says."""

from __future__ import annotations

import json
from pathlib import Path

from loraplex.bench.capacity_cli import sweep_args
from loraplex.bench.capacity_sweep import SweepArgs, thrash_onset
from loraplex.bench.cli import main


def test_smoke_sweep_and_load_latency_write_their_reports(tmp_path: Path) -> None:
    out = tmp_path / "cap"
    assert main(["capacity", "--smoke", "--load-latency", "--repeats", "2", "--out", str(out)]) == 0
    report = json.loads((out / "thrash.json").read_text())
    points = report["points"]
    assert {(p["adapters"], p["popularity"]) for p in points} == {
        (n, pop) for n in (2, 6, 12) for pop in ("uniform", "zipf:0.5", "zipf:1.0", "zipf:1.5")
    }
    for p in points:
        assert p["output_tokens_per_s"] > 0 and p["requests"] == 24 - 2  # first 10% left out
        assert p["ttft_p99_s"] is not None
        # differences over the point (the real check is the GPU run, where Triton compiles)
        assert (p["kernel_compiles"], p["graph_captures"]) == (0, 0)
    # room for 3: two adapters never evict; twelve under uniform popularity must
    assert all(p["evictions"] == 0 for p in points if p["adapters"] == 2 and p["popularity"] != "uniform")
    assert any(p["evictions"] > 0 and p["loads"] > 0 for p in points if p["adapters"] == 12)
    assert len(report["vs_all_resident"]) == len(points)
    assert all(p["evictions"] == 0 for p in report["all_resident"])
    # the same requests in both runs: the tiered run's device hits, their TTFTs all-resident
    for tiered, resident, cmp in zip(points, report["all_resident"], report["vs_all_resident"], strict=True):
        assert len(tiered["requests_detail"]) == tiered["requests"]
        assert [r[0] for r in tiered["requests_detail"]] == [r[0] for r in resident["requests_detail"]]
        hits = {i for i, tier, _ in tiered["requests_detail"] if tier == "device"}
        same = sorted(t for i, _, t in resident["requests_detail"] if i in hits)
        want = same[min(len(same) - 1, int(0.99 * len(same)))] if same else None
        assert cmp["same_requests_all_resident_ttft_p99_s"] == want
        assert set(cmp["step_median_ratio"]) <= set(resident["step_median_s"])
    assert (out / "thrash.md").read_text().startswith("# Adapter cache thrash sweep")
    load = json.loads((out / "load_latency.json").read_text())
    assert [r["rank"] for r in load["per_rank"]] == [8, 16]
    assert all(r["load_median_s"] > 0 and r["bytes"] > 0 for r in load["per_rank"])
    assert all(0 < r["host_median_s"] <= r["load_median_s"] for r in load["per_rank"])
    assert (out / "load_latency.md").exists()


def test_thrash_onset_is_the_first_count_below_ninety_percent() -> None:
    points = [
        {"adapters": n, "popularity": "u", "output_tokens_per_s": tps}
        for n, tps in ((2, 100.0), (8, 95.0), (32, 80.0), (128, 50.0))
    ] + [{"adapters": n, "popularity": "z", "output_tokens_per_s": 100.0} for n in (2, 8)]
    assert thrash_onset(points) == {"u": 32, "z": None}


def test_h200_preset_matches_the_issue_target() -> None:
    import argparse

    from loraplex.bench.capacity_cli import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["capacity", "--h200", "--random-layers", "4"])
    s = sweep_args(args)
    assert s == SweepArgs.h200(layers=4)
    assert (s.counts, s.popularities, s.room_adapters, s.concurrency) == ((1000,), ("zipf:1.0",), 64, 64)
    assert (s.prompt_len, s.output_len, s.requests, s.skip_fraction) == (
        "uniform:128:1024",
        "uniform:64:256",
        3000,
        0.1,
    )
    assert s.targets == ("q", "k", "v", "o") and s.ranks == "8,16" and s.compare_resident

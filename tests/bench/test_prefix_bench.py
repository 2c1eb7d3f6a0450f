"""`loraplex bench prefix --smoke --fp32-reference` (the CPU demo model): the report has its fields,
the warm run finds the system prompt cached for every request and gives the cold run's greedy
tokens, which are transformers + PEFT's float32 argmax at every step (the demo model's margins are
wide), and the numbers in it agree with its per-request records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loraplex.bench.prefix import PrefixBenchArgs, ttft_ratios
from loraplex.bench.prefix_reference import MARGIN, agree, agreement_by_run, compare_tokens
from loraplex.bench.serve_metrics import percentiles
from loraplex.cli import main


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("prefix")
    assert main(["bench", "prefix", "--smoke", "--fp32-reference", "--quiet", "--out", str(out)]) == 0
    return json.loads((out / "prefix.json").read_text()), out


def test_the_report_has_its_fields(report: tuple[dict, Path]) -> None:
    r, out = report
    assert (out / "prefix.md").read_text().startswith("# bench prefix")
    args = PrefixBenchArgs.smoke_args()
    assert r["args"]["requests"] == args.requests and r["args"]["prefix_len"] == args.prefix_len
    assert {"layers", "hidden_size", "vocab_size", "dtype", "block_size"} <= set(r["model"])
    assert {"python", "torch", "device"} <= set(r["environment"])
    for section in ("startup", "cache_off_startup"):
        assert {"warmup_s", "kernel_compiles", "graph_captures"} <= set(r[section])
    assert set(r["after_startup"]) == set(r["measured_runs"]) == {"kernel_compiles", "graph_captures"}
    assert {"cold_unshared", "cold", "prime", "warm", "cache_off"} <= set(r["runs"])
    for name in ("cold_unshared", "cold", "warm", "cache_off"):
        run = r["runs"][name]
        assert len(run["requests"]) == args.requests
        assert all(len(q["token_ids"]) == args.output_len for q in run["requests"])
        assert set(run["ttft_s"]) == {"p50", "p90", "p99", "mean"} and run["ttft_s"]["p50"] > 0
        # the percentiles are those of the per-request TTFTs kept beside them
        assert run["ttft_s"] == percentiles([q["ttft_s"] for q in run["requests"]])
    ratios = {"warm_vs_cold_unshared", "warm_vs_cold", "warm_vs_cache_off", "cold_vs_cache_off"}
    assert set(r["ratios"]) == ratios
    assert r["ratios"]["warm_vs_cold"] == ttft_ratios(r["runs"]["warm"], r["runs"]["cold"])
    unshared = ttft_ratios(r["runs"]["warm"], r["runs"]["cold_unshared"])
    assert r["ratios"]["warm_vs_cold_unshared"] == unshared
    target = {"ttft_ratio_max", "ttft_ratio_pass", "ttft_ratio_pass_vs_shared_cold", "identical_outputs"}
    assert target <= set(r["target"])


def test_warm_hits_the_system_prompt_and_equals_cold(report: tuple[dict, Path]) -> None:
    r, _ = report
    runs, bs, prefix = r["runs"], r["model"]["block_size"], r["args"]["prefix_len"]
    warm, cold, off = runs["warm"]["requests"], runs["cold"]["requests"], runs["cache_off"]["requests"]
    unshared = runs["cold_unshared"]["requests"]
    # every warm request found its adapter's system prompt (its full blocks), and no more: its
    # suffix blocks were cached under the cold run's salt only
    assert all(q["cached_tokens"] == prefix // bs * bs > 0 for q in warm)
    assert all(q["cached_tokens"] == 0 for q in off)
    assert all(q["cached_tokens"] == 0 for q in unshared)  # a salt per request: nothing shared
    # each adapter's first cold request found nothing cached
    assert min(q["cached_tokens"] for q in cold) == 0
    for a, b, c, d in zip(cold, warm, off, unshared, strict=True):
        assert a["index"] == b["index"] == c["index"] == d["index"]
        assert a["token_ids"] == b["token_ids"] == c["token_ids"] == d["token_ids"], a["index"]
    assert r["outputs"]["warm_vs_cold"]["identical"] == len(warm)
    assert r["outputs"]["cold_unshared_vs_cold"]["identical"] == len(warm)
    assert r["target"]["identical_outputs"] is True


def test_compare_tokens_names_the_first_differing_step() -> None:
    ref = {"requests": [{"index": 0, "token_ids": [5, 6, 7], "margins": [1.0, 0.01, 2.0]}]}
    same = {"requests": [{"index": 0, "token_ids": [5, 6, 7]}]}
    other = {"requests": [{"index": 0, "token_ids": [5, 9, 7]}]}
    assert compare_tokens(ref, same) == {"requests": 1, "identical": 1, "differences": []}
    assert compare_tokens(ref, other)["differences"] == [{"index": 0, "step": 1, "margin": 0.01}]


def test_the_float32_reference_agrees_at_every_decided_step(report: tuple[dict, Path]) -> None:
    r, out = report
    ref = r["fp32_reference"]
    steps = sum(len(q["token_ids"]) for q in r["runs"]["cold"]["requests"])
    # a misaligned reference (logits of the wrong position) would give other tokens and fail here
    assert ref["steps"] == steps and ref["steps_checked"] == ref["steps_decided"] > steps // 2
    assert ref["failures"] == [] and ref["pass"] is True
    assert r["target"]["identical_where_decided"] is True
    assert "float32 reference" in (out / "prefix.md").read_text()
    # every run follows the reference at every decided step, hits or not; the reference's own
    # steps are kept beside the cold run's tokens
    assert set(ref["by_run"]) == {"cold_unshared", "cold", "warm", "cache_off"}
    for a in ref["by_run"].values():
        assert a["steps_checked"] == ref["steps_decided"] and a["missed"] == 0
    for q in r["runs"]["cold"]["requests"]:
        assert [t for t, _ in q["reference"]] == q["token_ids"]


def test_agreement_by_run_counts_misses_while_on_the_reference_path() -> None:
    wide, tie = 1.0, MARGIN / 2
    ref = [[(5, wide), (6, tie), (7, wide), (8, 0.3)]]
    runs = {
        "cold": {"requests": [{"token_ids": [5, 6, 7, 8]}]},
        "prime": {"requests": []},  # not a run of these requests: left out
        # misses a decided step (margin 0.3) while on the cold run's path
        "warm": {"requests": [{"token_ids": [5, 6, 7, 9]}]},
        # parts at the near-tie: nothing after it is checked
        "cold_unshared": {"requests": [{"token_ids": [5, 4, 1, 1]}]},
    }
    got = agreement_by_run(runs, ref)
    assert set(got) == {"cold", "warm", "cold_unshared"}
    assert got["cold"] == {
        "steps_checked": 3,
        "missed": 0,
        "missed_fraction": 0.0,
        "largest_margin_missed": None,
    }
    assert got["warm"] == {
        "steps_checked": 3,
        "missed": 1,
        "missed_fraction": 1 / 3,
        "largest_margin_missed": 0.3,
    }
    assert got["cold_unshared"]["steps_checked"] == 1 and got["cold_unshared"]["missed"] == 0


def test_agree_stops_at_a_near_tie_and_names_a_decided_mismatch() -> None:
    wide, tie = 1.0, MARGIN / 2
    ref = [(5, wide), (6, tie), (7, wide)]
    assert agree([5, 6, 7], [5, 6, 7], ref) == {"checked": 2, "failure": None}
    # they part at the near-tie: step 2 is not compared (different contexts)
    assert agree([5, 6, 7], [5, 8, 9], ref) == {"checked": 1, "failure": None}
    failure = agree([5, 6, 7], [5, 6, 4], ref)["failure"]
    assert failure == {"step": 2, "cold": 7, "warm": 4, "reference": 7, "margin": wide}
    # both runs agree but not with the reference where it decides
    assert agree([3], [3], [(5, wide)])["failure"]["reference"] == 5

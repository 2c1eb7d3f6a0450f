"""`loraplex bench serve` on the CPU demo model: in-process (`--smoke`, as CI runs it) and over
HTTP against a live server; every request of the workload completes with its output length, and
the report carries the workload it replayed."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from loraplex.bench.serve import run
from loraplex.bench.serve_model import ServeBenchArgs
from loraplex.bench.workloads import generate
from loraplex.cli import main


def test_smoke_in_process_through_the_cli(tmp_path: Path) -> None:
    assert main(["bench", "serve", "--smoke", "--quiet", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "serve.json").read_text())
    assert (tmp_path / "serve.md").read_text().startswith("# bench serve (in-process)")
    workload = report["workload"]
    want_tokens = sum(r["output_len"] for r in workload["requests"])
    for run_name in ("adapters", "base_only"):
        r = report[run_name]
        assert r["output_tokens"] == want_tokens and r["latency"]["requests"] == len(workload["requests"])
        assert r["latency"]["ttft_s"]["p50"] > 0 and r["output_tokens_per_s"] > 0
        assert r["steps"]["count"] > 0 and set(r["steps"]["by_kind"]) <= {"decode", "mixed", "prefill"}
        # the paced passes are among the passes the run saw
        assert all(0 <= p <= n for p, n in zip(r["gc"]["paced"], r["gc"]["passes"], strict=True))
    assert "Python GC passes during the run" in (tmp_path / "serve.md").read_text()
    assert report["adapters"]["steps"]["lora_segments_max"] >= 2  # adapters really were mixed
    assert report["base_only"]["steps"]["lora_segments_max"] == 0
    assert set(report["adapters"]["by_popularity"]) == {"base", "hot", "cold"}
    assert report["ratios"]["output_tokens_per_s_vs_base"] > 0
    # the saved workload is the spec's, regenerated
    spec = ServeBenchArgs.smoke_args().workload
    assert workload == json.loads(json.dumps(generate(spec).to_dict()))


def test_transformers_peft_baseline_on_the_same_workload(tmp_path: Path) -> None:
    report = run(
        replace(ServeBenchArgs.smoke_args(), hf_compare=True, base_compare=False), tmp_path, progress=False
    )
    hf = report["hf_peft"]
    assert hf["output_tokens"] == report["adapters"]["output_tokens"] and hf["output_tokens_per_s"] > 0
    assert report["ratios"]["output_tokens_per_s_vs_hf_peft"] > 0
    assert "transformers + PEFT" in (tmp_path / "serve.md").read_text()


def test_transformers_peft_baseline_on_the_first_requests(tmp_path: Path) -> None:
    """--hf-requests: the baseline generates only the workload's first N requests' outputs."""
    args = replace(ServeBenchArgs.smoke_args(), hf_compare=True, hf_requests=10, base_compare=False)
    report = run(args, tmp_path, progress=False)
    first = generate(args.workload).requests[:10]
    assert report["hf_peft"]["requests"] == 10
    assert report["hf_peft"]["output_tokens"] == sum(r.output_len for r in first)
    assert "the first 10 requests" in (tmp_path / "serve.md").read_text()


def test_transformers_peft_baseline_cut_at_its_time_limit_reports_a_bound(tmp_path: Path) -> None:
    """--hf-time-limit: the baseline stops after its first step (a limit already past), counts only
    the tokens it generated, and bounds a full run by its first step and its fastest step."""
    args = replace(ServeBenchArgs.smoke_args(), hf_compare=True, base_compare=False, hf_time_limit_s=1e-9)
    report = run(args, tmp_path, progress=False)
    hf = report["hf_peft"]
    reqs = generate(args.workload).requests
    batch = hf["settings"]["batch"]
    first = reqs[: min(batch, len(reqs))]
    assert hf["cut"] and hf["requests_covered"] == len(first)
    assert hf["output_tokens"] == len(first)  # one step: one token a request
    assert hf["steps_timed"] == 0 and len(hf["first_step_s"]) == 1  # no second step to time
    want = sum(r.output_len for r in first) / hf["first_step_s"][0]  # no step time seen: 0 for the rest
    assert hf["output_tokens_per_s_upper_bound"] == pytest.approx(want)
    ratio = report["ratios"]["output_tokens_per_s_vs_hf_peft_at_least"]
    assert ratio == pytest.approx(report["adapters"]["output_tokens_per_s"] / want)
    assert "output_tokens_per_s_vs_hf_peft" not in report["ratios"]
    assert "at least" in (tmp_path / "serve.md").read_text()


def test_random_weights_written_once_for_the_transformers_baseline(tmp_path: Path) -> None:
    smoke = ServeBenchArgs.smoke_args()
    spec = replace(smoke.workload, num_requests=16, ranks="8,16", prompt_len="uniform:8:40")
    args = replace(
        smoke,
        smoke=False,
        workload=spec,
        random_layers=2,
        random_shape="tiny",
        hf_compare=True,
        base_compare=False,
        workdir=str(tmp_path / "ckpt"),
    )
    report = run(args, None, progress=False)
    assert report["hf_peft"]["output_tokens"] == report["adapters"]["output_tokens"]
    marker = tmp_path / "ckpt" / "checkpoint.json"
    written = marker.stat().st_mtime_ns
    ranks = [
        json.loads((tmp_path / "ckpt" / "adapters" / f"bench-{i}" / "adapter_config.json").read_text())["r"]
        for i in range(4)
    ]
    assert ranks == generate(spec).adapter_ranks
    run(args, None, progress=False)
    assert marker.stat().st_mtime_ns == written  # the same spec reuses the files


def test_over_http_with_open_loop_arrivals_and_tenants(tmp_path: Path) -> None:
    from helpers.live_server import live_server

    from loraplex.demo import DEMO_ADAPTERS, DEMO_MODEL_DIR

    smoke = ServeBenchArgs.smoke_args()
    spec = replace(smoke.workload, num_requests=24, arrivals="poisson:60", tenants="a:3,b:1")
    adapters = {name: str(path) for name, path in DEMO_ADAPTERS.items()}
    with live_server(str(DEMO_MODEL_DIR), adapters) as (base_url, _):
        report = run(replace(smoke, workload=spec, url=base_url), tmp_path, progress=False)
    r = report["adapters"]
    assert report["mode"] == "http" and r["server"]["adapters"] == 4
    assert r["output_tokens"] == sum(x.output_len for x in generate(spec).requests)
    assert set(r["by_tenant"]) == {"a", "b"} and r["latency"]["requests"] == 24
    assert r["latency"]["ttft_s"]["p99"] >= r["latency"]["ttft_s"]["p50"] > 0


def test_busy_union_counts_overlapping_kernels_once() -> None:
    from loraplex.bench.gpu_busy import union_length

    assert union_length([]) == 0
    assert union_length([(0, 10), (5, 12), (20, 25), (21, 22), (30, 31)]) == 12 + 5 + 1


def test_kernel_time_by_kind_sums_each_kernel_into_its_kind() -> None:
    """Names as the profiler reports them on an H200: cuBLAS's GEMMs, the package's Triton kernels,
    PyTorch's own ops."""
    from loraplex.bench.gpu_busy import kernel_kind, time_by_kind

    gemm = "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NNT"
    records = [
        (gemm, 0.0, 100.0),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_cublas", 100.0, 150.0),
        ("decode_kernel", 150.0, 170.0),
        ("prefill_kernel", 160.0, 190.0),  # on a side stream beside the decode launch: both count
        ("lora_shrink_kernel", 190.0, 195.0),
        ("_rmsnorm_kernel", 195.0, 197.0),
        ("kv_write_kernel", 197.0, 198.0),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", 198.0, 199.0),
        (gemm, 200.0, 300.0),
    ]
    kinds, top = time_by_kind(records, top=2)
    expect = {"gemm": 250e-6, "attention": 50e-6, "lora": 5e-6, "norm, rotary, activation": 2e-6,
              "kv write": 1e-6, "other": 1e-6}  # fmt: skip
    assert kinds.keys() == expect.keys()
    assert all(abs(kinds[k] - v) < 1e-12 for k, v in expect.items())
    assert [(t["name"], t["count"], t["kind"]) for t in top] == [
        (gemm, 2, "gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_cublas", 1, "gemm"),
    ]
    assert kernel_kind("decode_combine_kernel") == "attention"
    assert kernel_kind("mixed_step_kernel") == "attention"  # a captured mixed step's one launch
    assert kernel_kind("_silu_mul_kernel") == "norm, rotary, activation"


def test_base_only_against_pure_decode_of_a_full_batch(tmp_path: Path) -> None:
    """The ratio the serving target names: base-only output tokens/s over max_num_seqs / the
    median of the run's decode steps that carry a full batch (and only those)."""
    args = replace(ServeBenchArgs.smoke_args(), max_num_seqs=8)  # the closed loop's 8 fill it
    report = run(args, tmp_path, progress=False)
    full = report["base_only"]["steps"]["full_batch_decode"]
    assert full["count"] > 0
    ratio = report["ratios"]["base_only_vs_full_batch_decode"]
    assert ratio == pytest.approx(report["base_only"]["output_tokens_per_s"] * full["median_s"] / 8)
    assert 0 < ratio < 1.5 and "pure decode of a full batch" in (tmp_path / "serve.md").read_text()
    steady = report["base_only"]["steady"]
    assert report["ratios"]["base_only_vs_full_batch_decode_steady"] == pytest.approx(
        steady["output_tokens_per_s"] * full["median_s"] / 8
    )
    phases = report["base_only"]["phases"]
    assert phases["steady"]["output_tokens"] == steady["output_tokens"]
    assert "base-only run by phase" in (tmp_path / "serve.md").read_text()


def _five_requests() -> tuple[list, list]:
    """Five requests (arrival, first token, finish) and one step a second from 0 to 8 with 10
    decode rows each, plus a step at 1.5 with 6."""
    from loraplex.bench.serve_metrics import RequestTiming, StepRecord

    timings = [
        RequestTiming(i, "t", "base", arrival_s=a, first_token_s=f, finish_s=e)
        for i, (a, f, e) in enumerate([(0, 1, 2), (0, 1.5, 3), (2, 2.5, 4), (3, 3.5, 5), (4, 4.5, 9)])
    ]
    steps = [StepRecord(float(t), 1.0, 12, 10, 0, 4, True) for t in range(9)]
    steps.append(StepRecord(1.5, 0.5, 6, 6, 0, 4, True))
    return timings, steps


def test_steady_window_leaves_out_the_ramp_and_the_drain() -> None:
    """From a quarter of the requests finished to the last arrival: the decode rows of the steps
    launched in it plus the first tokens sampled in it, over its length."""
    from loraplex.bench.serve_metrics import steady_window

    timings, steps = _five_requests()
    got = steady_window(timings, steps)
    assert got is not None
    # finishes sorted 2, 3, 4, 5, 9: the quarter mark is the second (3); the last arrival is 4
    assert (got["from_s"], got["to_s"]) == (3, 4)
    assert got["output_tokens"] == 10 + 1  # the step at 3, and request 3's first token at 3.5
    assert got["output_tokens_per_s"] == 11
    assert steady_window(timings[:1], steps) is None  # its last arrival is before a quarter finished


def test_run_phases_split_the_run_at_the_steady_windows_edges() -> None:
    """The same run as above: start 0-3 s, steady 3-4 s (11 tokens/s), drain 4-9 s; each phase's
    tokens counted as the window counts them, and its time beyond what they take at 11 tokens/s."""
    from loraplex.bench.serve_metrics import run_phases, steady_window

    timings, steps = _five_requests()
    got = run_phases(timings, steps, steady_window(timings, steps))
    assert got is not None and list(got) == ["start", "steady", "drain"]
    # start: steps at 0, 1, 1.5, 2 (10 + 10 + 6 + 10 rows) and first tokens at 1, 1.5, 2.5
    assert got["start"]["seconds"] == 3 and got["start"]["output_tokens"] == 36 + 3
    assert got["start"]["decode_rows_per_step"] == 9
    assert got["start"]["seconds_over_steady_rate"] == pytest.approx(3 - 39 / 11)
    assert got["steady"]["output_tokens"] == 11 and got["steady"]["seconds_over_steady_rate"] == 0
    # drain: steps at 4..8 (5 x 10 rows) and the first token at 4.5
    assert got["drain"]["seconds"] == 5 and got["drain"]["output_tokens"] == 51
    assert got["drain"]["seconds_over_steady_rate"] == pytest.approx(5 - 51 / 11)
    assert run_phases(timings[:1], steps, steady_window(timings[:1], steps)) is None


def test_decode_bound_from_the_runs_own_step_costs() -> None:
    """Full decode steps of 4 rows take 10 ms; full mixed steps (budget 16: 3 decode + 13 prompt
    rows) take 10 + 13 ms, 1 ms a prompt row. With 2 prompt rows per output token a batch of 4
    output tokens costs 10 + 8 ms: 10 / 18 of pure decode. With 6 per output token its 24 prompt
    rows fill two steps' room of 12 each: 2 x 22 ms, 10 / 44."""
    from loraplex.bench.serve_metrics import StepRecord, decode_bound

    decode = [StepRecord(float(t), 0.010, 4, 4, 0, 4, True) for t in range(5)]
    mixed = [StepRecord(5.0 + t, 0.023, 16, 3, 0, 4, True) for t in range(3)]
    odd = [StepRecord(9.0, 0.5, 11, 2, 0, 3, True), StepRecord(10.0, 0.5, 3, 3, 0, 3, True)]  # not full
    steps = decode + mixed + odd
    prompt_rows = 3 * 13 + 9
    got = decode_bound(steps, prompt_rows // 2, 4, 16)
    assert got is not None
    assert got["decode_step_s"] == pytest.approx(0.010) and got["prompt_row_s"] == pytest.approx(0.001)
    assert got["prompt_rows_per_output_token"] == pytest.approx(2)
    assert got["fraction_of_full_batch_decode"] == pytest.approx(10 / 18)
    many = decode_bound(steps, prompt_rows // 6, 4, 16)
    assert many is not None and many["fraction_of_full_batch_decode"] == pytest.approx(10 / 44)
    assert decode_bound(decode, 10, 4, 16) is None  # no full mixed step to price a prompt row


def test_base_only_ratio_names_the_bound_of_its_step_costs(tmp_path: Path) -> None:
    args = replace(ServeBenchArgs.smoke_args(), max_num_seqs=8, max_num_batched_tokens=16)
    report = run(args, tmp_path, progress=False)
    bound = report["base_only"]["steps"]["decode_bound"]
    assert bound is not None and bound["full_mixed_steps"] > 0
    assert report["ratios"]["base_only_decode_bound"] == bound["fraction_of_full_batch_decode"] <= 1
    assert "what this run's own step costs allow" in (tmp_path / "serve.md").read_text()


def test_budget_sweep_reruns_base_only_at_each_budget(tmp_path: Path) -> None:
    smoke = ServeBenchArgs.smoke_args()
    args = replace(smoke, workload=replace(smoke.workload, num_requests=16), budget_sweep=(8, 16))
    report = run(args, tmp_path, progress=False)
    sweep = [r for r in report["more_runs"] if r["name"].startswith("budget ")]
    assert [r["name"] for r in sweep] == [
        "budget 8, admission batching off, base-only",
        "budget 16, admission batching off, base-only",
    ]
    want = sum(r.output_len for r in generate(args.workload).requests)
    assert all(r["run"]["output_tokens"] == want for r in sweep)
    # no step of the budget-8 run planned more than 8 rows: its prefill took more mixed steps
    kinds = [r["run"]["steps"]["by_kind"] for r in sweep]
    steps = [sum(k["count"] for k in by.values()) for by in kinds]
    assert steps[0] > steps[1]
    assert "budget 8, admission batching off, base-only" in (tmp_path / "serve.md").read_text()


def test_budget_sweep_restores_the_engines_budget() -> None:
    from loraplex.bench.serve_model import build_engine
    from loraplex.bench.serve_more import budget_sweep

    smoke = ServeBenchArgs.smoke_args()
    args = replace(smoke, workload=replace(smoke.workload, num_requests=6), budget_sweep=(8,))
    engine, names, _ = build_engine(args, generate(args.workload))
    before = (engine.scheduler.token_budget, engine.scheduler.admission_batch_tokens)
    report: dict = {}
    from loraplex.bench.serve import run_in_process

    budget_sweep(
        report, args, engine.scheduler, lambda w, b: run_in_process(engine, names, w, b, progress=False)
    )
    assert len(report["more_runs"]) == 1
    assert (engine.scheduler.token_budget, engine.scheduler.admission_batch_tokens) == before


def test_each_run_starts_with_a_cold_prefix_cache() -> None:
    """A run finds no blocks an earlier run on the same engine left cached (each its own salt),
    unless the caller shares a salt across runs, as `bench prefix` does on purpose."""
    from loraplex.bench.serve import Replay, run_in_process
    from loraplex.bench.serve_model import build_engine

    smoke = ServeBenchArgs.smoke_args()
    spec = replace(smoke.workload, num_requests=8, prompt_len="uniform:34:44", output_len="uniform:4:8")
    args = replace(smoke, workload=spec)
    workload = generate(spec)
    engine, names, _ = build_engine(args, workload)
    runs = [run_in_process(engine, names, workload, base_only=True, progress=False) for _ in range(2)]
    assert [r["prefix_cache_hit_tokens"] for r in runs] == [0, 0]
    shared = [
        run_in_process(engine, names, workload, True, progress=False, replay=Replay(cache_salt="shared"))
        for _ in range(2)
    ]
    assert shared[0]["prefix_cache_hit_tokens"] == 0 and shared[1]["prefix_cache_hit_tokens"] >= 8 * 32


def test_the_profiler_stays_out_of_measured_runs(monkeypatch) -> None:  # noqa: ANN001
    """Only `busy_of`'s replay of the first requests opens the GPU busy window: starting and
    stopping the profiler stalls every request in flight, so the measured runs never do."""
    import loraplex.bench.serve as serve_mod
    from loraplex.bench.serve_model import build_engine

    starts: list[int] = []
    monkeypatch.setattr(serve_mod.BusyWindow, "start", lambda self: starts.append(1))
    monkeypatch.setattr(serve_mod, "BUSY_REQUESTS", 12)
    args = replace(
        ServeBenchArgs.smoke_args(), workload=replace(ServeBenchArgs.smoke_args().workload, num_requests=20)
    )
    workload = generate(args.workload)
    engine, names, _ = build_engine(args, workload)
    serve_mod.run_in_process(engine, names, workload, base_only=False, progress=False)
    assert starts == []
    busy = serve_mod.busy_of(engine, names, workload, base_only=False)
    assert starts == [1] and busy["replayed_requests"] == 12


def test_http_compare_runs_the_same_workload_against_its_own_server_process(tmp_path: Path) -> None:
    smoke = ServeBenchArgs.smoke_args()
    spec = replace(smoke.workload, num_requests=24)
    report = run(
        replace(smoke, workload=spec, http_compare=True, base_compare=False), tmp_path, progress=False
    )
    want = sum(r.output_len for r in generate(spec).requests)
    assert report["adapters"]["output_tokens"] == want == report["http"]["output_tokens"]
    assert report["http"]["latency"]["requests"] == 24 and report["http"]["server"]["adapters"] == 4
    ratio = report["ratios"]["output_tokens_per_s_http_vs_in_process"]
    assert ratio == report["http"]["output_tokens_per_s"] / report["adapters"]["output_tokens_per_s"] > 0
    assert "over HTTP" in (tmp_path / "serve.md").read_text()


def test_http_compare_on_random_weights_streams_text_of_the_synthetic_tokenizer(tmp_path: Path) -> None:
    smoke = ServeBenchArgs.smoke_args()
    spec = replace(smoke.workload, num_requests=12, ranks="8", prompt_len="uniform:8:40")
    args = replace(smoke, smoke=False, workload=spec, random_layers=1, random_shape="tiny", http_compare=True)
    report = run(replace(args, base_compare=False), None, progress=False)
    want = sum(r.output_len for r in generate(spec).requests)
    assert report["http"]["output_tokens"] == want == report["adapters"]["output_tokens"]
    # every token has text, so the first token reaches the client in a chunk of its own step
    # rather than with the last one: TTFT comes before the end of a request (outputs of 8-32
    # tokens; without text the two would be equal up to one chunk's delivery)
    lat = report["http"]["latency"]
    assert lat["ttft_s"]["p50"] < 0.9 * lat["e2e_s"]["p50"]


def test_random_weights_engine_detokenizes_with_the_bench_tokenizer() -> None:
    from loraplex.bench.serve_model import build_engine
    from loraplex.types import SamplingParams

    smoke = ServeBenchArgs.smoke_args()
    args = replace(smoke, smoke=False, random_layers=1, random_shape="tiny")
    engine, names, _ = build_engine(args, generate(replace(smoke.workload, num_requests=2)))
    engine.add_request(
        "r", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), names[0]
    )
    while engine.has_unfinished():
        engine.step()
    out = engine.output("r")
    assert out.text.split() == [f"w{t}" for t in out.token_ids]


def test_more_seeds_and_poisson_follow_the_closed_loop_run_on_the_same_engine(tmp_path: Path) -> None:
    smoke = ServeBenchArgs.smoke_args()
    spec = replace(smoke.workload, num_requests=12)
    args = replace(smoke, workload=spec, more_seeds=(5,), poisson_factor=0.9)
    report = run(args, tmp_path, progress=False)
    names = [m["name"] for m in report["more_runs"]]
    rate = 0.9 * report["adapters"]["requests_per_s"]
    assert names == [
        "seed 5, with adapters",
        "seed 5, base-only",
        f"Poisson {rate:.2f} req/s, with adapters",
        f"Poisson {rate:.2f} req/s, base-only",
    ]
    seeded, poisson = report["more_runs"][0], report["more_runs"][2]
    # every request of each workload ran to its own length
    assert seeded["spec"]["seed"] == 5
    want = sum(r.output_len for r in generate(replace(spec, seed=5)).requests)
    assert seeded["run"]["output_tokens"] == want
    assert poisson["spec"]["arrivals"] == f"poisson:{rate:.4f}"
    assert poisson["run"]["latency"]["requests"] == 12
    assert "seed 5: with adapters / base-only" in report["ratios"]
    assert "seed 5, with adapters" in (tmp_path / "serve.md").read_text()


def test_mixed_steps_by_rows_keep_only_those_beside_a_nearly_full_batch() -> None:
    """Mixed steps with at most an eighth of the batch missing, by rows rounded up to 64; pure
    decode steps, prefill steps and mixed steps beside a thin batch left out."""
    from loraplex.bench.serve_metrics import StepRecord, mixed_by_rows, step_records

    def step(seconds: float, rows: int, decode: int) -> StepRecord:
        return StepRecord(0.0, seconds, rows, decode, 0, decode + 1, True)

    steps = [
        step(0.010, 120, 60),  # -> 128
        step(0.012, 128, 63),  # -> 128
        step(0.014, 127, 62),  # -> 128
        step(0.020, 384, 56),  # -> 384 (exactly an eighth short)
        step(0.050, 384, 55),  # a thin batch: left out
        step(0.007, 64, 64),  # pure decode: left out
        step(0.009, 300, 0),  # prefill only: left out
    ]
    got = mixed_by_rows(steps, 64)
    assert got == {
        "128": {"count": 3, "median_s": 0.012, "decode_rows_mean": (60 + 63 + 62) / 3},
        "384": {"count": 1, "median_s": 0.020, "decode_rows_mean": 56.0},
    }
    rec = step_records(steps[:2])
    assert rec["fields"][:4] == ["start_s", "seconds", "rows", "decode_rows"]
    assert rec["rows"] == [[0.0, 0.010, 120, 60, 0, 61, True], [0.0, 0.012, 128, 63, 0, 64, True]]


def test_step_records_on_request(tmp_path: Path) -> None:
    report = run(replace(ServeBenchArgs.smoke_args(), step_records=True), tmp_path, progress=False)
    for name in ("adapters", "base_only"):
        rec = report[name]["step_records"]
        assert len(rec["rows"]) == report[name]["steps"]["count"]
        kinds = {"decode" if r[3] == r[2] else "mixed" if r[3] else "prefill" for r in rec["rows"]}
        assert kinds == set(report[name]["steps"]["by_kind"])
    assert (
        "step_records" not in run(ServeBenchArgs.smoke_args(), tmp_path / "plain", progress=False)["adapters"]
    )


def test_worst_step_names_the_step_against_its_own_buckets_median() -> None:
    """The outlier is judged within its kind and power-of-two row bucket (buckets of 3 or more):
    a slow decode step of 64 rows beats a longer mixed step whose bucket takes that long anyway,
    and a lone step in a bucket of two is not judged."""
    from loraplex.bench.serve_metrics import StepRecord, summarize, worst_step

    def step(start: float, seconds: float, rows: int, decode: int) -> StepRecord:
        return StepRecord(start, seconds, rows, decode, 0, decode + 1, True)

    steps = [
        step(1.0, 0.007, 64, 64),
        step(1.1, 0.007, 64, 64),
        step(1.2, 0.021, 64, 64),  # 3x its bucket's median: the outlier
        step(1.3, 0.007, 64, 64),
        step(1.4, 0.030, 384, 60),
        step(1.5, 0.031, 384, 60),
        step(1.6, 0.050, 384, 60),  # 1.6x
        step(1.7, 0.001, 16, 16),  # a bucket of two steps: not judged
        step(1.8, 0.009, 16, 16),
    ]
    w = worst_step(steps)
    assert w is not None
    assert (w["kind"], w["rows"], w["bucket"], w["index"], w["bucket_steps"]) == ("decode", 64, 64, 2, 4)
    assert w["over_median"] == pytest.approx(3.0) and w["at_s"] == pytest.approx(0.2)
    assert w["bucket_median_s"] == pytest.approx(0.007)
    assert worst_step(steps[7:]) is None
    summary = summarize([], steps, 1.0, 64)
    assert summary["steps"]["max_over_median_same_kind_and_bucket"] == pytest.approx(3.0)
    assert summary["steps"]["worst_step"] == w

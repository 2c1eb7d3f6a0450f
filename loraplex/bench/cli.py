"""`loraplex bench ...` subcommands (argparse). `register` plugs them into the main CLI; this module
also runs alone: `python -m loraplex.bench.cli kernels --out DIR`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from loraplex.bench.workloads import add_workload_flags

DEFAULT_KERNELS_OUT = Path("bench-results/kernels")
DEFAULT_ENGINE_OUT = Path("bench-results/engine")


def _kernels(args: argparse.Namespace) -> int:
    from loraplex.bench.kernels import run  # lazy: torch.cuda work and triton only when asked

    report = run(args.out, quick=args.quick, reps=args.reps, warmup=args.warmup, sweep=not args.no_sweep)
    for t in report["targets"]:
        print(f"{'PASS' if t['pass'] else 'FAIL'}  {t['name']}: {t['value']:.3f} ({t['threshold']})")
    print(f"wrote {args.out}/kernels.json, kernels.md, kernels.png")
    return 0


def _engine(args: argparse.Namespace) -> int:
    from loraplex.bench.engine import EngineBenchArgs, run
    from loraplex.bench.engine_report import summary_rows

    bench_args = EngineBenchArgs.preset(
        args.tiny,
        device=args.device,
        layers=args.layers,
        batch=args.batch,
        context=args.context,
        adapters=args.adapters,
        rank=args.rank,
        steps=args.steps,
        profile=args.profile or None,
        graphs=False if args.no_graphs else None,
        repeats=args.repeats,
    )
    report = run(bench_args, args.out)
    for name, value in summary_rows(report):
        print(f"{name:52s} {value}")
    print(f"wrote {args.out}/engine.json, engine.md, engine.png")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from dataclasses import fields, replace

    from loraplex.bench.serve import run
    from loraplex.bench.serve_model import ServeBenchArgs
    from loraplex.bench.workloads import WorkloadSpec
    from loraplex.config import SchedulerConfig

    given = {f.name: getattr(args, f.name) for f in fields(WorkloadSpec) if getattr(args, f.name) is not None}
    try:
        if args.smoke:
            bench = ServeBenchArgs.smoke_args()
            bench = replace(bench, workload=replace(bench.workload, **given))
        else:
            bench = ServeBenchArgs(workload=WorkloadSpec(**given))
        overrides = {
            "device": args.device,
            "model": args.model,
            "random_layers": args.random_layers,
            "random_shape": args.random_shape,
            "workdir": args.workdir,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "graph_max_tokens": args.graph_max_tokens,
            "admission_batch_tokens": args.admission_batch_tokens,
            "url": args.url,
            "api_key": args.api_key,
        }
        bench = replace(bench, **{k: v for k, v in overrides.items() if v is not None})
        if args.no_base_compare:
            bench = replace(bench, base_compare=False)
        if args.hf_compare:
            bench = replace(bench, hf_compare=True)
        if args.hf_requests is not None:
            if args.hf_requests < 1:
                raise ValueError(f"--hf-requests must be at least 1, got {args.hf_requests}")
            bench = replace(bench, hf_requests=args.hf_requests)
        if args.hf_time_limit is not None:
            if args.hf_time_limit <= 0:
                raise ValueError(f"--hf-time-limit must be > 0 seconds, got {args.hf_time_limit}")
            bench = replace(bench, hf_time_limit_s=args.hf_time_limit)
        if args.http_compare:
            bench = replace(bench, http_compare=True)
        if args.step_records:
            bench = replace(bench, step_records=True)
        if args.more_seeds:
            bench = replace(bench, more_seeds=tuple(int(x) for x in args.more_seeds.split(",")))
        if args.poisson_factor is not None:
            bench = replace(bench, poisson_factor=args.poisson_factor)
        if args.budget_sweep:
            bench = replace(bench, budget_sweep=tuple(int(x) for x in args.budget_sweep.split(",")))
            most = SchedulerConfig(
                max_num_seqs=bench.max_num_seqs, max_num_batched_tokens=bench.max_num_batched_tokens
            ).step_token_budget
            if any(not 0 < b <= most for b in bench.budget_sweep):
                raise ValueError(f"--budget-sweep budgets must be 1..{most} (--max-num-batched-tokens)")
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    report = run(bench, args.out, progress=not args.quiet)
    for name in ("adapters", "base_only", "http"):
        if name in report:
            r = report[name]
            lat = r["latency"]
            print(
                f"{name:9s} output tok/s {r['output_tokens_per_s']:9.1f}  req/s {r['requests_per_s']:7.2f}  "
                f"TTFT p50/p99 {lat['ttft_s']['p50'] * 1e3:.1f}/{lat['ttft_s']['p99'] * 1e3:.1f} ms"
            )
    ratios = report.get("ratios", {})
    if "output_tokens_per_s_vs_base" in ratios:
        print(f"with adapters / base-only: {ratios['output_tokens_per_s_vs_base']:.3f}")
    if "output_tokens_per_s_http_vs_in_process" in ratios:
        print(f"over HTTP / in-process: {ratios['output_tokens_per_s_http_vs_in_process']:.3f}")
    if "output_tokens_per_s_vs_hf_peft" in ratios:
        print(f"with adapters / transformers + PEFT: {ratios['output_tokens_per_s_vs_hf_peft']:.2f}")
    print(f"wrote {args.out}/serve.json, serve.md, serve.png")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks (writes JSON + markdown + PNG)")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    k = sub.add_parser("kernels", help="LoRA kernels on Llama-3-8B layer shapes (needs CUDA)")
    k.add_argument("--out", type=Path, default=DEFAULT_KERNELS_OUT, help="output directory")
    k.add_argument("--quick", action="store_true", help="only the target cases")
    k.add_argument("--reps", type=int, default=40, help="timed runs per measurement (median)")
    k.add_argument("--warmup", type=int, default=5)
    k.add_argument(
        "--no-sweep", action="store_true", help="skip the tiling table and the multi-layer graph timing"
    )
    k.set_defaults(run=_kernels)  # the main CLI dispatches on `args.run`
    e = sub.add_parser("engine", help="decode step of the whole engine vs its bandwidth floor")
    e.add_argument("--device", default="cuda", help="cuda or cpu")
    e.add_argument("--tiny", action="store_true", help="tiny model and small defaults (CPU smoke run)")
    e.add_argument("--layers", type=int, help="decoder layers (default: 32, tiny: 2)")
    e.add_argument("--batch", type=int, help="concurrent requests (default 64, tiny 8)")
    e.add_argument("--context", type=int, help="prompt tokens per request (default 1024, tiny 64)")
    e.add_argument("--adapters", type=int, help="distinct adapters in the LoRA run (default 32, tiny 4)")
    e.add_argument("--rank", type=int, help="adapter rank (default 16, tiny 8)")
    e.add_argument("--steps", type=int, help="timed decode steps, median (default 50, tiny 10)")
    e.add_argument("--repeats", type=int, help="alternating base-only / LoRA pairs (default 3, tiny 1)")
    e.add_argument("--profile", action="store_true", help="write torch.profiler tables of a few steps")
    e.add_argument("--no-graphs", action="store_true", help="run decode steps eagerly (no CUDA graphs)")
    e.add_argument("--out", type=Path, default=DEFAULT_ENGINE_OUT, help="output directory")
    e.set_defaults(run=_engine)
    s = sub.add_parser(
        "serve",
        help="a serving workload against the engine in-process or a server over HTTP (TTFT, TPOT, P99)",
        description="Workload fields (seed, lengths, arrivals, ...) follow bench/workloads.py's syntax.",
    )
    s.add_argument("--smoke", action="store_true", help="the CPU demo model and a small workload (< 1 min)")
    s.add_argument("--url", help="benchmark a running server (streaming /v1/completions) instead")
    s.add_argument("--api-key", help="bearer token for --url")
    s.add_argument("--device", help="cpu or cuda (in-process)")
    s.add_argument("--model", help="model directory (default: the demo model, or --random-layers)")
    s.add_argument("--random-layers", type=int, help="random Llama-3-8B-shaped weights with N layers")
    s.add_argument("--random-shape", choices=("llama3-8b", "tiny"), help="shape of --random-layers weights")
    s.add_argument("--workdir", help="where --hf-compare writes random weights as files (reused)")
    s.add_argument("--max-num-seqs", type=int, help="engine batch limit (default 64)")
    s.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="engine token budget per step (default: 6 per sequence, at least 384)",
    )
    s.add_argument(
        "--graph-max-tokens",
        type=int,
        help="rows of the largest step with prefill chunks that replays a CUDA graph (0: decode steps only)",
    )
    s.add_argument(
        "--admission-batch-tokens", type=int, help="prompt tokens a decode-only step waits for to admit"
    )
    s.add_argument("--no-base-compare", action="store_true", help="skip the same workload base-only")
    s.add_argument(
        "--hf-compare",
        action="store_true",
        help="also run the workload through transformers + PEFT (model and adapters from directories)",
    )
    s.add_argument(
        "--hf-requests",
        type=int,
        help="transformers + PEFT on the workload's first N requests only (default: all)",
    )
    s.add_argument(
        "--hf-time-limit",
        type=float,
        help="stop transformers + PEFT after this many seconds of generation; the report then gives its "
        "measured pace and the fastest it could have finished (an upper bound on its tokens/s)",
    )
    s.add_argument(
        "--http-compare",
        action="store_true",
        help="also the workload over HTTP, against a server on the same engine in its own process",
    )
    s.add_argument("--more-seeds", help="then the workload with these seeds too (comma list), same engine")
    s.add_argument(
        "--poisson-factor",
        type=float,
        help="then Poisson arrivals at this fraction of the closed-loop run's request rate, same engine",
    )
    s.add_argument(
        "--budget-sweep",
        help="then the workload base-only at each of these step token budgets (comma list, at most "
        "--max-num-batched-tokens), admission batching off, same engine",
    )
    s.add_argument(
        "--step-records",
        action="store_true",
        help="keep every step's record (start, seconds, rows, decode rows, ...) in serve.json, per run",
    )
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    add_workload_flags(s)
    s.add_argument("--out", type=Path, default=Path("bench-results/serve"), help="output directory")
    s.set_defaults(run=_serve)
    from loraplex.bench.registration import add_parser as add_registration  # loads no torch

    add_registration(sub)
    from loraplex.bench.capacity_cli import add_parser as add_capacity  # loads no torch

    add_capacity(sub)
    from loraplex.bench.sim_cli import add_parser as add_simulate  # loads no torch

    add_simulate(sub)
    from loraplex.bench.prefix_cli import add_parser as add_prefix  # loads no torch

    add_prefix(sub)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loraplex.bench.cli")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    argv = sys.argv[1:] if argv is None else argv
    # standalone: accept both `kernels ...` and `bench kernels ...`
    args = parser.parse_args(argv if argv[:1] == ["bench"] else ["bench", *argv])
    return int(args.run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())

"""`loraplex bench ...` subcommands (argparse). `register` plugs them into the main CLI; this module
also runs alone: `python -m loraplex.bench.cli kernels --out DIR`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_KERNELS_OUT = Path("bench-results/kernels")
DEFAULT_ENGINE_OUT = Path("bench-results/engine")


def _kernels(args: argparse.Namespace) -> int:
    from loraplex.bench.kernels import run  # lazy: torch.cuda work and triton only when asked

    variants = set(args.variants.split(",")) if args.variants else None
    report = run(
        args.out,
        quick=args.quick,
        reps=args.reps,
        warmup=args.warmup,
        sweep=not args.no_sweep,
        variants=variants,
    )
    for t in report["targets"]:
        print(f"{'PASS' if t['pass'] else 'FAIL'}  {t['name']}: {t['value']:.3f} ({t['threshold']})")
    print(f"wrote {args.out}/kernels.json, kernels.md, kernels.png")
    return 0


def _engine(args: argparse.Namespace) -> int:
    from loraplex.bench.engine import EngineBenchArgs, run, summary_rows

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
        lora_tiling=args.lora_tiling,
        lora_overlap=args.lora_overlap,
        repeats=args.repeats,
        also=tuple(v for v in (args.also or "").split(";") if v.strip()) or None,
    )
    report = run(bench_args, args.out)
    for name, value in summary_rows(report):
        print(f"{name:52s} {value}")
    print(f"wrote {args.out}/engine.json, engine.md, engine.png")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks (writes JSON + markdown + PNG)")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    k = sub.add_parser("kernels", help="LoRA kernels on Llama-3-8B layer shapes (needs CUDA)")
    k.add_argument("--out", type=Path, default=DEFAULT_KERNELS_OUT, help="output directory")
    k.add_argument("--quick", action="store_true", help="only the three target cases")
    k.add_argument("--reps", type=int, default=40, help="timed runs per measurement (median)")
    k.add_argument("--warmup", type=int, default=5)
    k.add_argument("--no-sweep", action="store_true", help="skip the tiling comparison")
    k.add_argument("--variants", help="comma-separated tiling variants to sweep (default: all)")
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
    e.add_argument(
        "--lora-tiling", help="LoRA kernel tiling variant (see `bench kernels`; default: per step)"
    )
    e.add_argument(
        "--lora-overlap",
        type=int,
        choices=(0, 1, 2),
        help="LoRA ops against their base GEMMs: 0 after, 1 shrink beside, 2 whole op beside (default)",
    )
    e.add_argument(
        "--also",
        help="more LoRA configurations timed in every repeat, ';'-separated: a mode ('in-place', "
        "'overlap', 'concurrent'), a tiling variant, or one of each joined by '+' "
        "(e.g. 'in-place;decode fused w4;in-place+decode fused w4')",
    )
    e.add_argument("--out", type=Path, default=DEFAULT_ENGINE_OUT, help="output directory")
    e.set_defaults(run=_engine)


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

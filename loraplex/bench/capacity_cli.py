"""The engine-running sub-modes of `loraplex bench capacity`: their flags and their dispatch.

    --sweep                       the thrash sweep (bench/capacity_sweep.py) with the flags below
    --smoke                       the sweep on the CPU, tiny shapes, in seconds (in the test suite)
    --h200                        the issue's H200 target: Llama-3-8B shape, 1,000 adapters, Zipf 1,
                                  room for 64 against all resident (flags given still override)
    --load-latency                load until usable vs pinned bandwidth (bench/capacity_load.py)

Imports nothing heavy: `loraplex --help` builds this parser.
"""

from __future__ import annotations

import argparse
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

# sweep flag -> SweepArgs field, for the flags whose value is taken as given
_SWEEP_FLAGS = {
    "device": "device",
    "random_layers": "layers",
    "room_adapters": "room_adapters",
    "room_bytes": "device_bytes",
    "requests": "requests",
    "concurrency": "concurrency",
    "prompt_len": "prompt_len",
    "output_len": "output_len",
    "skip_fraction": "skip_fraction",
    "seed": "seed",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`bench capacity`: the byte-arithmetic parser (bench/capacity.py) plus the engine modes."""
    from loraplex.bench.capacity import add_parser as add_arithmetic

    p = add_arithmetic(sub)
    arithmetic = p.get_default("run")

    def dispatch(args: argparse.Namespace) -> int:
        if args.sweep or args.smoke or args.h200 or args.load_latency:
            return run_engine_modes(args)
        return int(arithmetic(args))

    add_engine_arguments(p)
    p.set_defaults(run=dispatch)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine runs (thrash sweep, load latency)")
    g.add_argument("--sweep", action="store_true", help="adapter count x popularity thrash sweep")
    g.add_argument("--smoke", action="store_true", help="the sweep on the CPU with tiny shapes")
    g.add_argument("--h200", action="store_true", help="the issue's H200 target configuration")
    g.add_argument("--load-latency", action="store_true", help="adapter load latency vs H2D bandwidth")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cpu; --h200 cuda)")
    g.add_argument("--random-layers", type=int, default=None, help="layers of the random model")
    g.add_argument("--counts", default=None, help="registered adapter counts, e.g. 8,32,128,512")
    g.add_argument("--popularities", default=None, help="e.g. uniform,zipf:0.5,zipf:1.0,zipf:1.5")
    g.add_argument("--room-adapters", type=int, default=None, help="device room in adapters")
    g.add_argument("--room-bytes", type=int, default=None, help="device room in bytes")
    g.add_argument("--requests", type=int, default=None, help="requests per point")
    g.add_argument("--concurrency", type=int, default=None, help="closed-loop requests in flight")
    g.add_argument("--prompt-len", default=None, help="e.g. uniform:128:1024")
    g.add_argument("--output-len", default=None, help="e.g. uniform:64:256")
    g.add_argument("--skip-fraction", type=float, default=None, help="leading requests left out")
    g.add_argument("--compare-resident", action="store_true", help="also run all adapters resident")
    g.add_argument("--repeats", type=int, default=20, help="--load-latency: loads per rank")
    g.add_argument("--seed", type=int, default=None)


def sweep_args(args: argparse.Namespace) -> Any:  # noqa: ANN401
    """SweepArgs from the flags: the preset (--h200 or the CPU defaults) with given flags on top."""
    from loraplex.bench.capacity_sweep import SweepArgs

    sweep = SweepArgs.h200() if args.h200 else SweepArgs()
    given: dict[str, Any] = {
        field: getattr(args, flag) for flag, field in _SWEEP_FLAGS.items() if getattr(args, flag) is not None
    }
    if args.room_bytes is not None:
        given["room_adapters"] = None
    if args.counts:
        given["counts"] = tuple(int(c) for c in args.counts.split(","))
    if args.popularities:
        given["popularities"] = tuple(p.strip() for p in args.popularities.split(","))
    if args.targets and args.targets != "all":
        given["targets"] = tuple(t.strip() for t in args.targets.split(","))
    elif args.targets == "all":
        from loraplex.lora.layout import TARGETS

        given["targets"] = TARGETS
    if args.ranks != "8:0.5,16:0.5":  # the byte-arithmetic default: the sweep keeps its own
        given["ranks"] = args.ranks
    if args.compare_resident:
        given["compare_resident"] = True
    if args.shape is not None:
        given["shape"] = args.shape
    if args.smoke:
        given.update(device="cpu", shape="tiny", compare_resident=True)
    known = {f.name for f in fields(SweepArgs)}
    return replace(sweep, **{k: v for k, v in given.items() if k in known})


def run_engine_modes(args: argparse.Namespace) -> int:
    from loraplex.bench.capacity_report import write

    out: Path = args.out
    if args.load_latency:
        from loraplex.bench.capacity_load import run as run_load

        device = args.device or ("cuda" if args.h200 else "cpu")
        shape = "tiny" if args.smoke else (args.shape or "llama3-8b")
        report = run_load(device, shape, args.random_layers, repeats=args.repeats)
        files = write(report, out, "load_latency")
        print(f"wrote {', '.join(str(out / f) for f in files)}")
        if not (args.sweep or args.h200 or args.smoke):
            return 0
    from loraplex.bench.capacity_sweep import run as run_sweep

    report = run_sweep(sweep_args(args), progress=not args.smoke)
    files = write(report, out, "thrash")
    print(f"wrote {', '.join(str(out / f) for f in files)}")
    return 0

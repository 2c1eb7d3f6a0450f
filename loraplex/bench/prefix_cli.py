"""`loraplex bench prefix`: its flags and its run (bench/prefix.py). Imports nothing heavy:
`loraplex --help` builds this parser."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

# PrefixBenchArgs field (its flag: dashes for underscores) -> (type, help)
_FLAGS: dict[str, tuple[type, str]] = {
    "device": (str, "cuda or cpu (default cuda; --smoke: cpu)"),
    "model": (str, "model directory (default: random weights; --smoke: the demo model)"),
    "random_layers": (int, "layers of the random Llama-3-8B-shaped model (default 32)"),
    "random_shape": (str, "llama3-8b (default) or tiny"),
    "dtype": (str, "float32, bfloat16 or float16 (default bfloat16; the demo model float32)"),
    "num_adapters": (int, "adapters, in turn over the requests (default 8)"),
    "rank": (int, "adapter rank, all seven targets (default 16)"),
    "requests": (int, "requests arriving together (default 64)"),
    "prefix_len": (int, "tokens of the shared system prompt (default 1024)"),
    "suffix_len": (int, "tokens of each request's own suffix (default 64)"),
    "output_len": (int, "greedy output tokens per request (default 32)"),
    "max_num_batched_tokens": (int, "token budget of a step (default 2048)"),
    "seed": (int, "weights, adapters, prompts (default 0)"),
    "workdir": (str, "random weights as files for --fp32-reference (default bench-results/serve-checkpoint)"),
}


def _run(args: argparse.Namespace) -> int:
    from loraplex.bench.prefix import PrefixBenchArgs, run
    from loraplex.bench.prefix_report import verdict

    given: dict[str, Any] = {k: getattr(args, k) for k in _FLAGS if getattr(args, k) is not None}
    if args.no_cache_off:
        given["cache_off"] = False
    if args.fp32_reference:
        given["fp32_reference"] = True
    bench = PrefixBenchArgs.smoke_args(**given) if args.smoke else replace(PrefixBenchArgs(), **given)
    report = run(bench, args.out, progress=not args.quiet)
    for name, r in report["runs"].items():
        if name == "prime":
            continue
        t = r["ttft_s"]
        print(
            f"{name:9s} TTFT p50/p90/p99/mean "
            f"{t['p50'] * 1e3:.1f}/{t['p90'] * 1e3:.1f}/{t['p99'] * 1e3:.1f}/{t['mean'] * 1e3:.1f} ms  "
            f"cached tokens/request {r['cached_tokens']['mean']:.1f}"
        )
    for name, ratios in report["ratios"].items():
        print(f"TTFT {name.replace('_', ' ')}: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items() if v))
    for name, same in report["outputs"].items():
        print(f"greedy tokens {name.replace('_', ' ')}: {same['identical']}/{same['requests']} identical")
    target = report["target"]
    limit, decided = target["ttft_ratio_max"], target["identical_where_decided"]
    same = target["identical_outputs"] if decided is None else decided
    rule = "same greedy tokens"
    if decided is not None:
        ref = report["fp32_reference"]
        rule += f" wherever the float32 reference's top-2 margin >= {ref['margin']}"
        rule += f" ({ref['steps_checked']} steps checked)"
    passed = verdict(target["ttft_ratio_pass"] and same)
    print(f"{passed}  TTFT warm <= {limit} x cold (nothing shared), {rule}")
    if target["ttft_ratio_pass_vs_cache_off"] is not None:
        print(f"{verdict(target['ttft_ratio_pass_vs_cache_off'] and same)}  the same against no prefix cache")
    if decided is not None:  # the dtype's own distance from float32, with prefix hits and without
        for name, a in report["fp32_reference"]["by_run"].items():
            top = a["largest_margin_missed"]
            print(
                f"  {name.replace('_', ' ')} against float32: {a['missed']} of {a['steps_checked']} "
                f"decided steps missed" + ("" if top is None else f", the largest margin missed {top:.3f}")
            )
    print(f"wrote {args.out}/prefix.json, prefix.md, prefix.png")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prefix",
        help="TTFT with the prefix cache warm against cold (shared system prompt, many adapters)",
        description="Defaults: issue 19's scenario on an H200 (Llama-3-8B shape, bf16, 64 requests, "
        "1,024-token system prompt, 8 adapters, 64-token suffixes).",
    )
    p.add_argument("--smoke", action="store_true", help="the CPU demo model, 16 small requests (seconds)")
    for name, (kind, text) in _FLAGS.items():
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=None, help=text)
    p.add_argument(
        "--no-cache-off", action="store_true", help="skip the second engine without a prefix cache"
    )
    p.add_argument(
        "--fp32-reference",
        action="store_true",
        help="also transformers + PEFT in float32 along the cold run's tokens: warm and cold must give "
        "its greedy token wherever its top-2 margin is >= 0.1 (random weights are written to --workdir)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--out", type=Path, default=Path("bench-results/prefix"), help="output directory")
    p.set_defaults(run=_run)

"""`loraplex bench capacity`: how many adapters fit in each residency tier, for a model shape and
a rank mix, from byte arithmetic alone (no weights are made and nothing runs).

    loraplex bench capacity [--shape llama3-8b | tiny | DIR] [--ranks 8:0.5,16:0.5]
                            [--targets q,k,v,o] [--adapter-device-bytes N] [--adapter-host-bytes N]

Per rank: an adapter's actual bytes (its A and B at the serving dtype) and the bytes the device
pool allocates for it (`AdapterPool.footprint`: every tensor 16-byte aligned, never padded to a
larger rank), their ratio, and how many such adapters fit in the device pool and the host cache;
for the rank mix, the expected bytes per adapter and the adapters per tier. The base weights'
bytes and the KV bytes per token are reported beside them, since the device pool's budget is what
is left of the GPU after those. JSON, markdown and a PNG (adapters per tier per rank).

Sub-modes that run the engine (bench/capacity_cli.py adds their flags; torch and the model load
only then):

    --sweep [--smoke | --h200]   where the cache starts to thrash: adapter count x popularity
                                 against a fixed device room (bench/capacity_sweep.py)
    --load-latency               adapter load until its slot is usable vs pinned H2D bandwidth
                                 (bench/capacity_load.py)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from loraplex.bench.plots import pyplot

GIB = 1 << 30

# torch and the model configs load inside the functions: `loraplex --help` imports this module.


def _model_config(shape: str) -> Any:
    from loraplex.bench.random_weights import llama3_8b_hf_dict, tiny_hf_dict
    from loraplex.config import ModelConfig

    if shape == "llama3-8b":
        return ModelConfig.from_hf_dict(llama3_8b_hf_dict())
    if shape == "tiny":
        return ModelConfig.from_hf_dict(tiny_hf_dict())
    path = Path(shape)
    if not (path / "config.json").is_file():
        raise SystemExit(f"--shape {shape!r}: expected llama3-8b, tiny or a model directory with config.json")
    return ModelConfig.from_dir(str(path))


def _base_bytes(mc: Any, elem: int) -> int:
    per_layer = sum(d_in * d_out for d_in, d_out in mc.module_dims.values()) + 2 * mc.hidden_size
    embed = mc.vocab_size * mc.hidden_size
    head = 0 if mc.tie_word_embeddings else embed
    return (mc.num_hidden_layers * per_layer + embed + head + mc.hidden_size) * elem


def adapter_bytes(mc: Any, rank: int, targets: list[str], dtype: Any) -> tuple[int, int]:
    """(actual, allocated in the device pool) bytes of one adapter of `rank` on `targets` of every
    layer, computed on meta tensors."""
    import torch

    from loraplex.adapters.device_pool import ALIGN, AdapterPool
    from loraplex.lora.weights import AdapterWeights, LoRAPair

    pairs = {}
    for layer in range(mc.num_hidden_layers):
        for t in targets:
            d_in, d_out = mc.module_dims[t]
            a = torch.empty(rank, d_in, dtype=dtype, device="meta")
            pairs[(layer, t)] = LoRAPair(a, torch.empty(d_out, rank, dtype=dtype, device="meta"), 1.0)
    weights = AdapterWeights(pairs)
    return weights.nbytes, AdapterPool(ALIGN, dtype, "meta").footprint(weights)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from loraplex.bench.workload_fields import parse_ranks

    shape = args.shape or "llama3-8b"
    mc = _model_config(shape)
    dtype = torch.bfloat16
    elem = 2
    chosen = args.targets or "all"
    targets = [t.strip() for t in chosen.split(",")] if chosen != "all" else list(mc.module_dims)
    unknown = [t for t in targets if t not in mc.module_dims]
    if unknown:
        raise SystemExit(f"--targets: unknown {unknown}; the targets are {', '.join(mc.module_dims)}")
    try:
        ranks, weights = parse_ranks(args.ranks)
    except ValueError as err:
        raise SystemExit(f"--ranks: {err}") from None
    total_w = sum(weights)
    per_rank = []
    for rank, w in zip(ranks, weights, strict=True):
        actual, allocated = adapter_bytes(mc, rank, targets, dtype)
        per_rank.append(
            {
                "rank": rank,
                "share": w / total_w,
                "actual_bytes": actual,
                "allocated_bytes": allocated,
                "allocated_over_actual": allocated / actual,
                "fit_device": args.adapter_device_bytes // allocated,
                "fit_host": args.adapter_host_bytes // actual,
            }
        )
    mean_alloc = sum(r["share"] * r["allocated_bytes"] for r in per_rank)
    mean_actual = sum(r["share"] * r["actual_bytes"] for r in per_rank)
    kv_per_token = mc.num_hidden_layers * 2 * mc.num_key_value_heads * mc.head_dim * elem
    return {
        "shape": shape,
        "model": {"layers": mc.num_hidden_layers, "hidden": mc.hidden_size, "vocab": mc.vocab_size},
        "dtype": "bfloat16",
        "targets": targets,
        "ranks": args.ranks,
        "base_bytes": _base_bytes(mc, elem),
        "kv_bytes_per_token": kv_per_token,
        "adapter_device_bytes": args.adapter_device_bytes,
        "adapter_host_bytes": args.adapter_host_bytes,
        "per_rank": per_rank,
        "mix": {
            "mean_actual_bytes": mean_actual,
            "mean_allocated_bytes": mean_alloc,
            "fit_device": int(args.adapter_device_bytes // mean_alloc),
            "fit_host": int(args.adapter_host_bytes // mean_actual),
        },
    }


def markdown(report: dict[str, Any]) -> str:
    def mib(n: float) -> str:
        return f"{n / (1 << 20):.2f}"

    lines = [
        "# Adapter capacity per tier",
        "",
        f"Shape {report['shape']} ({report['model']['layers']} layers), bf16, targets "
        f"{','.join(report['targets'])}; base weights {report['base_bytes'] / GIB:.2f} GiB, KV "
        f"{report['kv_bytes_per_token'] / 1024:.0f} KiB per token; device pool "
        f"{report['adapter_device_bytes'] / GIB:.2f} GiB, host cache "
        f"{report['adapter_host_bytes'] / GIB:.2f} GiB.",
        "",
        "| rank | share | actual MiB | allocated MiB | allocated / actual | fit on device | fit in host |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["per_rank"]:
        lines.append(
            f"| {r['rank']} | {r['share']:.2f} | {mib(r['actual_bytes'])} | {mib(r['allocated_bytes'])} "
            f"| {r['allocated_over_actual']:.4f} | {r['fit_device']} | {r['fit_host']} |"
        )
    m = report["mix"]
    lines += [
        "",
        f"Rank mix {report['ranks']}: {mib(m['mean_allocated_bytes'])} MiB allocated per adapter on "
        f"average; {m['fit_device']} adapters on the device, {m['fit_host']} in the host cache.",
        "",
    ]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    labels = [f"r={r['rank']}" for r in report["per_rank"]] + ["mix"]
    device = [r["fit_device"] for r in report["per_rank"]] + [report["mix"]["fit_device"]]
    host = [r["fit_host"] for r in report["per_rank"]] + [report["mix"]["fit_host"]]
    xs = range(len(labels))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([x - 0.2 for x in xs], device, width=0.4, label="device pool")
    ax.bar([x + 0.2 for x in xs], host, width=0.4, label="host cache")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("adapters that fit")
    ax.set_yscale("log")
    ax.set_title(f"{report['shape']}: adapters per tier")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _main(args: argparse.Namespace) -> int:
    report = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "capacity.json").write_text(json.dumps(report, indent=1) + "\n")
    md = markdown(report)
    plotted = plot(report, args.out / "capacity.png")
    if not plotted:
        md += "\n(no plot: matplotlib is not installed)\n"
    (args.out / "capacity.md").write_text(md)
    print(md)
    print(f"wrote {args.out}/capacity.json, capacity.md" + (", capacity.png" if plotted else ""))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("capacity", help="how many adapters fit per residency tier (byte arithmetic)")
    p.add_argument("--shape", default=None, help="llama3-8b (default), tiny or a model directory")
    p.add_argument("--ranks", default="8:0.5,16:0.5", help="rank mix: 16 | 8,16,32 | 8:0.5,16:0.5")
    p.add_argument(
        "--targets",
        default=None,
        help="all or a comma list of q,k,v,o,gate,up,down (default: all; sweep q,k,v,o)",
    )
    p.add_argument("--adapter-device-bytes", type=int, default=8 * GIB, help="device pool budget")
    p.add_argument("--adapter-host-bytes", type=int, default=64 * GIB, help="host cache budget")
    p.add_argument("--out", type=Path, default=Path("bench-results/capacity"), help="output directory")
    p.set_defaults(run=_main)
    return p

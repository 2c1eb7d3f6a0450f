"""Write a kernel benchmark report: JSON (everything), markdown (tables), PNG (matplotlib, lazily;
skipped with a note when matplotlib is not installed)."""

from __future__ import annotations

import json
from pathlib import Path

from loraplex.bench.kernel_cases import GROUPS, LAYER
from loraplex.bench.plots import pyplot

KEY_CASES = ("decode M=64 D=32 r=16", "decode M=64 D=32 r=mixed", "prefill M=4096 D=8 r=16")


def _fmt_bytes(n: float) -> str:
    return f"{n / 1e6:.1f}"


def markdown(report: dict) -> str:
    lines = [
        "# LoRA kernel benchmark",
        "",
        f"Device: {report['device']}; torch {report['torch']}, triton {report['triton']}; "
        f"median of {report['reps']} CUDA-event timings, L2 flushed before each.",
        f"Ceilings measured in this run: copy bandwidth {report['copy_bw_GBps']:.0f} GB/s (read + written), "
        f"bf16 matrix rate {report['matmul_TFLOPs']:.0f} TFLOP/s.",
        "",
        "## Targets",
        "",
        "| target | measured | threshold | pass |",
        "| --- | ---: | ---: | :---: |",
    ]
    for t in report["targets"]:
        lines.append(
            f"| {t['name']} | {t['value']:.3f} | {t['threshold']} | {'yes' if t['pass'] else 'NO'} |"
        )
    lines += [
        "",
        "## Whole layer (all seven targets)",
        "",
        "Times in µs; `frac` = minimal bytes / time / copy bandwidth; base = the base GEMMs of the layer.",
        "",
        "| case | LoRA eager | LoRA graph | frac (graph) | min MB | base graph | LoRA / base | meta build |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["results"]:
        m = r["layers"][LAYER]
        lines.append(
            f"| {r['label']} | {m['eager_us']:.1f} | {m['graph_us']:.1f} | {m['graph_copy_frac']:.2f} | "
            f"{_fmt_bytes(m['min_bytes'])} | {m['base_graph_us']:.1f} | "
            f"{m['graph_us'] / m['base_graph_us']:.2f} | {r['meta_build_us']:.0f} |"
        )
    lines += ["", "## Per group (key cases)", ""]
    lines += [
        "| case | group | LoRA eager | LoRA graph | frac (graph) | frac matrix | min MB | base graph |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["results"]:
        if r["label"] not in KEY_CASES:
            continue
        for g in (*GROUPS, LAYER):
            m = r["layers"].get(g)
            if m:
                lines.append(
                    f"| {r['label']} | {g} | {m['eager_us']:.1f} | {m['graph_us']:.1f} | "
                    f"{m['graph_copy_frac']:.2f} | {m['graph_mm_frac']:.3f} | {_fmt_bytes(m['min_bytes'])} | "
                    f"{m['base_graph_us']:.1f} |"
                )
    if report.get("tiling"):
        lines += [
            "",
            "## Tilings (whole layer, µs)",
            "",
            "| case | tiling | eager | graph |",
            "| --- | --- | ---: | ---: |",
        ]
        for t in report["tiling"]:
            lines.append(f"| {t['case']} | {t['tiling']} | {t['eager_us']:.1f} | {t['graph_us']:.1f} |")
    if report.get("layers_per_graph"):
        lines += [
            "",
            "## Decode target per layer of a multi-layer graph (informational; µs)",
            "",
            f"A tiny kernel's graph replay, timed the same way: {report.get('graph_floor_us', 0.0):.1f} µs.",
            "",
            "| case | tiling | layers per graph | graph per layer | frac (graph) |",
            "| --- | --- | ---: | ---: | ---: |",
        ]
        for t in report["layers_per_graph"]:
            row = (t["case"], t["tiling"], t["layers"], f"{t['graph_us']:.1f}", f"{t['copy_frac']:.3f}")
            lines.append("| " + " | ".join(map(str, row)) + " |")
    if report.get("gemm_lora"):
        lines += [
            "",
            "## Base GEMMs + LoRA op of one layer (graph replay, µs; ratio to the GEMMs alone)",
            "",
            "| case | mode | tiling | graph | / base only |",
            "| --- | --- | --- | ---: | ---: |",
        ]
        for t in report["gemm_lora"]:
            lines.append(
                f"| {t['case']} | {t['mode']} | {t['tiling']} | {t['graph_us']:.1f} | {t['over_base']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    decode = [r for r in report["results"] if r["case"]["phase"] == "decode"]
    for ranks in sorted({r["case"]["ranks"] for r in decode}):
        for d in sorted({r["case"]["adapters"] for r in decode}):
            pts = sorted(
                (r["case"]["rows"], r["layers"][LAYER]["graph_copy_frac"])
                for r in decode
                if r["case"]["ranks"] == ranks and r["case"]["adapters"] == d
            )
            if ranks == "16" and pts:
                ax1.plot(*zip(*pts, strict=True), marker="o", label=f"D={d}")
    ax1.axhline(0.5, color="grey", linestyle="--", linewidth=0.8)
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("decode rows M")
    ax1.set_ylabel("minimal bytes / time / copy bw")
    ax1.set_title("Decode, whole layer, r=16 (graph replay)")
    ax1.legend()
    labels, lora, base = [], [], []
    for r in report["results"]:
        if r["label"] in KEY_CASES or r["case"]["phase"] == "prefill":
            m = r["layers"][LAYER]
            labels.append(r["label"].replace("decode ", "").replace("prefill ", "P "))
            lora.append(m["graph_us"])
            base.append(m["base_graph_us"])
    xs = range(len(labels))
    ax2.bar([x - 0.2 for x in xs], lora, width=0.4, label="LoRA (shrink + expand)")
    ax2.bar([x + 0.2 for x in xs], base, width=0.4, label="base GEMM")
    ax2.set_xticks(list(xs), labels, rotation=30, ha="right", fontsize=8)
    ax2.set_ylabel("µs per layer (graph replay)")
    ax2.set_title("LoRA branch vs base GEMM, one layer")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(report: dict, out_dir: Path, plot_png: bool = True) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "kernels.json").write_text(json.dumps(report, indent=1))
    md = markdown(report)
    if plot_png and not plot(report, out_dir / "kernels.png"):
        md += "\n(no plot: matplotlib is not installed)\n"
    (out_dir / "kernels.md").write_text(md)

"""The report of `loraplex bench engine`: its summary table, markdown, bar plot and the files
written (engine.json, engine.md, engine.png, per-mode profile text)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loraplex.bench.plots import pyplot, save


def summary_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    def ratio(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    b = report["bytes"]
    floor_note = "" if report["floor_meaningful"] else " (not meaningful on CPU)"
    return [
        ("copy bandwidth (GB/s, read + written)", f"{report['copy_bw_GBps']:.1f} ({report['copy_bw_kind']})"),
        ("weight bytes per step (MB)", f"{b['weights'] / 1e6:.1f}"),
        ("KV bytes read per step (MB)", f"{b['kv_read'] / 1e6:.1f}"),
        ("LoRA bytes, distinct adapters (MB)", f"{b['lora'] / 1e6:.1f}"),
        (f"bandwidth floor (ms){floor_note}", ms(report["floor_ms"])),
        ("base-only step (ms)", ms(report["base_step_ms"])),
        ("LoRA step (ms)", ms(report["lora_step_ms"])),
        ("base-only step, one ahead (ms)", ms(report.get("base_loop_step_ms"))),
        ("LoRA step, one ahead (ms)", ms(report.get("lora_loop_step_ms"))),
        (f"base / floor{floor_note}", ratio(report["base_over_floor"])),
        ("LoRA / base (median of pairs)", ratio(report["lora_over_base"])),
        ("LoRA / base, pair range", _range(report.get("lora_over_base_range"))),
    ]


def _mode_words(a: dict[str, Any]) -> str:
    if a.get("device", "cuda") != "cuda":
        return "eager: CUDA graphs exist only on CUDA"
    if not a.get("graphs", True):
        return "eager, no CUDA graphs"
    return "CUDA-graph replays, LoRA ops beside the base GEMMs"


def _range(r: list[float] | None) -> str:
    return "-" if not r else f"{r[0]:.2f} - {r[1]:.2f}"


def markdown(report: dict[str, Any]) -> str:
    a = report["args"]
    m = report["model"]
    lines = [
        "# Engine decode-step benchmark",
        "",
        f"Device: {report['device']}; torch {report['torch']}; bf16 random weights, "
        f"{m['num_hidden_layers']} layers, hidden {m['hidden_size']}, vocab {m['vocab_size']}.",
        f"Batch {a['batch']}, context {a['context']}, {a['adapters']} distinct adapters of rank {a['rank']} "
        f"on all seven targets (round-robin); median of {a['steps']} timed decode steps of `Engine.step()`,"
        f" {a.get('repeats', 1)} alternating base-only / LoRA pairs"
        f' ({_mode_words(a)}), the stream synchronized before and after each; "one ahead":'
        f" {report.get('loop_steps', 20)} more steps of `Engine.step_overlapped()` back to back, as"
        " `LLM.generate` and the server run them.",
        "",
        "| quantity | value |",
        "| --- | ---: |",
    ]
    lines += [f"| {k} | {v} |" for k, v in summary_rows(report)]
    if not report["floor_meaningful"]:
        lines += [
            "",
            "On CPU no copy-bandwidth ceiling is measured: the floor uses a host memcpy and is no target.",
        ]
    lines += ["", "| target | measured | threshold | pass |", "| --- | ---: | ---: | :---: |"]
    for t in report["targets"]:
        value = "-" if t["value"] is None else f"{t['value']:.2f}"
        verdict = "-" if t["pass"] is None else ("yes" if t["pass"] else "NO")
        lines.append(f"| {t['name']} | {value} | <= {t['threshold']} | {verdict} |")
    lines += [
        "",
        f"Model build {report['build_s']:.1f} s; adapter registration (content hashing included) "
        f"{report['register_s']:.1f} s.",
    ]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    labels = ["floor", "base-only", "LoRA"]
    values = [report["floor_ms"], report["base_step_ms"], report["lora_step_ms"] or 0.0]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar(labels, values, color=["grey", "tab:blue", "tab:orange"])
    ax.set_ylabel("ms per decode step")
    title = f"batch {report['args']['batch']}, context {report['args']['context']}"
    ax.set_title(title if report["floor_meaningful"] else title + " (CPU: floor not meaningful)")
    return save(plt, fig, path)


def write_report(report: dict[str, Any], out_dir: Path, plot_png: bool = True) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for mode in ("base", "lora"):
        if report[mode] and report[mode].get("profile"):
            (out_dir / f"profile-{mode}.txt").write_text(report[mode]["profile"])
    (out_dir / "engine.json").write_text(json.dumps(report, indent=1))
    md = markdown(report)
    if plot_png and not plot(report, out_dir / "engine.png"):
        md += "\n(no plot: matplotlib is not installed)\n"
    (out_dir / "engine.md").write_text(md)

"""Reports of `bench capacity --sweep` (thrash.json/.md/.png) and `--load-latency`
(load_latency.json/.md): markdown tables and the thrash plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loraplex.bench.plots import pyplot


def _ms(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x * 1e3:.{digits}f}"


def thrash_markdown(report: dict[str, Any]) -> str:
    a = report["args"]
    lines = [
        "# Adapter cache thrash sweep",
        "",
        f"{a['shape']} random weights on {a['device']}, ranks {a['ranks']} on {','.join(a['targets'])}; "
        f"device room {report['device_room_bytes'] / (1 << 20):.1f} MiB "
        f"({report['room_in_largest_adapters']:.1f} adapters of the largest rank); closed loop "
        f"{a['concurrency']}, {a['requests']} requests per point (first {a['skip_fraction']:.0%} left "
        f"out), prompts {a['prompt_len']}, outputs {a['output_len']}.",
        "",
        "| adapters | popularity | output tok/s | P99 TTFT ms | device-hit P99 TTFT ms | device hits "
        "| loads | evictions | stalled | compiles / captures |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in report["points"]:
        lines.append(
            f"| {p['adapters']} | {p['popularity']} | {p['output_tokens_per_s']:.1f} "
            f"| {_ms(p['ttft_p99_s'])} | {_ms(p['device_hit_ttft_p99_s'])} "
            f"| {p['device_hit_requests']}/{p['requests']} "
            f"| {p['loads']} | {p['evictions']} | {p['stalled_requests']} "
            f"| {p.get('kernel_compiles', '-')} / {p.get('graph_captures', '-')} |"
        )
    onset = ", ".join(f"{pop}: {'none' if n is None else n}" for pop, n in report["thrash_onset"].items())
    lines += ["", f"Thrash onset (tokens/s below 90% of the smallest count's): {onset}.", ""]
    if "vs_all_resident" in report:
        lines += [
            "## Against all adapters resident (same run)",
            "",
            "| adapters | popularity | tok/s ratio | device-hit P99 TTFT ms | all-resident P99 TTFT ms "
            "| TTFT ratio | the same requests all-resident, P99 ms | TTFT ratio, same requests "
            "| step median ratio |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for r in report["vs_all_resident"]:
            ratio = r["device_hit_ttft_p99_ratio"]
            same = r.get("device_hit_ttft_p99_ratio_same_requests")
            steps = ", ".join(f"{k} {v:.3f}" for k, v in r.get("step_median_ratio", {}).items()) or "-"
            lines.append(
                f"| {r['adapters']} | {r['popularity']} | {r['output_tokens_per_s_ratio']:.3f} "
                f"| {_ms(r['device_hit_ttft_p99_s'])} | {_ms(r['all_resident_ttft_p99_s'])} "
                f"| {'-' if ratio is None else f'{ratio:.3f}'} "
                f"| {_ms(r.get('same_requests_all_resident_ttft_p99_s'))} "
                f"| {'-' if same is None else f'{same:.3f}'} | {steps} |"
            )
        lines.append("")
    return "\n".join(lines)


def thrash_plot(report: dict[str, Any], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    for pop in dict.fromkeys(p["popularity"] for p in report["points"]):
        mine = sorted((p for p in report["points"] if p["popularity"] == pop), key=lambda p: p["adapters"])
        xs = [p["adapters"] for p in mine]
        top.plot(xs, [p["output_tokens_per_s"] for p in mine], marker="o", label=pop)
        bottom.plot(xs, [(p["ttft_p99_s"] or 0.0) * 1e3 for p in mine], marker="o", label=pop)
    room = report["room_in_largest_adapters"]
    for ax in (top, bottom):
        ax.axvline(room, color="grey", linestyle=":", label="device room")
        ax.set_xscale("log")
    top.set_ylabel("output tokens/s")
    bottom.set_ylabel("P99 TTFT (ms)")
    bottom.set_xlabel("registered adapters")
    top.legend()
    top.set_title("adapter cache thrash sweep")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def load_markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Adapter load latency (host tier -> device pool, until a step may use the slot)",
        "",
        f"{report['shape']} shape, {report['dtype']} on {report['device']}, targets "
        f"{','.join(report['targets'])}; pinned host -> device bandwidth "
        f"{report['h2d_bytes_per_s'] / 1e9:.2f} GB/s ({report['bandwidth_copy_bytes'] >> 20} MiB copies, "
        f"median of {report['repeats']}).",
        "",
        f"Load: from the load request until a step could use the slot (copy complete, committed, "
        f"the kernels' tables pointing at it), {report.get('other_resident_adapters', 0)} other "
        f"adapters resident. Host: the CPU time of the load's calls"
        f"{' (the CPU memcpy left out)' if report.get('host_time_excludes_cpu_memcpy') else ''}.",
        "",
        "| rank | MiB | load median ms | load max ms | host median ms | bytes / bandwidth ms "
        "| ratio (target <= 1.5) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["per_rank"]:
        lines.append(
            f"| {r['rank']} | {r['bytes'] / (1 << 20):.1f} | {_ms(r['load_median_s'], 2)} "
            f"| {_ms(r['load_max_s'], 2)} | {_ms(r.get('host_median_s'), 3)} | {_ms(r['copy_bound_s'], 2)} "
            f"| {r['ratio']:.2f} |"
        )
    phased = [r for r in report["per_rank"] if r.get("phases_median_s")]
    if phased:
        lines += ["", "Where a load's time goes (medians, ms from the load request; copy: its GPU time):", ""]
        for r in phased:
            lines.append(
                f"- r={r['rank']}: "
                + ", ".join(
                    f"{k.removesuffix('_s').replace('_', ' ')} {v * 1e3:.3f}"
                    for k, v in r["phases_median_s"].items()
                )
            )
    return "\n".join([*lines, ""])


def write(report: dict[str, Any], out: Path, stem: str) -> list[str]:
    """Write `stem`.json and .md (and thrash.png for the sweep); returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    written = [f"{stem}.json", f"{stem}.md"]
    if stem == "thrash":
        md = thrash_markdown(report)
        if thrash_plot(report, out / "thrash.png"):
            written.append("thrash.png")
        else:
            md += "\n(no plot: matplotlib is not installed)\n"
    else:
        md = load_markdown(report)
    (out / f"{stem}.md").write_text(md)
    print(md)
    return written

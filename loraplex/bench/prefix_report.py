"""`bench prefix` results as JSON, a markdown table and a PNG (TTFT cold against warm)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loraplex.bench.plots import pyplot, save

RUNS = (
    ("cold_unshared", "cold, nothing shared (a salt per request)"),
    ("cold", "cold (empty cache, shared within the run)"),
    ("warm", "warm (system prompt cached)"),
    ("cache_off", "prefix cache off"),
)
STATS = ("p50", "p90", "p99", "mean")


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def _ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _runs(report: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(key, title, report["runs"][key]) for key, title in RUNS if key in report["runs"]]


def markdown(report: dict[str, Any]) -> str:
    a, m = report["args"], report["model"]
    lines = [
        "# bench prefix",
        "",
        f"{a['requests']} requests arriving together, each a shared {a['prefix_len']}-token system prompt "
        f"and a {a['suffix_len']}-token suffix of its own, on {a['num_adapters']} adapters (rank "
        f"{a['rank']}) in turn, {a['output_len']} greedy output tokens. Warm: the cold run's prompts "
        "again, after one request per adapter cached the system prompt.",
        "",
        f"model: {m['architecture']}, {m['layers']} layers, hidden {m['hidden_size']}, intermediate "
        f"{m['intermediate_size']}, {m['attention_heads']} heads / {m['kv_heads']} KV heads of "
        f"{m['head_dim']}, vocab {m['vocab_size']}, {m['dtype']}; block size {m['block_size']}, "
        f"{m['max_num_batched_tokens']} tokens per step",
        f"environment: {json.dumps(report['environment'])}",
    ]
    st, after, measured = report["startup"], report["after_startup"], report["measured_runs"]
    lines += [
        f"startup warm-up {st['warmup_s']:.1f} s ({st['kernel_compiles']} kernel compiles, "
        f"{st['graph_captures']} CUDA graphs); after it: {after['kernel_compiles']} compiles, "
        f"{after['graph_captures']} captures (rehearsal included), during the measured runs: "
        f"{measured['kernel_compiles']} compiles, {measured['graph_captures']} captures",
    ]
    if "cache_off_startup" in report:  # (its kernel compile count is the whole process's)
        off = report["cache_off_startup"]["warmup_s"]
        lines.append(f"second engine (no prefix cache): startup warm-up {off:.1f} s")
    lines += [
        "",
        "| run | TTFT p50 ms | p90 | p99 | mean | cached tokens per request mean (min - max) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for _, title, r in _runs(report):
        t, c = r["ttft_s"], r["cached_tokens"]
        lines.append(
            f"| {title} | {' | '.join(_ms(t[k]) for k in STATS)} "
            f"| {c['mean']:.1f} ({c['min']} - {c['max']}) |"
        )
    lines += ["", "| TTFT ratio | p50 | p90 | p99 | mean |", "| --- | ---: | ---: | ---: | ---: |"]
    for name, ratios in report["ratios"].items():
        lines.append(f"| {name.replace('_', ' ')} | {' | '.join(_ratio(ratios[k]) for k in STATS)} |")
    target = report["target"]
    limit = target["ttft_ratio_max"]
    lines += [
        "",
        f"target: TTFT warm / cold (nothing shared) <= {limit} at p50, p90, p99 and mean: "
        f"{verdict(target['ttft_ratio_pass'])}",
        f"TTFT warm / cold (shared within the run) <= {limit}: "
        f"{verdict(target['ttft_ratio_pass_vs_shared_cold'])}",
    ]
    if target.get("ttft_ratio_pass_vs_cache_off") is not None:
        lines.append(
            f"TTFT warm / prefix cache off <= {limit} at p50, p90, p99 and mean: "
            f"{verdict(target['ttft_ratio_pass_vs_cache_off'])}"
        )
    lines.append(f"identical greedy outputs warm and cold: {'yes' if target['identical_outputs'] else 'NO'}")
    ref = report.get("fp32_reference")
    if ref is not None:
        lines.append(
            f"warm and cold give the float32 reference's greedy token wherever its top-2 margin is >= "
            f"{ref['margin']} (while they share their context): {verdict(ref['pass'])}; "
            f"{ref['steps_checked']} steps checked of {ref['steps']} ({ref['steps_decided']} decided "
            f"by the reference), {len(ref['failures'])} failed"
        )
        for f in ref["failures"][:10]:
            lines.append(
                f"- request {f['index']} step {f['step']}: cold {f['cold']}, warm {f['warm']}, "
                f"float32 {f['reference']} (margin {f['margin']:.3f})"
            )
    if ref is not None and "by_run" in ref:
        lines += [
            "",
            "Each run against the float32 reference, while its context is the reference's (a run "
            "without prefix hits shows the floor of the engine's dtype alone):",
            "",
            "| run | steps checked | missed | fraction | largest reference margin missed |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for name, a in ref["by_run"].items():
            frac = "-" if a["missed_fraction"] is None else f"{a['missed_fraction']:.3f}"
            top = "-" if a["largest_margin_missed"] is None else f"{a['largest_margin_missed']:.3f}"
            lines.append(
                f"| {name.replace('_', ' ')} | {a['steps_checked']} | {a['missed']} | {frac} | {top} |"
            )
        lines.append("")
    for name, same in report["outputs"].items():
        lines.append(
            f"greedy tokens, {name.replace('_', ' ')}: "
            f"{same['identical']} of {same['requests']} requests identical"
        )
        for d in same["differences"][:10]:
            margin = "-" if d["margin"] is None else f"{d['margin']:.4f}"
            lines.append(
                f"- request {d['index']}: first differs at step {d['step']} (cold top-2 margin {margin})"
            )
    return "\n".join(lines) + "\n"


def verdict(passed: bool) -> str:
    return "PASS" if passed else "FAIL"


def plot(report: dict[str, Any], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, (cdf, bars) = plt.subplots(1, 2, figsize=(11, 4))
    runs = _runs(report)
    for _, title, r in runs:
        ms = sorted(q["ttft_s"] * 1e3 for q in r["requests"])
        cdf.step(ms, [(i + 1) / len(ms) for i in range(len(ms))], where="post", label=title)
    cdf.set_xlim(left=0)
    cdf.set_xlabel("TTFT (ms)")
    cdf.set_ylabel("fraction of requests")
    cdf.legend()
    width = 0.8 / len(runs)
    for offset, (_, title, r) in enumerate(runs):
        xs = [i + width * offset for i in range(len(STATS))]
        bars.bar(xs, [(r["ttft_s"][k] or 0.0) * 1e3 for k in STATS], width=width, label=title)
    bars.set_xticks([i + width * (len(runs) - 1) / 2 for i in range(len(STATS))], list(STATS))
    bars.set_ylabel("TTFT (ms)")
    bars.legend()
    ratio = report["ratios"]["warm_vs_cold_unshared"]["p50"]
    fig.suptitle(f"bench prefix: TTFT warm / cold (nothing shared) p50 {_ratio(ratio)}")
    return save(plt, fig, path)


def write_report(report: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "prefix.json").write_text(json.dumps(report, indent=1) + "\n")
    md = markdown(report)
    if not plot(report, out_dir / "prefix.png"):
        md += "\n(no plot: matplotlib is not installed)\n"
    (out_dir / "prefix.md").write_text(md)

"""`bench serve` results as JSON, a markdown table and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loraplex.bench.plots import pyplot, save


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def _worst(steps: dict[str, Any]) -> str:
    """The worst step against its kind and row bucket's median, and which step it was."""
    ratio = steps["max_over_median_same_kind_and_bucket"]
    w = steps.get("worst_step")  # absent in results written before it was recorded
    if ratio is None:
        return "-"
    if not w:
        return f"{ratio:.2f}"
    return (
        f"{ratio:.2f} (a {w['kind']} step of {w['rows']} rows, {w['decode_rows']} decoding, "
        f"{_ms(w['seconds'])} ms at {w['at_s']:.2f} s; its bucket of {w['bucket']} rows: "
        f"{w['bucket_steps']} steps, median {_ms(w['bucket_median_s'])} ms)"
    )


def _latency_rows(title: str, lat: dict[str, Any]) -> str:
    t, p, e = lat["ttft_s"], lat["tpot_s"], lat["e2e_s"]
    return (
        f"| {title} | {lat['requests']} | {_ms(t['p50'])} / {_ms(t['p99'])} "
        f"| {_ms(p['p50'])} / {_ms(p['p99'])} | {_ms(e['p50'])} / {_ms(e['p90'])} / {_ms(e['p99'])} |"
    )


def _runs(report: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    runs = [("with adapters", report["adapters"])]
    if "base_only" in report:
        runs.append(("base-only", report["base_only"]))
    if "http" in report:
        runs.append(("with adapters, over HTTP", report["http"]))
    runs += [(more["name"], more["run"]) for more in report.get("more_runs", ())]
    return runs


def markdown(report: dict[str, Any]) -> str:
    spec = report["workload"]["spec"]
    lines = [
        f"# bench serve ({report['mode']})",
        "",
        f"workload: {json.dumps(spec)}",
        f"environment: {json.dumps(report['environment'])}",
        "",
    ]
    runs = _runs(report)
    lines += ["| run | output tok/s | req/s | wall s |", "| --- | ---: | ---: | ---: |"]
    for name, r in runs:
        lines.append(
            f"| {name} | {r['output_tokens_per_s']:.1f} | {r['requests_per_s']:.2f} | {r['wall_s']:.2f} |"
        )
    if "hf_peft" in report:
        hf = report["hf_peft"]
        lines.append(
            f"| transformers + PEFT ({hf['settings']['dtype']}, static batches of {hf['settings']['batch']}, "
            f"the first {hf.get('requests', '?')} requests) "
            f"| {hf['output_tokens_per_s']:.1f} | - | {hf['wall_s']:.2f} |"
        )
    ratios = report.get("ratios", {})
    if "output_tokens_per_s_vs_base" in ratios:
        lines += [
            "",
            f"output tokens/s with adapters / base-only: {ratios['output_tokens_per_s_vs_base']:.3f}",
        ]
    if "base_only_vs_full_batch_decode" in ratios:
        full = report["base_only"]["steps"]["full_batch_decode"]
        lines += [
            "base-only output tokens/s / pure decode of a full batch "
            f"({full['output_tokens_per_s']:.1f} tok/s: max_num_seqs / the median of this run's "
            f"{full['count']} full decode steps): "
            f"{ratios['base_only_vs_full_batch_decode']:.3f}"
        ]
    if "base_only_vs_full_batch_decode_steady" in ratios:
        st = report["base_only"]["steady"]
        lines += [
            f"the same over the steady part ({st['from_s']:.1f}-{st['to_s']:.1f} s: from a quarter of the "
            f"requests done to the last arrival, {st['output_tokens_per_s']:.1f} tok/s): "
            f"{ratios['base_only_vs_full_batch_decode_steady']:.3f}"
        ]
        phases = report["base_only"].get("phases")
        if phases:
            lines.append(
                "base-only run by phase (seconds, tok/s, decode rows a step, seconds beyond the steady "
                "rate): "
                + "; ".join(
                    f"{name} {p['seconds']:.1f} s, {p['output_tokens_per_s'] or 0:.0f} tok/s, "
                    f"{p['decode_rows_per_step'] or 0:.1f} rows, {p['seconds_over_steady_rate'] or 0:+.2f} s"
                    for name, p in phases.items()
                )
            )
    if "base_only_decode_bound" in ratios:
        b = report["base_only"]["steps"]["decode_bound"]
        lines += [
            "what this run's own step costs allow against pure decode of a full batch (a prompt row "
            f"{b['prompt_row_s'] * 1e6:.1f} us over a {b['decode_step_s'] * 1e3:.2f} ms full decode step, "
            f"from {b['full_mixed_steps']} full mixed steps; "
            f"{b['prompt_rows_per_output_token']:.2f} prompt rows per output token; every step with a "
            f"full decode batch): {ratios['base_only_decode_bound']:.3f}"
        ]
    if "output_tokens_per_s_http_vs_in_process" in ratios:
        lines += [
            "output tokens/s over HTTP (streaming, the bench's own server process) / in-process: "
            f"{ratios['output_tokens_per_s_http_vs_in_process']:.3f}"
        ]
    if "output_tokens_per_s_vs_hf_peft" in ratios:
        lines += [
            "output tokens/s with adapters / transformers + PEFT: "
            f"{ratios['output_tokens_per_s_vs_hf_peft']:.2f}"
        ]
    if "output_tokens_per_s_vs_hf_peft_at_least" in ratios:
        hf = report["hf_peft"]
        lines += [
            f"transformers + PEFT stopped at its {hf['time_limit_s']:.0f} s limit inside the batch ending at "
            f"request {hf['requests_covered']} (step median {_ms(hf['step_s_median'])} ms, fastest "
            f"{_ms(hf['step_s_min'])} ms, first step {_ms(hf['first_step_s'][-1])} ms); the fastest it "
            f"could have finished those requests: {hf['output_tokens_per_s_upper_bound']:.1f} tok/s",
            "output tokens/s with adapters / transformers + PEFT, at least: "
            f"{ratios['output_tokens_per_s_vs_hf_peft_at_least']:.2f}",
        ]
    lines += [f"{name}: {value:.3f}" for name, value in ratios.items() if ":" in name]
    if "startup" in report:
        st, after = report["startup"], report.get("after_startup", {})
        lines += [
            f"startup warm-up {st['warmup_s']:.1f} s ({st['kernel_compiles']} kernel compiles, "
            f"{st['graph_captures']} CUDA graphs); after it, while serving: "
            f"{after.get('kernel_compiles', '-')} compiles, {after.get('graph_captures', '-')} captures"
        ]
    for name, r in runs:
        lines += [
            "",
            f"## {name}: latency in ms (TTFT p50 / p99, TPOT p50 / p99, end-to-end p50 / p90 / p99)",
            "",
            "| group | requests | TTFT | TPOT | end-to-end |",
            "| --- | ---: | ---: | ---: | ---: |",
            _latency_rows("all", r["latency"]),
        ]
        lines += [_latency_rows(f"popularity {k}", v) for k, v in r["by_popularity"].items()]
        lines += [_latency_rows(f"tenant {k}", v) for k, v in r["by_tenant"].items()]
        lat = r["latency"]
        lines += [
            "",
            "per-request split, p50 / p99 ms: queue "
            f"{_ms(lat['queue_s']['p50'])} / {_ms(lat['queue_s']['p99'])}, admission (adapter resolve) "
            f"{_ms(r['resolve_s']['p50'])} / {_ms(r['resolve_s']['p99'])}, admission to first token "
            f"{_ms(lat['prefill_s']['p50'])} / {_ms(lat['prefill_s']['p99'])}, decode "
            f"{_ms(lat['decode_s']['p50'])} / {_ms(lat['decode_s']['p99'])}",
        ]
        busy = (r.get("gpu_busy") or {}).get("fraction")
        if busy is not None:
            lines.append(
                f"GPU busy over the steady window ({r['gpu_busy']['window_s']:.2f} s, "
                f"{r['gpu_busy']['kernels']} kernels): {busy:.3f}"
            )
            kinds = r["gpu_busy"].get("by_kind") or {}
            if kinds:
                lines.append(
                    "kernel time over that window by kind (fraction of its wall time): "
                    + ", ".join(f"{k} {v:.3f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))
                )
        gcs = r.get("gc")
        if gcs is not None:
            p, paced = gcs["passes"], gcs["paced"]
            lines.append(
                f"Python GC passes during the run (generation 0 / 1 / 2): {p[0]} / {p[1]} / {p[2]}, "
                f"{sum(paced)} of them paced after a launch; longest {gcs['longest_s'] * 1e3:.1f} ms"
            )
        s = r["steps"]
        if s["count"]:
            kinds = ", ".join(
                f"{k} {v['count']} (median {_ms(v['median_s'])} ms)" for k, v in s["by_kind"].items()
            )
            replay = s["graph_replay_ratio"]
            lines += [
                "",
                f"steps: {s['count']}: {kinds}; worst step / median of its kind and row bucket: "
                f"{_worst(s)}; LoRA segments per step mean "
                f"{s['lora_segments_mean']:.2f}, max {s['lora_segments_max']}; batch occupancy "
                f"{s['batch_occupancy_mean']:.2f}; CUDA-graph replays of decode steps "
                f"{'-' if replay is None else f'{replay:.2f}'}",
            ]
            by_rows = s.get("mixed_full_batch_by_rows") or {}
            full = s["full_batch_decode"]["median_s"]
            if by_rows and full:
                lines.append(
                    "mixed steps beside a full decode batch, median ms by rows (rounded up to 64): "
                    + ", ".join(f"{r}: {v['median_s'] * 1e3:.2f}" for r, v in by_rows.items())
                    + f"; full decode step {full * 1e3:.2f}"
                )
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    runs = _runs(report)
    names = [n for n, _ in runs]
    axes[0].bar(names, [r["output_tokens_per_s"] for _, r in runs])
    axes[0].set_ylabel("output tokens/s")
    classes = sorted(report["adapters"]["by_popularity"])
    width = 0.8 / len(runs)
    for offset, (name, r) in enumerate(runs):
        vals = [(r["by_popularity"].get(c) or {}).get("ttft_s", {}).get("p99") or 0.0 for c in classes]
        xs = [i + width * offset for i in range(len(classes))]
        axes[1].bar(xs, [v * 1e3 for v in vals], width=width, label=name)
    axes[1].set_xticks([i + width * (len(runs) - 1) / 2 for i in range(len(classes))], classes)
    axes[1].set_ylabel("P99 TTFT (ms)")
    axes[1].legend()
    fig.suptitle(f"bench serve ({report['mode']})")
    return save(plt, fig, path)


def write_report(report: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "serve.json").write_text(json.dumps(report, indent=1) + "\n")
    (out_dir / "serve.md").write_text(markdown(report))
    plot(report, out_dir / "serve.png")

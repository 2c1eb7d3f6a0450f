"""What a simulated run reports (bench/simulate.py): per-tenant service share, TTFT by adapter
popularity class, LoRA segments per step, starvation and deadline misses; and the comparison of
policies on one workload as one markdown table and one PNG."""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from loraplex.bench.plots import pyplot
from loraplex.bench.serve_metrics import percentiles
from loraplex.bench.simulate import SimRequest, SimRun


def summarize(run: SimRun, starvation_s: float) -> dict[str, Any]:
    """`starvation_s`: a request starves when its first token comes later than this after its
    arrival (or never); it is counted whatever its deadline."""
    reqs = run.requests
    done = [q for q in reqs if q.first_token_s is not None]
    total_rows = sum(run.served_rows.values()) or 1
    open_rows = sum(run.served_rows_open.values()) or 1
    by_tenant: dict[str, list[SimRequest]] = defaultdict(list)
    by_class: dict[str, list[SimRequest]] = defaultdict(list)
    for q in reqs:
        by_tenant[q.tenant].append(q)
        by_class[q.popularity].append(q)
    segments = [s.shape.segments for s in run.steps]
    kinds: dict[str, int] = defaultdict(int)
    for s in run.steps:
        kinds[s.shape.kind] += 1
    return {
        "policy": run.policy,
        "wall_s": run.wall_s,
        "runtime_s": run.runtime_s,
        "requests": len(reqs),
        "output_tokens_per_s": sum(q.output_len for q in reqs if q.finish_s is not None) / run.wall_s,
        "ttft_s": percentiles([q.ttft for q in done]),
        "by_popularity": {k: _latency(v) for k, v in sorted(by_class.items())},
        "by_tenant": {
            t: {
                **_latency(v),
                "service_share": run.served_rows.get(t, 0) / total_rows,
                # while requests still arrive: what a flood takes from the others before the drain
                "service_share_open": run.served_rows_open.get(t, 0) / open_rows,
            }
            for t, v in sorted(by_tenant.items())
        },
        "starved": sum(1 for q in reqs if q.first_token_s is None or q.ttft > starvation_s),
        "starvation_s": starvation_s,
        "deadline_misses": sum(1 for q in reqs if _missed(q)),
        "with_deadline": sum(1 for q in reqs if q.deadline_s is not None),
        "steps": {
            "count": len(run.steps),
            "by_kind": dict(sorted(kinds.items())),
            "segments_mean": statistics.fmean(segments) if segments else 0.0,
            "segments_p50": statistics.median(segments) if segments else 0,
            "segments_max": max(segments, default=0),
        },
        "adapter_loads": run.loads,
        "preemptions": run.preemptions,
    }


def _missed(q: SimRequest) -> bool:
    return q.deadline_s is not None and (q.first_token_s is None or q.ttft > q.deadline_s)


def _latency(reqs: list[SimRequest]) -> dict[str, Any]:
    ttft = percentiles([q.ttft for q in reqs if q.first_token_s is not None])
    return {"requests": len(reqs), "ttft_p50_s": ttft["p50"], "ttft_p99_s": ttft["p99"]}


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def markdown(report: dict[str, Any]) -> str:
    policies: list[dict[str, Any]] = report["policies"]
    classes = sorted({c for p in policies for c in p["by_popularity"]})
    tenants = sorted({t for p in policies for t in p["by_tenant"]})
    lines = [
        "# bench simulate",
        "",
        f"workload: {report['workload']}",
        f"engine: {report['engine']}",
        f"step costs: {report['cost']['source']}",
        "",
        "| policy | tok/s | TTFT p50 / p99 ms | "
        + " | ".join(f"{c} TTFT p50 / p99" for c in classes)
        + " | segments/step mean (max) | starved | deadline misses | "
        + " | ".join(f"share {t}" for t in tenants)
        + " | sim s |",
        "| --- | ---: | ---: | " + " | ".join("---:" for _ in classes) + " | ---: | ---: | ---: | "
        + " | ".join("---:" for _ in tenants) + " | ---: |",
    ]  # fmt: skip
    for p in policies:
        by_class = p["by_popularity"]
        cells = [
            p["policy"],
            f"{p['output_tokens_per_s']:.0f}",
            f"{_ms(p['ttft_s']['p50'])} / {_ms(p['ttft_s']['p99'])}",
            *(
                f"{_ms(by_class[c]['ttft_p50_s'])} / {_ms(by_class[c]['ttft_p99_s'])}"
                if c in by_class
                else "-"
                for c in classes
            ),
            f"{p['steps']['segments_mean']:.1f} ({p['steps']['segments_max']})",
            f"{p['starved']} (> {p['starvation_s']:g} s)",
            f"{p['deadline_misses']} / {p['with_deadline']}",
            *(f"{p['by_tenant'][t]['service_share']:.3f}" if t in p["by_tenant"] else "-" for t in tenants),
            f"{p['runtime_s']:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "sim s: real seconds the simulation took. share: rows computed for the tenant / all rows."]
    if report.get("fit_check"):
        lines += ["", "## step-cost model: predicted against measured", ""]
        lines += ["| run | quantity | measured | predicted | error |", "| --- | --- | ---: | ---: | ---: |"]
        for row in report["fit_check"]:
            for name, v in row.items():
                if name != "run" and v["error"] is not None:
                    values = f"{v['measured']:.4g} | {v['predicted']:.4g} | {v['error']:+.1%}"
                    lines.append(f"| {row['run']} | {name} | {values} |")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> bool:
    """TTFT p50/p99 by popularity class, segments per step and tenant shares, one bar group per
    policy; False when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    policies = report["policies"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    classes = sorted({c for p in policies for c in p["by_popularity"]})
    width = 0.8 / max(1, len(policies))
    for i, p in enumerate(policies):
        xs = [k + i * width for k in range(len(classes))]
        p99 = [(p["by_popularity"].get(c, {}).get("ttft_p99_s") or 0) * 1e3 for c in classes]
        p50 = [(p["by_popularity"].get(c, {}).get("ttft_p50_s") or 0) * 1e3 for c in classes]
        axes[0].bar(xs, p99, width, label=f"{p['policy']} p99", alpha=0.5)
        axes[0].bar(xs, p50, width, label=f"{p['policy']} p50")
    axes[0].set_xticks([k + 0.4 - width / 2 for k in range(len(classes))], classes)
    axes[0].set_ylabel("TTFT ms")
    axes[0].set_title("TTFT by adapter popularity")
    axes[0].legend(fontsize=7)
    names = [p["policy"] for p in policies]
    axes[1].bar(names, [p["steps"]["segments_mean"] for p in policies])
    axes[1].set_title("LoRA segments per step (mean)")
    tenants = sorted({t for p in policies for t in p["by_tenant"]})
    for i, p in enumerate(policies):
        xs = [k + i * width for k in range(len(tenants))]
        axes[2].bar(
            xs, [p["by_tenant"].get(t, {}).get("service_share", 0) for t in tenants], width, label=p["policy"]
        )
    axes[2].set_xticks([k + 0.4 - width / 2 for k in range(len(tenants))], tenants)
    axes[2].set_title("service share per tenant")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True

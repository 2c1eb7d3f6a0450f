"""The simulator's step-cost model: what one engine step costs on the device, from the shape the
real scheduler planned (bench/simulate.py), and what an adapter load costs by the tier it comes
from.

    step = fixed(pure decode step | step with prefill)
         + prefill_token_s x prefill rows + decode_row_s x decode rows
         + lora_row_s x rows on an adapter + segment_s x distinct adapters in the step
    then gap_s of host time before the next step (the serving loop, deltas, arrivals)

Why these terms: a pure decode step replays a decode graph; a step carrying prefill ran eagerly
(host-bound launches) in the engine of the first fit, and replays a token-bucket graph since
(docs/cuda-graphs.md), so its fixed part has its own coefficient (`eager_step_s`, named after
the first); prefill rows are compute-bound, decode rows mostly KV reads; the LoRA kernels do
per-row work plus per-segment work (one adapter's weights read per segment). The fixed and
per-row coefficients come from `bench serve` results (bench/sim_fit.py); the load costs from the
load-latency measurement (docs/results/load-latency-h200-2026-12-01-claimed-slot.md), since serve
runs keep every adapter resident and so measure no load. Where the serving loop runs one step
ahead (SimConfig.one_ahead, as the engine's serving loops do), a step's host work overlaps the
step before it on the device: bench serve's step time holds it, and gap_s is 0.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any


@dataclass(frozen=True)
class StepShape:
    """What the scheduler planned for one step, in the terms the cost model prices."""

    prefill_rows: int  # rows of chunks that are not single decode rows (prompt or recomputation)
    decode_rows: int
    lora_rows: int  # rows of sequences on an adapter
    segments: int  # distinct adapters in the step (base rows are no segment)
    sequences: int
    graph: bool  # a pure decode step small enough to replay a decode graph (else: fixed part eager_step_s)

    @property
    def rows(self) -> int:
        return self.prefill_rows + self.decode_rows

    @property
    def kind(self) -> str:
        """As `bench serve` names steps (serve_metrics.StepRecord.kind)."""
        if self.prefill_rows == 0:
            return "decode"
        return "prefill" if self.decode_rows == 0 else "mixed"


# The coefficients a fit sets, in the order of the fit's unknowns (gap_s is measured directly).
FITTED: tuple[str, ...] = (
    "graph_step_s",
    "eager_step_s",
    "prefill_token_s",
    "decode_row_s",
    "lora_row_s",
    "segment_s",
)


@dataclass(frozen=True)
class StepCost:
    graph_step_s: float  # fixed part of a graph-replayed decode step
    eager_step_s: float  # fixed part of a step with prefill (eager before mixed-step graphs, a replay since)
    prefill_token_s: float
    decode_row_s: float
    lora_row_s: float
    segment_s: float
    gap_s: float  # host time between two steps
    host_load_s: float  # one adapter, host memory -> device slot
    disk_load_s: float  # one adapter, disk -> device slot (through host memory)
    source: str = ""  # where the numbers come from
    # Steps with prefill priced by measurement instead (`with_measured_steps`): (rows rounded up
    # to 64, median seconds, mean decode rows beside) per row count measured; empty: the terms above.
    mixed_by_rows: tuple[tuple[int, float, float], ...] = ()

    def seconds(self, s: StepShape) -> float:
        lora = self.lora_row_s * s.lora_rows + self.segment_s * s.segments
        if s.prefill_rows and self.mixed_by_rows:
            return self._measured_mixed(s) + lora
        return (
            (self.graph_step_s if s.graph else self.eager_step_s)
            + self.prefill_token_s * s.prefill_rows
            + self.decode_row_s * s.decode_rows
            + lora
        )

    def _measured_mixed(self, s: StepShape) -> float:
        """The measured median at the step's rows rounded up to 64 (linear between measured row
        counts, and past either end along the nearest two, or `prefill_token_s` from a single
        one), less the decode rows the step has fewer than the measured steps had."""
        rows = -(-s.rows // 64) * 64
        pts = sorted(self.mixed_by_rows)
        if len(pts) == 1:
            r0, t0, d0 = pts[0]
            t = t0 + self.prefill_token_s * (rows - r0)
            return t - self.decode_row_s * (d0 - s.decode_rows)
        i = next((k for k, p in enumerate(pts) if p[0] >= rows), len(pts))
        lo, hi = pts[max(0, min(i, len(pts) - 1) - 1)], pts[max(1, min(i, len(pts) - 1))]
        frac = (rows - lo[0]) / (hi[0] - lo[0])
        t = lo[1] + frac * (hi[1] - lo[1])
        beside = lo[2] + frac * (hi[2] - lo[2])
        return t - self.decode_row_s * (beside - s.decode_rows)

    def features(self, s: StepShape) -> list[float]:
        """The step's row of the fit's linear system: seconds = features . FITTED coefficients."""
        return [
            float(s.graph),
            float(not s.graph),
            float(s.prefill_rows),
            float(s.decode_rows),
            float(s.lora_rows),
            float(s.segments),
        ]

    def with_fitted(self, values: list[float], source: str) -> StepCost:
        fitted: dict[str, Any] = dict(zip(FITTED, values, strict=True))
        return replace(self, **fitted, source=source)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> StepCost:
        names = {f.name for f in fields(cls)}
        given = {k: v for k, v in raw.items() if k in names}
        given["mixed_by_rows"] = tuple(tuple(p) for p in given.get("mixed_by_rows", ()))
        return cls(**given)


def with_measured_steps(cost: StepCost, steps: dict[str, Any], max_num_seqs: int, source: str) -> StepCost:
    """`cost` with steps that carry prefill priced by a `bench serve` run's measured mixed steps
    (its `steps` summary: `mixed_full_batch_by_rows`, with the full decode step as the point
    without prompt rows) and pure decode steps by its full decode step's median (the fixed part
    set so that a full batch costs that). On the H200 the issue
    workload priced this way came within 0.006 of the measured runs' output rate, where the
    linear fit was 0.02 high (docs/bench.md)."""
    table = steps.get("mixed_full_batch_by_rows") or {}
    full = (steps.get("full_batch_decode") or {}).get("median_s")
    if not table or not full:
        raise ValueError("the run has no mixed steps beside a full decode batch, or no full decode step")
    measured = {int(r): (float(v["median_s"]), float(v["decode_rows_mean"])) for r, v in table.items()}
    # the full decode step as the point without prompt rows, below the smallest mixed step
    measured.setdefault(-(-max_num_seqs // 64) * 64, (float(full), float(max_num_seqs)))
    points = tuple(sorted((r, t, d) for r, (t, d) in measured.items()))
    graph = max(0.0, full - cost.decode_row_s * max_num_seqs)
    return replace(cost, mixed_by_rows=points, graph_step_s=graph, source=source)


# Priors of the fit (where the serve results leave a direction unmeasured, the fit stays near
# them) and the load costs. Sources: engine-h200.json (decode step at batch 64: 8.65 ms base,
# 10.15 ms with 32 adapters), docs/bench.md (an eager step is host-bound: tens of ms of wall for
# a third of it in kernels; a prior from before mixed-step graphs, which a fit to one token budget
# stays near: docs/bench.md, bench simulate), load-latency-h200-2026-12-01-claimed-slot.md (r=16,
# host -> device until a step may use the slot, 1.97 ms). The disk load is an assumption
# (safetensors read at ~2 GB/s plus the host copy), not a measurement.
PRIOR = StepCost(
    graph_step_s=6e-3,
    eager_step_s=15e-3,
    prefill_token_s=12e-6,
    decode_row_s=50e-6,
    lora_row_s=5e-6,
    segment_s=0.1e-3,
    gap_s=1.5e-3,
    host_load_s=1.97e-3,
    disk_load_s=45e-3,
    source="priors (sim_cost.PRIOR)",
)

# The fit to docs/results/serve-h200-2026-12-02.json and serve-h200-2026-12-02-budget512.json
# (the engine with mixed-step graphs and its serving loop one step ahead; Llama-3-8B-shaped bf16,
# 64 sequences, 32 r=16 adapters; 2048-token steps with admission batching, and 512-token steps
# without: the two budgets are what separates a prefill step's fixed part from its rows), both
# runs of each, by `loraplex bench simulate --fit` (sim_fit.fit), rounded; the simulator's
# default. docs/bench.md has predicted against measured, and the checks on runs held back.
H200 = replace(
    PRIOR,
    graph_step_s=4.38e-3,
    eager_step_s=2.43e-3,
    prefill_token_s=21.72e-6,
    decode_row_s=36.82e-6,
    lora_row_s=3.84e-6,
    segment_s=0.0433e-3,
    gap_s=0.0,
    source="fitted to docs/results/serve-h200-2026-12-02.json and serve-h200-2026-12-02-budget512.json "
    "(adapters, base_only)",
)

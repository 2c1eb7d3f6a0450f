"""Per-request timings and per-step records of a serving run, and their summary: throughput,
TTFT / TPOT / end-to-end percentiles overall, per popularity class and per tenant, and what the
steps looked like (kinds, rows, adapters, CUDA-graph replays, outliers)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import astuple, dataclass, fields
from typing import Any


@dataclass
class RequestTiming:
    index: int
    tenant: str
    popularity: str  # base | hot | cold
    arrival_s: float  # when the request arrived (seconds from the run's start)
    admitted_s: float | None = None  # when the engine took it
    resolve_s: float = 0.0  # admission itself: adapter resolution and hold
    first_token_s: float | None = None
    finish_s: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    tier: str | None = None  # the adapter's residency tier at arrival (device/host/disk/base), if known

    @property
    def ttft(self) -> float:
        assert self.first_token_s is not None
        return self.first_token_s - self.arrival_s

    @property
    def e2e(self) -> float:
        assert self.finish_s is not None
        return self.finish_s - self.arrival_s

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2 or self.finish_s is None or self.first_token_s is None:
            return None
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)

    @property
    def queue(self) -> float:
        """Arrival to admission by the engine (over HTTP: to the request being sent)."""
        return (self.admitted_s or self.arrival_s) - self.arrival_s

    @property
    def prefill(self) -> float:
        """Admission to the first token: waiting for a batch slot, the prompt's chunks, the first
        sample. (No adapter loads yet: every registered adapter is resident.)"""
        assert self.first_token_s is not None
        return self.first_token_s - (self.admitted_s or self.arrival_s)

    @property
    def decode(self) -> float:
        assert self.finish_s is not None and self.first_token_s is not None
        return self.finish_s - self.first_token_s


@dataclass(frozen=True)
class StepRecord:
    start_s: float
    seconds: float
    rows: int
    decode_rows: int
    lora_segments: int
    sequences: int
    graph_replay: bool

    @property
    def kind(self) -> str:
        return (
            "decode" if self.decode_rows == self.rows else ("prefill" if self.decode_rows == 0 else "mixed")
        )

    @property
    def bucket(self) -> int:
        """Rows rounded up to a power of two."""
        return 1 << max(0, (self.rows - 1).bit_length())


def worst_step(steps: list[StepRecord]) -> dict[str, Any] | None:
    """The step longest against the median of its kind and row bucket (buckets of at least 3
    steps), and where it ran: its kind, rows, bucket, seconds, that median and count, its index
    and start (seconds from the first step). None without such a bucket."""
    buckets: dict[tuple[str, int], list[float]] = defaultdict(list)
    for s in steps:
        buckets[(s.kind, s.bucket)].append(s.seconds)
    medians = {k: statistics.median(v) for k, v in buckets.items() if len(v) >= 3}
    best: tuple[float, int] | None = None
    for i, s in enumerate(steps):
        median = medians.get((s.kind, s.bucket))
        if median and (best is None or s.seconds / median > best[0]):
            best = (s.seconds / median, i)
    if best is None:
        return None
    ratio, i = best
    s = steps[i]
    key = (s.kind, s.bucket)
    return {
        "over_median": ratio,
        "kind": s.kind,
        "rows": s.rows,
        "decode_rows": s.decode_rows,
        "bucket": s.bucket,
        "seconds": s.seconds,
        "bucket_median_s": medians[key],
        "bucket_steps": len(buckets[key]),
        "index": i,
        "at_s": s.start_s - steps[0].start_s,
    }


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "mean": statistics.fmean(ordered)}


def _latencies(timings: list[RequestTiming]) -> dict[str, Any]:
    return {
        "requests": len(timings),
        "ttft_s": percentiles([t.ttft for t in timings]),
        "tpot_s": percentiles([x for t in timings if (x := t.tpot) is not None]),
        "e2e_s": percentiles([t.e2e for t in timings]),
        "queue_s": percentiles([t.queue for t in timings]),
        "prefill_s": percentiles([t.prefill for t in timings]),
        "decode_s": percentiles([t.decode for t in timings]),
    }


def steady_window(timings: list[RequestTiming], steps: list[StepRecord]) -> dict[str, Any] | None:
    """Output tokens/s over the run's steady part: from when a quarter of the requests have
    finished to the last arrival. A finite run starts with every closed-loop slot's prompt at once
    and ends draining a batch nobody refills; the whole-run rate holds both, this one neither.
    Tokens counted: the decode rows of the steps launched in the window plus the first tokens
    sampled in it. None when the window is empty (too few requests, or no step records)."""
    finished = sorted(t.finish_s for t in timings if t.finish_s is not None)
    if not finished or not steps:
        return None
    lo = finished[len(finished) // 4]
    hi = max(t.arrival_s for t in timings)
    if hi <= lo:
        return None
    tokens = sum(s.decode_rows for s in steps if lo <= s.start_s < hi)
    tokens += sum(1 for t in timings if t.first_token_s is not None and lo <= t.first_token_s < hi)
    return {"from_s": lo, "to_s": hi, "output_tokens": tokens, "output_tokens_per_s": tokens / (hi - lo)}


def run_phases(
    timings: list[RequestTiming], steps: list[StepRecord], steady: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The run cut at the edges of its steady window (`steady_window`'s result): the start (every
    slot's first prompt at once), the steady part, the drain. Per phase: seconds, output tokens
    (counted as the steady window counts them), tokens/s, mean decode rows a step, and the seconds
    it takes beyond what its tokens would at the steady rate: where a whole-run rate loses against
    the steady one."""
    finished = [t.finish_s for t in timings if t.finish_s is not None]
    if steady is None or not finished:
        return None
    rate = steady["output_tokens_per_s"]
    begin, end = min(t.arrival_s for t in timings), max(finished)
    phases: dict[str, Any] = {}
    for name, lo, hi in (
        ("start", begin, steady["from_s"]),
        ("steady", steady["from_s"], steady["to_s"]),
        ("drain", steady["to_s"], end),
    ):
        inside = [x for x in steps if lo <= x.start_s < hi]
        tokens = sum(x.decode_rows for x in inside)
        tokens += sum(1 for t in timings if t.first_token_s is not None and lo <= t.first_token_s < hi)
        seconds = max(hi - lo, 0.0)
        phases[name] = {
            "seconds": seconds,
            "output_tokens": tokens,
            "output_tokens_per_s": tokens / seconds if seconds > 0 else None,
            "decode_rows_per_step": statistics.fmean(x.decode_rows for x in inside) if inside else None,
            "seconds_over_steady_rate": seconds - tokens / rate if rate > 0 else None,
        }
    return phases


def step_records(steps: list[StepRecord]) -> dict[str, Any]:
    """Every step's record as rows of numbers under their field names (`bench serve --step-records`)."""
    return {"fields": [f.name for f in fields(StepRecord)], "rows": [list(astuple(s)) for s in steps]}


def mixed_by_rows(steps: list[StepRecord], max_num_seqs: int) -> dict[str, dict[str, Any]]:
    """The mixed steps beside a nearly full decode batch (at most an eighth short), by rows rounded
    up to a multiple of 64: their count, median seconds and mean decode rows. Against the full
    decode step's median, what prompt rows cost at each step size (and the simulator's price of a
    step with prefill: sim_cost.with_measured_steps)."""
    near_full = max_num_seqs - max_num_seqs // 8
    by: dict[int, list[StepRecord]] = defaultdict(list)
    for s in steps:
        if s.kind == "mixed" and s.decode_rows >= near_full:
            by[-(-s.rows // 64) * 64].append(s)
    return {
        str(r): {
            "count": len(v),
            "median_s": statistics.median(s.seconds for s in v),
            "decode_rows_mean": statistics.fmean(s.decode_rows for s in v),
        }
        for r, v in sorted(by.items())
    }


def full_decode_steps(steps: list[StepRecord], max_num_seqs: int) -> list[float]:
    """Seconds of the pure decode steps of a full batch: the speed the engine would give if no
    prompt ever arrived, which the output rate with prefill is compared against."""
    return [s.seconds for s in steps if s.kind == "decode" and s.rows == max_num_seqs]


def decode_bound(
    steps: list[StepRecord], output_tokens: int, max_num_seqs: int, step_budget: int
) -> dict[str, Any] | None:
    """The most output tokens/s, as a fraction of pure decode of a full batch, that this run's own
    step costs allow for its prompt tokens: each prompt row costs what the run's full mixed steps
    (at the step budget) pay per prompt row over a full decode step, and every step carries a full
    batch of decode rows, so no output is lost to a partly empty batch. Linear in prompt rows, which
    the GEMMs roughly are between one decode batch and the budget. What the run reaches against it
    is the scheduler's share of the gap; the rest is the kernels'. None without both kinds of step."""
    full = full_decode_steps(steps, max_num_seqs)
    mixed = [s for s in steps if s.kind == "mixed" and s.rows == step_budget]
    prompt_rows = sum(s.rows - s.decode_rows for s in steps)
    if not full or not mixed or output_tokens == 0:
        return None
    decode_s = statistics.median(full)
    # (never below 0: a mixed step cheaper than a decode step is noise, e.g. on a busy CPU)
    per_row_s = max(0.0, statistics.median((s.seconds - decode_s) / (s.rows - s.decode_rows) for s in mixed))
    per_token = prompt_rows / output_tokens  # prompt rows computed per output token
    room = step_budget - max_num_seqs  # prompt rows a step has beside a full decode batch
    need = max_num_seqs * per_token  # prompt rows per full batch of output tokens
    # per full batch of output tokens: one decode step plus its prompt rows, or, when they exceed a
    # step's room, as many full mixed steps as they fill
    per_batch_s = max(decode_s + per_row_s * need, (decode_s + per_row_s * room) * need / room)
    return {
        "decode_step_s": decode_s,
        "prompt_row_s": per_row_s,
        "prompt_rows_per_output_token": per_token,
        "full_mixed_steps": len(mixed),
        "fraction_of_full_batch_decode": decode_s / per_batch_s,
    }


def summarize(
    timings: list[RequestTiming],
    steps: list[StepRecord],
    wall_s: float,
    max_num_seqs: int,
    step_budget: int | None = None,
) -> dict[str, Any]:
    output = sum(t.output_tokens for t in timings)
    by_class: dict[str, list[RequestTiming]] = defaultdict(list)
    by_tenant: dict[str, list[RequestTiming]] = defaultdict(list)
    by_tier: dict[str, list[RequestTiming]] = defaultdict(list)
    for t in timings:
        by_class[t.popularity].append(t)
        by_tenant[t.tenant].append(t)
        if t.tier is not None:
            by_tier[t.tier].append(t)
    kinds: dict[str, list[StepRecord]] = defaultdict(list)
    for s in steps:
        kinds[s.kind].append(s)
    # The worst step against the median of steps of its own kind and row bucket: a step that
    # compiles or captures mid-traffic stands out here.
    worst = worst_step(steps)
    outlier = None if worst is None else worst["over_median"]
    decode = [s for s in steps if s.kind == "decode"]
    full = full_decode_steps(steps, max_num_seqs)
    full_median = statistics.median(full) if full else None
    steady = steady_window(timings, steps)
    return {
        "wall_s": wall_s,
        "output_tokens": output,
        "output_tokens_per_s": output / wall_s if wall_s > 0 else 0.0,
        "steady": steady,
        "phases": run_phases(timings, steps, steady),
        "requests_per_s": len(timings) / wall_s if wall_s > 0 else 0.0,
        "latency": _latencies(timings),
        "by_popularity": {k: _latencies(v) for k, v in sorted(by_class.items())},
        "by_tenant": {k: _latencies(v) for k, v in sorted(by_tenant.items())},
        "by_tier": {k: _latencies(v) for k, v in sorted(by_tier.items())},
        "resolve_s": percentiles([t.resolve_s for t in timings]),
        "steps": {
            "count": len(steps),
            "seconds": sum(s.seconds for s in steps),
            "busy_fraction_host_view": sum(s.seconds for s in steps) / wall_s if wall_s > 0 else 0.0,
            "by_kind": {
                k: {"count": len(v), "median_s": statistics.median(s.seconds for s in v)}
                for k, v in sorted(kinds.items())
            },
            "max_over_median_same_kind_and_bucket": outlier,
            "worst_step": worst,  # which step that is: kind, rows, when, its bucket's median and size
            "lora_segments_mean": statistics.fmean(s.lora_segments for s in steps) if steps else 0.0,
            "lora_segments_max": max((s.lora_segments for s in steps), default=0),
            "batch_occupancy_mean": statistics.fmean(s.sequences for s in steps) / max_num_seqs
            if steps
            else 0.0,
            "graph_replay_ratio": (sum(s.graph_replay for s in decode) / len(decode)) if decode else None,
            "full_batch_decode": {
                "count": len(full),
                "median_s": full_median,
                "output_tokens_per_s": max_num_seqs / full_median if full_median else None,
            },
            "mixed_full_batch_by_rows": mixed_by_rows(steps, max_num_seqs),
            # what these step costs allow against that (None: no budget given, or too few steps)
            "decode_bound": decode_bound(steps, output, max_num_seqs, step_budget) if step_budget else None,
        },
    }

"""`loraplex bench serve`: a serving workload (bench/workloads.py) replayed against the real engine
in-process, or against a running server over HTTP, with the latencies users judge an engine by.

In-process, requests arrive as the workload says (a closed loop keeps C in flight; open-loop
arrivals are added when their time comes) and the engine steps in between; every step's kind,
rows, adapters and duration are recorded. The same workload base-only runs in the same process,
so the report states the ratio. Over HTTP (`--url`), streaming completions with token-id
prompts go to the server's adapters (the k-th adapter the server lists serves adapter index k,
wrapping round). With `--http-compare` the same workload also runs over HTTP against a server on
the same engine that the bench starts in a process of its own (bench/serve_server.py), and the
report states HTTP / in-process output tokens/s.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraplex.bench.gc_watch import GcWatch
from loraplex.bench.gpu_busy import BusyWindow
from loraplex.bench.serve_metrics import RequestTiming, StepRecord, step_records, summarize
from loraplex.bench.serve_model import ServeBenchArgs, build_engine, prompt_ids
from loraplex.bench.serve_more import budget_sweep, more_runs
from loraplex.bench.workloads import Workload, WorkloadRequest, generate

if TYPE_CHECKING:
    from loraplex.types import RequestOutput

BUSY_STEPS = 64
# The GPU busy fraction comes from a replay of the workload's first requests with the profiler on
# (`busy_of`), not from the measured run: starting the profiler, and stopping it, which parses
# every kernel record (tens of thousands in a 64-step window), stalls every request in flight for
# up to seconds. Inside the measured run that stall went into its wall time (more for the run with
# more kernels, the one with adapters) and into the latency tail.
BUSY_REQUESTS = 320
_RUNS = itertools.count()  # numbers each run's own prefix-cache salt


@dataclass
class Replay:
    """How `run_in_process` makes and keeps requests, beyond the workload's own fields."""

    # A request's prompt (default: its text, else random token ids from the workload's seed).
    prompt_of: Callable[[WorkloadRequest], str | list[int]] | None = None
    # every request's prefix-cache salt, or each request's own (a function of the request)
    cache_salt: str | Callable[[WorkloadRequest], str] | None = None
    logprobs: int | None = None  # top logprobs per generated token
    # Filled with each finished request's output, by workload index, and its timing.
    outputs: dict[int, RequestOutput] | None = None
    timings: list[RequestTiming] | None = None
    label: str | None = None  # the progress bar's description


@dataclass
class _Live:
    req: WorkloadRequest
    timing: RequestTiming
    last_tokens: int = 0


def run_in_process(
    engine: Any,  # noqa: ANN401
    names: list[str],
    workload: Workload,
    base_only: bool,
    progress: bool,
    tier_of: Callable[[str], str] | None = None,
    skip_first: int = 0,
    replay: Replay | None = None,
    profile: bool = False,
    records: bool = False,
) -> dict[str, Any]:
    """Replay `workload` on `engine`; returns the summary (see serve_metrics.summarize).
    `tier_of(adapter name)`: the residency tier the adapter is in as its request arrives (the
    summary then splits latencies by it). `skip_first`: requests of a lower index are replayed
    but left out of the summary, whose clock then starts at the first kept arrival (a cold cache
    warms up in them). `replay`: prompts, cache salt, logprobs, outputs kept (see `Replay`).
    `profile`: measure the GPU busy fraction over a window of the run (CUDA only), which stalls
    the requests in flight while the profiler starts and stops (`busy_of` keeps it out of the
    measured runs). `records`: the summary also holds every step's record (`step_records`)."""
    from loraplex.types import SamplingParams

    replay = replay or Replay()

    reqs = workload.requests
    vocab = engine.model_config.vocab_size
    concurrency = workload.concurrency
    pending = list(reqs)  # in arrival order (closed loop: index order)
    live: dict[str, _Live] = {}
    done: list[RequestTiming] = []
    steps: list[StepRecord] = []
    what = "base-only" if base_only else "with adapters"
    bar = _progress(len(reqs), replay.label or f"bench serve ({what})", progress)
    # With `profile`, GPU busy over a window of the steady part: from a quarter of the requests
    # done, for at most BUSY_STEPS steps or until three quarters are done (the profiler's event
    # list grows with it).
    busy = BusyWindow()
    busy_from, busy_to = len(reqs) // 4, (3 * len(reqs)) // 4
    # Each run its own prefix-cache salt unless the caller gives one: no run finds blocks that an
    # earlier run on this engine left cached (the base-only run replays the prompts of the run with
    # adapters, whose base-only requests it would hit; a budget sweep replays the workload again).
    run_salt = replay.cache_salt if replay.cache_salt is not None else f"bench-serve-run-{next(_RUNS)}"
    prefix = getattr(engine, "prefix_cache", None)
    hits_before = prefix.stats.hit_tokens if prefix is not None else 0
    busy_steps = 0
    start = time.perf_counter()
    launched_at: float | None = None  # when the step in flight was launched
    spoiled: float | None = None  # launch time of a step whose interval the profiler's start or stop took
    # Python GC passes over the run, and how many the engine paced (bench/gc_watch.py)
    with GcWatch(getattr(engine, "gc_pacer", None)) as gc_watch:
        while pending or live:
            now = time.perf_counter() - start
            while pending and (
                (concurrency is not None and len(live) < concurrency)
                or (concurrency is None and (pending[0].arrival_s or 0.0) <= now)
            ):
                req = pending.pop(0)
                rid = f"w{req.index}"
                adapter = None if base_only or req.adapter is None else names[req.adapter]
                params = SamplingParams(
                    max_tokens=req.output_len, temperature=0.0, ignore_eos=True, logprobs=replay.logprobs
                )
                if replay.prompt_of is not None:
                    prompt: str | list[int] = replay.prompt_of(req)
                elif req.prompt is not None:
                    prompt = req.prompt
                else:
                    prompt = prompt_ids(req, vocab, workload.spec.seed)
                arrival = now if concurrency is not None else (req.arrival_s or 0.0)
                tier = "base" if adapter is None else (tier_of(adapter) if tier_of is not None else None)
                t_add = time.perf_counter() - start
                salt = run_salt(req) if callable(run_salt) else run_salt
                engine.add_request(rid, prompt, params, adapter, cache_salt=salt)
                timing = RequestTiming(
                    req.index,
                    req.tenant,
                    workload.popularity_class(None if base_only else req.adapter),
                    arrival,
                    tier=tier,
                )
                timing.admitted_s = time.perf_counter() - start
                timing.resolve_s = timing.admitted_s - t_add
                live[rid] = _Live(req, timing)
            if not live:
                time.sleep(min(0.01, max(0.0, (pending[0].arrival_s or 0.0) - now)))
                continue
            t0 = time.perf_counter()
            # As the server does: this call launches the next step and completes the one the last call
            # launched, whose deltas are handled below while the next runs. A completed step's time is
            # from the return of the call that launched it to the return of the one that completed it
            # (the interval between two completions).
            deltas = engine.step_overlapped()
            t1 = time.perf_counter()
            stats = engine.last_stats  # the completed step's (None: this call completed none)
            if launched_at is not None:
                t0 = launched_at
            launched_at = t1
            if busy.active:
                busy_steps += 1
                if busy_steps >= BUSY_STEPS:
                    busy.stop()
                    spoiled = launched_at
            # (a step in flight while the profiler started or stopped took that time too: not a step time)
            if stats is not None and t0 != spoiled:
                steps.append(
                    StepRecord(
                        t0 - start,
                        t1 - t0,
                        stats.num_rows,
                        stats.num_decode_rows,
                        stats.num_lora_segments,
                        len(stats.rows_per_request),
                        stats.static_replay,
                    )
                )
            for delta in deltas:
                item = live.get(delta.request_id)
                if item is None:
                    continue
                item.last_tokens += len(delta.new_token_ids)
                if item.timing.first_token_s is None:
                    item.timing.first_token_s = t1 - start
                if delta.finished:
                    item.timing.finish_s = t1 - start
                    item.timing.output_tokens = item.last_tokens
                    out = engine.output(delta.request_id, copy_prompt=False)
                    item.timing.prompt_tokens = len(out.prompt_token_ids)
                    if replay.outputs is not None:
                        replay.outputs[item.req.index] = out
                    if replay.timings is not None:
                        replay.timings.append(item.timing)
                    engine.release(delta.request_id)
                    done.append(item.timing)
                    del live[delta.request_id]
                    bar.update(1)
                    if profile and len(done) == busy_from and busy_to > busy_from:
                        busy.start()
                        spoiled = launched_at
                    elif len(done) == busy_to:
                        busy.stop()
                        spoiled = launched_at
    bar.close()
    busy.stop()  # a no-op unless the window is still open
    wall = time.perf_counter() - start
    if skip_first:
        done = [t for t in done if t.index >= skip_first]
        since = min(t.arrival_s for t in done)
        steps = [s for s in steps if s.start_s >= since]
        wall = max(t.finish_s or 0.0 for t in done) - since
    budget = engine.scheduler.token_budget  # the live one: a budget sweep lowers it
    summary = summarize(done, steps, wall, engine.config.scheduler.max_num_seqs, step_budget=budget)
    summary["gpu_busy"] = busy.summary()
    summary["gc"] = gc_watch.summary()
    if records:
        summary["step_records"] = step_records(steps)
    summary["prefix_cache_hit_tokens"] = (prefix.stats.hit_tokens - hits_before) if prefix is not None else 0
    return summary


def busy_of(engine: Any, names: list[str], workload: Workload, base_only: bool) -> dict[str, Any]:  # noqa: ANN401
    """The GPU busy fraction of `workload` on `engine`, from a replay of its first BUSY_REQUESTS
    requests with the profiler on over the steady part (their latencies are not kept)."""
    first = replace(workload, requests=workload.requests[:BUSY_REQUESTS])
    busy = run_in_process(engine, names, first, base_only, progress=False, profile=True)["gpu_busy"]
    return {**busy, "replayed_requests": len(first.requests)}


def _progress(total: int, desc: str, enabled: bool) -> Any:  # noqa: ANN401
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", disable=not enabled, leave=False)


def run(args: ServeBenchArgs, out_dir: Path | None = None, progress: bool = True) -> dict[str, Any]:
    workload = generate(args.workload)
    report: dict[str, Any] = {
        "args": {k: v for k, v in asdict(args).items() if k != "workload"},
        "workload": workload.to_dict(),
        "environment": _environment(args.device),
    }
    if args.url is not None:
        from loraplex.bench.serve_http import run_http

        report["mode"] = "http"
        report["adapters"] = run_http(args.url, workload, args.api_key, progress)
    else:
        if args.http_compare:  # first: its server process gives the device back before the engine here
            report["http"] = _over_http(args, workload, progress)
        engine, names, adapter_dirs = build_engine(args, workload)
        report["mode"] = "in-process"
        # The startup warm-up, and compiles / captures after it: serving should add none.
        report["startup"] = {"warmup_s": engine.warmup_s, **_counters(engine)}
        # A few requests first, untimed: one-time costs of the process (first calls of each op)
        # would otherwise land on whichever run goes first and skew the ratio.
        t0 = time.perf_counter()
        warm = replace(workload, requests=workload.requests[: args.warmup_requests])
        run_in_process(engine, names, warm, base_only=False, progress=False)
        report["warmup_s"] = time.perf_counter() - t0
        report["model"] = {
            "layers": engine.model_config.num_hidden_layers,
            "hidden_size": engine.model_config.hidden_size,
            "vocab_size": engine.model_config.vocab_size,
            "dtype": engine.config.dtype,
            "max_num_seqs": engine.config.scheduler.max_num_seqs,
            # the settings in force (the args hold None where the engine's default applied)
            "step_token_budget": engine.config.scheduler.step_token_budget,
            "admission_batch_tokens": engine.config.scheduler.admission_batch_tokens,
        }
        measured = partial(run_in_process, engine, names, progress=progress, records=args.step_records)
        report["adapters"] = measured(workload, base_only=False)
        if args.base_compare:
            report["base_only"] = measured(workload, base_only=True)
            report["ratios"] = {
                "output_tokens_per_s_vs_base": report["adapters"]["output_tokens_per_s"]
                / report["base_only"]["output_tokens_per_s"]
            }
            decode = report["base_only"]["steps"]["full_batch_decode"]["output_tokens_per_s"]
            if decode:  # base-only output against pure decode of a full batch, the same run's steps
                report["ratios"]["base_only_vs_full_batch_decode"] = (
                    report["base_only"]["output_tokens_per_s"] / decode
                )
                steady = report["base_only"]["steady"]
                if steady is not None:  # the same over the steady part (serve_metrics.steady_window)
                    report["ratios"]["base_only_vs_full_batch_decode_steady"] = (
                        steady["output_tokens_per_s"] / decode
                    )
                bound = report["base_only"]["steps"]["decode_bound"]
                if bound is not None:  # what the run's own step costs allow (serve_metrics.decode_bound)
                    report["ratios"]["base_only_decode_bound"] = bound["fraction_of_full_batch_decode"]
        if str(engine.config.device).startswith("cuda"):  # after the measured runs: stalls nobody timed
            for name, base_only in (("adapters", False), ("base_only", True)):
                if name in report:
                    report[name]["gpu_busy"] = busy_of(engine, names, workload, base_only)
        report["after_startup"] = {
            k: v - report["startup"][k] for k, v in _counters(engine).items()
        }  # the warm-up requests and every measured run

        def replay(other: Workload, base_only: bool) -> dict[str, Any]:
            return measured(other, base_only=base_only)

        more_runs(report, args, replay)
        budget_sweep(report, args, engine.scheduler, replay)
        if "http" in report:
            report.setdefault("ratios", {})["output_tokens_per_s_http_vs_in_process"] = (
                report["http"]["output_tokens_per_s"] / report["adapters"]["output_tokens_per_s"]
            )
        if args.hf_compare:
            report["hf_peft"] = _hf_baseline(args, engine, names, adapter_dirs, workload, progress)
            hf = report["hf_peft"]
            if hf["cut"]:  # stopped at the time limit: against the fastest it could have finished
                report.setdefault("ratios", {})["output_tokens_per_s_vs_hf_peft_at_least"] = (
                    report["adapters"]["output_tokens_per_s"] / hf["output_tokens_per_s_upper_bound"]
                )
            else:
                report.setdefault("ratios", {})["output_tokens_per_s_vs_hf_peft"] = (
                    report["adapters"]["output_tokens_per_s"] / hf["output_tokens_per_s"]
                )
    if out_dir is not None:
        from loraplex.bench.serve_report import write_report

        write_report(report, out_dir)
    return report


def _counters(engine: Any) -> dict[str, int]:  # noqa: ANN401
    return {"kernel_compiles": engine.kernel_compiles, "graph_captures": engine.graph_captures}


def _over_http(args: ServeBenchArgs, workload: Workload, progress: bool) -> dict[str, Any]:
    """The workload as streaming completions against a server on the same engine, in its own
    process; the same untimed warm-up requests first."""
    from loraplex.bench.serve_http import run_http
    from loraplex.bench.serve_server import bench_server

    with bench_server(args) as (url, names, vocab):
        warm = replace(workload, requests=workload.requests[: args.warmup_requests])
        run_http(url, warm, None, progress=False, adapters=names, vocab=vocab)
        return run_http(url, workload, None, progress, adapters=names, vocab=vocab)


def _hf_baseline(
    args: ServeBenchArgs,
    engine: Any,  # noqa: ANN401
    names: list[str],
    adapter_dirs: dict[str, str],
    workload: Workload,
    progress: bool,
) -> dict[str, Any]:
    from loraplex.bench.serve_hf import run_hf

    model_dir = engine.config.model_dir
    missing = sorted(
        {names[r.adapter] for r in workload.requests if r.adapter is not None} - set(adapter_dirs)
    )
    if not Path(model_dir).is_dir() or missing:
        raise SystemExit(
            "--hf-compare needs the model and every adapter as directories (random weights have none)"
        )
    vocab = engine.model_config.vocab_size
    requests = workload.requests[: args.hf_requests]  # the first N (None: all)
    prompts = []
    for r in requests:
        if r.prompt is not None:
            prompts.append(list(engine.tokenizer.encode(r.prompt)))
        else:
            prompts.append(prompt_ids(r, vocab, workload.spec.seed))
    result = run_hf(
        model_dir,
        adapter_dirs,
        names,
        prompts,
        [r.output_len for r in requests],
        [r.adapter for r in requests],
        args.device,
        progress=progress,
        time_limit_s=args.hf_time_limit_s,
    )
    result["requests"] = len(requests)
    return result


def _environment(device: str) -> dict[str, Any]:
    import platform

    import torch

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "device": device}
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    else:
        env["cpu"] = platform.processor() or platform.machine()
    return env

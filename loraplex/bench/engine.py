"""`loraplex bench engine`: the decode step of the whole engine against its bandwidth floor.

A Llama-3-8B-shaped model (or a tiny one with `tiny=True`) is built with random weights directly
on the device (bench/random_weights.py), so no checkpoint is needed; random adapters of exact rank
are made in memory and registered through the normal path (their revision is the usual content
hash: about 0.3 s of host time per full-size r=16 adapter, recorded as `register_s`).

For each mode (base only, then LoRA with `adapters` distinct adapters assigned round-robin), the
bench fills `batch` requests with `context` random prompt tokens, steps until every request is
decoding, then times `steps` decode steps: wall time of `Engine.step()` (scheduling, the model,
sampling, stop checks), its stream synchronized before and after on CUDA; the median is reported.
Then `LOOP_STEPS` more steps one ahead (`Engine.step_overlapped()` back to back, as `LLM.generate`
and the server step), per completed step (`loop_step_ms`).

floor = (weight bytes + KV bytes read + LoRA bytes of the distinct adapters) / copy bandwidth,
where the copy bandwidth is measured in the same run (device-to-device on CUDA). On CPU a host
memcpy is measured instead and the floor is labelled as not meaningful.

This module measures and returns the report (with its pass/fail against issue #5's targets);
bench/engine_report.py writes it out.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from loraplex.bench.engine_report import write_report
from loraplex.bench.random_weights import llama3_8b_hf_dict, random_adapter, random_model, tiny_hf_dict
from loraplex.config import (
    CacheConfig,
    EngineConfig,
    GraphConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
)
from loraplex.engine.engine import Engine
from loraplex.model.llama import LlamaFamilyModel
from loraplex.types import SamplingParams

DEFAULT_OUT = Path("bench-results/engine")
WARMUP_STEPS = 5
LOOP_STEPS = 20  # decode steps timed one ahead after the synchronized ones (within max_tokens' margin)
# Targets from issue #5 (H200, batch 64, context 1024, 32 distinct r=16 adapters on all targets).
BASE_OVER_FLOOR_MAX = 1.5
LORA_OVER_BASE_MAX = 1.25


@dataclass(frozen=True)
class EngineBenchArgs:
    device: str = "cpu"
    tiny: bool = False
    layers: int | None = None
    batch: int = 64
    context: int = 1024
    adapters: int = 32
    rank: int = 16
    steps: int = 50
    seed: int = 0
    profile: bool = False  # also profile a few decode steps per mode (torch.profiler tables)
    graphs: bool = True  # decode steps as CUDA-graph replays (the engine's default on CUDA)
    repeats: int = 3  # base-only / LoRA pairs, alternating; medians reported

    @classmethod
    def preset(cls, tiny: bool, **overrides: Any) -> EngineBenchArgs:
        """Defaults of the preset (issue #5's case, or a tiny CPU smoke run), then any overrides
        that are not None."""
        base: dict[str, Any] = (
            dict(batch=8, context=64, adapters=4, rank=8, steps=10, repeats=1) if tiny else {}
        )
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(tiny=tiny, **base)


def copy_bandwidth_bytes_per_s(device: torch.device, nbytes: int) -> float:
    """(bytes read + bytes written) / time of a copy of `nbytes`, median of a few."""
    if device.type == "cuda":
        from loraplex.bench.timing import GpuTimer, copy_bandwidth

        return copy_bandwidth(GpuTimer(device, reps=10, warmup=2), gib=max(1, nbytes >> 30))
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times)


def weight_bytes_per_step(model: LlamaFamilyModel, batch: int) -> int:
    """Every parameter read once, except an untied embedding table: only the batch's rows."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:
        emb = model.embed_tokens.weight
        total -= emb.numel() * emb.element_size()
        total += batch * emb.shape[1] * emb.element_size()
    return total


def _sync(device: torch.device) -> None:
    """Wait for the step's stream, not the whole device: every kernel of a step runs on the current
    stream or on side streams it joins, and a device-wide synchronize costs time that grows with
    the CUDA graphs the process holds (H200, with the stream already idle: 0.015 ms holding 3
    graphs, 0.3 ms holding 132, 1.36 ms holding the 336 a warmed-up engine captures), a cost no
    serving step pays."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def run_mode(
    engine: Engine, args: EngineBenchArgs, adapter_names: list[str], mode: str, profile: bool = True
) -> dict[str, Any]:
    """Fill the batch, step until all decode, time `args.steps` decode steps."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=args.steps + WARMUP_STEPS + 64, temperature=0.0, ignore_eos=True)
    ids = [f"{mode}-{i}" for i in range(args.batch)]
    for i, rid in enumerate(ids):
        prompt = torch.randint(0, vocab, (args.context,), generator=gen).tolist()
        adapter = adapter_names[i % len(adapter_names)] if adapter_names else None
        engine.add_request(rid, prompt, params, adapter)
    calls0 = engine.lora_backend.total_calls
    decoding: set[str] = set()
    fill_steps = 0
    while len(decoding) < args.batch:
        decoding.update(d.request_id for d in engine.step())
        fill_steps += 1
    for _ in range(WARMUP_STEPS):
        engine.step()
    tokens_before = sum(len(engine.output(r).prompt_token_ids) + len(engine.output(r).token_ids) for r in ids)
    replays0 = engine.graph_replays
    times = []
    for _ in range(args.steps):
        _sync(engine.device)
        t0 = time.perf_counter()
        deltas = engine.step()
        _sync(engine.device)
        times.append(time.perf_counter() - t0)
        stats = engine.last_stats
        if len(deltas) != args.batch or stats is None or stats.num_prefill_rows:
            raise RuntimeError(f"{mode}: a timed step was not a pure decode step of the whole batch")
    calls = engine.lora_backend.total_calls - calls0
    replays = engine.graph_replays - replays0
    if args.graphs and engine.device.type == "cuda" and replays != args.steps:
        raise RuntimeError(f"{mode}: {replays} of {args.steps} timed steps were CUDA-graph replays")
    loop_ms = _loop_step_ms(engine, args, mode)
    prof = _host_breakdown(engine) + "\n\n" + _profile_steps(engine) if args.profile and profile else None
    for rid in ids:
        engine.abort(rid)
        engine.release(rid)
    # A decode step attends every token of each sequence (the new one included).
    kv_tokens_per_step = tokens_before + args.batch * (args.steps - 1) / 2
    return {
        "step_ms": statistics.median(times) * 1e3,
        "step_ms_all": [t * 1e3 for t in times],
        "loop_step_ms": loop_ms,
        "fill_steps": fill_steps,
        "lora_calls": calls,
        "graph_replays": replays,
        "kv_tokens_per_step": kv_tokens_per_step,
        "profile": prof,
    }


def _loop_step_ms(engine: Engine, args: EngineBenchArgs, mode: str) -> float:
    """A decode step's time as `LLM.generate` and the server meet it: `Engine.step_overlapped()`
    back to back (each call launches the next step, then completes the one in flight), nothing
    synchronized between the calls, per completed step. The timed steps above run each step to
    its end between two stream synchronizations; this is the number without either."""
    _sync(engine.device)
    t0 = time.perf_counter()
    engine.step_overlapped()  # the first call only launches
    for _ in range(LOOP_STEPS):
        deltas = engine.step_overlapped()
        if len(deltas) != args.batch:
            raise RuntimeError(f"{mode}: a step one ahead was not a decode step of the whole batch")
    elapsed = time.perf_counter() - t0
    engine.step()  # completes the step left in flight (and runs one more)
    return elapsed * 1e3 / LOOP_STEPS


def _host_breakdown(engine: Engine, steps: int = 10) -> str:
    """Where a decode step's wall time goes, without a profiler (which slows graph launches):
    the step's parts timed with perf_counter, the stream synchronized only after the forward's
    launch returned (so `device wait` is GPU time the host did not cover)."""
    parts: dict[str, list[float]] = {
        k: [] for k in ("schedule", "forward launch", "device wait", "sample+post")
    }
    for _ in range(steps):
        _sync(engine.device)
        t0 = time.perf_counter()
        plan = engine.scheduler.schedule()
        t1 = time.perf_counter()
        result = engine.runner.run(plan, engine.slot_map(plan))
        t2 = time.perf_counter()
        _sync(engine.device)
        t3 = time.perf_counter()
        engine._postprocess(plan, result)
        t4 = time.perf_counter()
        for k, a, b in zip(parts, (t0, t1, t2, t3), (t1, t2, t3, t4), strict=True):
            parts[k].append((b - a) * 1e3)
    return "host breakdown of a decode step (median ms): " + ", ".join(
        f"{k} {statistics.median(v):.3f}" for k, v in parts.items()
    )


def _profile_steps(engine: Engine, steps: int = 3) -> str:
    """Top operators of a few decode steps by device time, then by host time (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            engine.step()
        _sync(engine.device)
    avg = prof.key_averages()
    by_dev = "cuda_time_total" if engine.device.type == "cuda" else "cpu_time_total"
    return (
        f"{steps} decode steps, by device time:\n{avg.table(sort_by=by_dev, row_limit=25)}\n"
        f"by host time:\n{avg.table(sort_by='self_cpu_time_total', row_limit=25)}"
    )


def run(args: EngineBenchArgs, out_dir: Path | None = None, plot_png: bool = True) -> dict[str, Any]:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "--device cuda asked for, but CUDA is not available (a CPU smoke run: --device cpu --tiny)"
        )
    dtype = torch.bfloat16
    hf = tiny_hf_dict(args.layers) if args.tiny else llama3_8b_hf_dict(args.layers)
    mc = ModelConfig.from_hf_dict(hf)
    copy_bw = copy_bandwidth_bytes_per_s(device, (4 << 30) if device.type == "cuda" else (64 << 20))

    t0 = time.perf_counter()
    model = random_model(mc, dtype, device, args.seed)
    _sync(device)
    build_s = time.perf_counter() - t0
    block = 16
    max_len = args.context + args.steps + WARMUP_STEPS + 80
    config = EngineConfig(
        model_dir="<random weights>",
        dtype="bfloat16",
        device=args.device,
        seed=args.seed,
        cache=CacheConfig(
            block_size=block, num_blocks=args.batch * -(-max_len // block), max_model_len=max_len
        ),
        lora=LoRAConfig(max_rank=max(64, args.rank)),
        scheduler=SchedulerConfig(max_num_seqs=args.batch, max_num_batched_tokens=max(2048, args.batch)),
        graphs=GraphConfig(cuda_graph_max_batch=args.batch if args.graphs else 0),
    )
    engine = Engine(config, model=model)

    t0 = time.perf_counter()
    names = []
    for i in range(args.adapters):
        imported = random_adapter(mc, args.rank, args.seed + 1000 + i, dtype, device)
        names.append(f"bench-{i}")
        engine.register_imported(names[-1], imported)
    _sync(device)
    register_s = time.perf_counter() - t0
    lora_bytes = sum(e.nbytes for e in engine.adapters.list())

    # Alternate the modes: a drift of the GPU's speed over the run then hits both alike, and the
    # spread of the per-pair ratios shows how much one pair can be trusted.
    pairs = []
    base = lora = None
    for r in range(args.repeats):
        b = run_mode(engine, args, [], "base", profile=r == 0)
        m = run_mode(engine, args, names, "lora", profile=r == 0) if names else None
        base, lora = base or b, lora or m
        pairs.append({
            "base_ms": b["step_ms"],
            "lora_ms": m["step_ms"] if m else None,
            "base_loop_ms": b["loop_step_ms"],
            "lora_loop_ms": m["loop_step_ms"] if m else None,
        })  # fmt: skip
    assert base is not None
    base_ms = statistics.median(p["base_ms"] for p in pairs)
    ratios = [p["lora_ms"] / p["base_ms"] for p in pairs] if lora else []

    kv_token_bytes = mc.num_hidden_layers * 2 * mc.num_key_value_heads * mc.head_dim * dtype.itemsize
    bytes_ = {
        "weights": weight_bytes_per_step(model, args.batch),
        "kv_read": int(base["kv_tokens_per_step"] * kv_token_bytes),
        "lora": lora_bytes,
    }
    floor_ms = sum(bytes_.values()) / copy_bw * 1e3
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "args": asdict(args),
        "model": {
            k: hf[k]
            for k in (
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "intermediate_size",
                "vocab_size",
            )
        },  # fmt: skip
        "copy_bw_GBps": copy_bw / 1e9,
        "copy_bw_kind": "device-to-device copy" if device.type == "cuda" else "host memcpy (64 MB)",
        "floor_meaningful": device.type == "cuda",
        "bytes": bytes_,
        "floor_ms": floor_ms,
        "build_s": build_s,
        "register_s": register_s,
        "base": base,  # the first repeat's details (its timed steps, profile)
        "lora": lora,
        "pairs": pairs,  # per repeat: median base-only and LoRA step
        "loop_steps": LOOP_STEPS,
        "base_step_ms": base_ms,
        "lora_step_ms": statistics.median(p["lora_ms"] for p in pairs) if lora else None,
        # the same steps one ahead, back to back (`_loop_step_ms`), medians over the pairs
        "base_loop_step_ms": statistics.median(p["base_loop_ms"] for p in pairs),
        "lora_loop_step_ms": statistics.median(p["lora_loop_ms"] for p in pairs) if lora else None,
        "base_over_floor": base_ms / floor_ms,
        "lora_over_base": statistics.median(ratios) if ratios else None,  # median of per-pair ratios
        "lora_over_base_range": [min(ratios), max(ratios)] if ratios else None,
    }
    report["targets"] = _targets(report)
    if out_dir is not None:
        write_report(report, out_dir, plot_png)
    return report


def _targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    t = [
        {"name": "base step / floor", "value": report["base_over_floor"], "threshold": BASE_OVER_FLOOR_MAX},
    ]
    if report["lora_over_base"] is not None:
        t.append(
            {
                "name": "LoRA step / base step",
                "value": report["lora_over_base"],
                "threshold": LORA_OVER_BASE_MAX,
            }
        )
    for x in t:
        x["pass"] = bool(x["value"] <= x["threshold"]) if report["floor_meaningful"] else None
    if not report["floor_meaningful"]:
        t[0]["value"] = None  # a host memcpy is no ceiling for this engine: no verdict on CPU
    return t

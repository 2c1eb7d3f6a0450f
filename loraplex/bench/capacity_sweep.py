"""`loraplex bench capacity --sweep`: where the adapter cache starts to thrash.

Registered adapter count x popularity (uniform, Zipf a = 0.5 / 1 / 1.5) against a fixed device
room, on the real engine in-process: every point is a closed-loop workload from the project's one
workload module (bench/workloads.py) replayed by `bench serve`'s driver (`run_in_process`), so
throughput and TTFT mean the same thing as there. Per point: output tokens/s, P99 TTFT overall and
of requests whose adapter was on the device when they arrived, and the tiers' loads, evictions
and stalls during the point. `--compare-resident` replays every point on a second engine whose
device room holds every adapter (the all-resident baseline) and reports the ratios.

Weights are random (bench/random_weights.py `random_model`, Llama-3 architecture, tiny or 8B-shaped);
adapters are random tensors registered straight into the host tier (no files, no hashing: each
gets a synthetic revision), at the ranks the workload draws, on the chosen targets. The engines
run one after the other in one process, each torn down before the next is built, on the same
seeds (so the same model and adapter weights).

Nothing here imports the server (fastapi, sqlalchemy): GPU machines may lack them.
"""

from __future__ import annotations

import gc
import hashlib
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from loraplex.bench.serve_metrics import RequestTiming, percentiles
from loraplex.bench.workloads import Workload, WorkloadSpec, generate

POPULARITIES = ("uniform", "zipf:0.5", "zipf:1.0", "zipf:1.5")
THRASH_TOKENS = 0.9  # a point thrashes once its tokens/s falls below this share of the smallest count's
WARMUP_REQUESTS = 8


@dataclass(frozen=True)
class SweepArgs:
    device: str = "cpu"
    shape: str = "tiny"  # random weights: "tiny" or "llama3-8b"
    layers: int | None = None  # None: the shape's own (tiny 2, llama3-8b 32)
    counts: tuple[int, ...] = (2, 6, 12)
    popularities: tuple[str, ...] = POPULARITIES
    room_adapters: int | None = 3  # device room in adapters of the largest rank...
    device_bytes: int | None = None  # ...or in bytes (wins when given)
    ranks: str = "8,16"
    targets: tuple[str, ...] = ("q", "k", "v", "o")
    requests: int = 24
    concurrency: int = 8
    prompt_len: str = "uniform:4:16"
    output_len: str = "uniform:4:12"
    skip_fraction: float = 0.1  # the first requests of each point warm the cache, unreported
    compare_resident: bool = False
    seed: int = 0

    @classmethod
    def h200(cls, **overrides: Any) -> SweepArgs:  # noqa: ANN401
        """The issue's H200 target: Llama-3-8B shape, 1,000 adapters (r 8 and 16 on q,k,v,o), Zipf
        a = 1, closed loop 64, prompts 128-1024, outputs 64-256, 3,000 requests with the first 10%
        left out, room for 64 adapters against all resident."""
        base = cls(
            device="cuda",
            shape="llama3-8b",
            counts=(1000,),
            popularities=("zipf:1.0",),
            room_adapters=64,
            requests=3000,
            concurrency=64,
            prompt_len="uniform:128:1024",
            output_len="uniform:64:256",
            compare_resident=True,
        )
        return replace(base, **overrides)


def _spec(args: SweepArgs, count: int, popularity: str) -> WorkloadSpec:
    return WorkloadSpec(
        seed=args.seed,
        num_requests=args.requests,
        num_adapters=count,
        popularity=popularity,
        base_share=0.0,
        ranks=args.ranks,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        arrivals=f"closed:{args.concurrency}",
    )


def _model_config(args: SweepArgs) -> Any:  # noqa: ANN401
    from loraplex.bench.random_weights import llama3_8b_hf_dict, tiny_hf_dict
    from loraplex.config import ModelConfig

    if args.shape not in ("tiny", "llama3-8b"):
        raise SystemExit(f"--shape {args.shape!r}: the sweep runs random weights, tiny or llama3-8b")
    make = tiny_hf_dict if args.shape == "tiny" else llama3_8b_hf_dict
    return ModelConfig.from_hf_dict(make(args.layers))


def adapter_sizes(args: SweepArgs, mc: Any, rank: int) -> tuple[int, int]:  # noqa: ANN401
    """(actual, pool-allocated) bytes of one adapter of `rank` on the sweep's targets."""
    from loraplex.bench.capacity import adapter_bytes

    return adapter_bytes(mc, rank, list(args.targets), _dtype(args))


def _dtype(args: SweepArgs) -> Any:  # noqa: ANN401
    import torch

    # bf16 on CUDA as served; float32 on the CPU, where it is the faster of the two
    return torch.bfloat16 if args.device.startswith("cuda") else torch.float32


def build_engine(
    args: SweepArgs, ranks: list[int], room_bytes: int, max_resident: int
) -> tuple[Any, dict[str, str]]:  # noqa: ANN401
    """An engine on random weights with one adapter registered per entry of `ranks` (host tier;
    onto the device while room lasts) and a device pool of `room_bytes`; and each adapter's
    revision by name, in registration order."""
    import torch

    from loraplex.bench.random_weights import random_adapter, random_model
    from loraplex.config import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig
    from loraplex.engine.engine import Engine
    from loraplex.lora.layout import TARGETS

    unknown = [t for t in args.targets if t not in TARGETS]
    if unknown:
        raise SystemExit(f"--targets: unknown {unknown}; the targets are {','.join(TARGETS)}")
    mc = _model_config(args)
    dtype, device = _dtype(args), torch.device(args.device)
    longest = max(r.prompt_len + r.output_len for r in generate(_spec(args, 1, "uniform")).requests)
    host_bytes = sum(adapter_sizes(args, mc, r)[0] for r in set(ranks)) * len(ranks)
    config = EngineConfig(
        model_dir="<random weights>",
        dtype=str(dtype).removeprefix("torch."),
        device=args.device,
        cache=CacheConfig(block_size=16, max_model_len=longest + 1),
        lora=LoRAConfig(
            max_rank=max(ranks),
            max_resident=max_resident,
            adapter_device_bytes=room_bytes,
            adapter_host_bytes=host_bytes,
        ),
        scheduler=SchedulerConfig(max_num_seqs=args.concurrency, max_num_batched_tokens=max(2048, longest)),
    )
    engine = Engine(config, model=random_model(mc, dtype, device, args.seed))
    revisions = {}
    for i, rank in enumerate(ranks):
        # generated on the engine's device (fast on a GPU), dropped once the host tier has its copy;
        # a synthetic revision spares hashing every adapter's bytes
        imported = random_adapter(mc, rank, 1000 + i, dtype, device, args.targets)
        revision = hashlib.sha256(f"bench-capacity:{args.seed}:{i}:{rank}".encode()).hexdigest()
        ref = engine.register_imported(f"cap-{i}", imported, revision=revision)
        revisions[ref.name] = ref.revision
    return engine, revisions


def _tier_of(engine: Any, revisions: dict[str, str]) -> Callable[[str], str]:  # noqa: ANN401
    """The tier an adapter is in now, by name (`run_in_process` asks as each request arrives)."""
    tiers = engine.tiers

    def tier(name: str) -> str:
        rev = revisions[name]
        if tiers.residency.is_resident(rev):
            return "device"
        return "host" if rev in tiers.host else "disk"

    return tier


def _counters(engine: Any) -> dict[str, int]:  # noqa: ANN401
    s = engine.tiers.stats()
    return {
        "loads": s["loads"],
        "evictions": s["evictions"],
        "stalled_requests": s["stalled_requests"],
        "device_hits": s["device"]["hits"],
        "host_hits": s["host_admissions"],
        "compactions": s["device"]["compactions"],
        # loads and evictions must not compile a kernel or capture a graph (the startup warm-up
        # covers every rank and slot): a point's difference of these is expected to be 0
        "kernel_compiles": engine.kernel_compiles,
        "graph_captures": engine.graph_captures,
    }


def run_points(args: SweepArgs, room_bytes: int, max_resident: int, progress: bool) -> list[dict[str, Any]]:
    """Every (count, popularity) point on one engine (built here, torn down before returning)."""
    from loraplex.bench.serve import Replay, run_in_process

    ranks = generate(_spec(args, max(args.counts), "uniform")).adapter_ranks
    engine, revisions = build_engine(args, ranks, room_bytes, max_resident)
    names = list(revisions)
    tier_of = _tier_of(engine, revisions)
    try:
        warm = generate(replace(_spec(args, max(args.counts), "uniform"), num_requests=WARMUP_REQUESTS))
        run_in_process(engine, names, warm, base_only=False, progress=False)
        points = []
        for count in args.counts:
            for popularity in args.popularities:
                workload: Workload = generate(_spec(args, count, popularity))
                before = _counters(engine)
                t0 = time.perf_counter()
                skip = int(args.requests * args.skip_fraction)
                timings: list[RequestTiming] = []
                summary = run_in_process(
                    engine,
                    names,
                    workload,
                    base_only=False,
                    progress=progress,
                    tier_of=tier_of,
                    skip_first=skip,
                    replay=Replay(timings=timings),
                )
                after = _counters(engine)
                point = _point(count, popularity, summary, before, after, time.perf_counter() - t0)
                # each kept request's (index, tier at arrival, TTFT): the comparison with the
                # all-resident run takes the same requests' TTFTs there
                kept = [t for t in timings if t.index >= skip and t.first_token_s is not None]
                point["requests_detail"] = sorted((t.index, t.tier, t.ttft) for t in kept)
                points.append(point)
        return points
    finally:
        engine.tiers.close()
        del engine
        _free_memory(args.device)


def _point(
    count: int,
    popularity: str,
    summary: dict[str, Any],
    before: dict[str, int],
    after: dict[str, int],
    seconds: float,
) -> dict[str, Any]:
    device = summary["by_tier"].get("device")
    return {
        "adapters": count,
        "popularity": popularity,
        "output_tokens_per_s": summary["output_tokens_per_s"],
        "requests": summary["latency"]["requests"],
        "ttft_p50_s": summary["latency"]["ttft_s"]["p50"],
        "ttft_p99_s": summary["latency"]["ttft_s"]["p99"],
        "device_hit_requests": device["requests"] if device else 0,
        "device_hit_ttft_p99_s": device["ttft_s"]["p99"] if device else None,
        "by_tier_requests": {k: v["requests"] for k, v in summary["by_tier"].items()},
        # where a device hit's TTFT goes at the tail: waiting for admission, then to its first token
        "device_hit_queue_p99_s": device["queue_s"]["p99"] if device else None,
        "device_hit_prefill_p99_s": device["prefill_s"]["p99"] if device else None,
        "step_median_s": {k: v["median_s"] for k, v in summary["steps"]["by_kind"].items()},
        "worst_step_over_median": summary["steps"]["max_over_median_same_kind_and_bucket"],
        **{k: after[k] - before[k] for k in after},
        "point_s": seconds,
    }


def _free_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def thrash_onset(points: list[dict[str, Any]]) -> dict[str, int | None]:
    """Per popularity, the smallest adapter count whose tokens/s fell below THRASH_TOKENS of the
    smallest count's (None: no point thrashed)."""
    out: dict[str, int | None] = {}
    for pop in dict.fromkeys(p["popularity"] for p in points):
        mine = sorted((p for p in points if p["popularity"] == pop), key=lambda p: p["adapters"])
        base = mine[0]["output_tokens_per_s"]
        out[pop] = next(
            (p["adapters"] for p in mine if p["output_tokens_per_s"] < THRASH_TOKENS * base), None
        )
    return out


def run(args: SweepArgs, progress: bool = True) -> dict[str, Any]:
    mc = _model_config(args)
    ranks = sorted({int(r.split(":")[0]) for r in args.ranks.split(",")})
    largest = adapter_sizes(args, mc, max(ranks))[1]
    smallest = adapter_sizes(args, mc, min(ranks))[1]
    if args.device_bytes is not None:
        room = args.device_bytes
    elif args.room_adapters is not None:
        room = args.room_adapters * largest
    else:
        raise SystemExit("the sweep needs a device room: --room-adapters N or --adapter-device-bytes N")
    report: dict[str, Any] = {
        "args": asdict(args),
        "device_room_bytes": room,
        "adapter_allocated_bytes": {str(r): adapter_sizes(args, mc, r)[1] for r in ranks},
        "room_in_largest_adapters": room / largest,
    }
    report["points"] = run_points(args, room, max(1, room // smallest), progress)
    report["thrash_onset"] = thrash_onset(report["points"])
    if args.compare_resident:
        everything = max(args.counts) * largest
        resident = run_points(args, everything, max(args.counts), progress)
        report["all_resident"] = resident
        report["vs_all_resident"] = [_ratio(p, q) for p, q in zip(report["points"], resident, strict=True)]
    from loraplex.bench.serve import _environment

    report["environment"] = _environment(args.device)
    return report


def _ratio(tiered: dict[str, Any], resident: dict[str, Any]) -> dict[str, Any]:
    a, b = tiered["device_hit_ttft_p99_s"], resident["device_hit_ttft_p99_s"]
    # The same requests in both runs: those that found their adapter on the device in the tiered one
    hits = {i for i, tier, _ in tiered.get("requests_detail", ()) if tier == "device"}
    same = [ttft for i, _, ttft in resident.get("requests_detail", ()) if i in hits]
    c = percentiles(same)["p99"] if same else None
    steps = {
        k: tiered["step_median_s"][k] / v
        for k, v in resident.get("step_median_s", {}).items()
        if v and k in tiered.get("step_median_s", {})
    }
    return {
        "adapters": tiered["adapters"],
        "popularity": tiered["popularity"],
        "output_tokens_per_s_ratio": tiered["output_tokens_per_s"] / resident["output_tokens_per_s"],
        "device_hit_ttft_p99_s": a,
        "all_resident_ttft_p99_s": b,
        "device_hit_ttft_p99_ratio": a / b if a is not None and b else None,
        "same_requests_all_resident_ttft_p99_s": c,
        "device_hit_ttft_p99_ratio_same_requests": a / c if a is not None and c else None,
        "step_median_ratio": steps,
    }

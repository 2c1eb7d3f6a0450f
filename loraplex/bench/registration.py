"""Engine step time while large adapters register (issue 17's check of the control plane).

An in-process demo server (no HTTP) keeps `streams` greedy requests running nonstop; every engine
step is timed. Phases alternate: `quiet` (generation only) and `busy` (generation while the
control service registers `adapters_per_phase` new rank-`rank` adapters on every target of the
demo model, one after another, through the same path as `POST /admin/v1/adapters`: fetch,
convert, hash and store in the registration worker process, then the server loads the stored
weights). The report compares the median step time of the busy phases with the quiet ones.

    loraplex bench registration [--rank 64] [--pairs 5] [--in-process] [--out DIR]
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loraplex.demo import DEMO_MODEL_DIR
from loraplex.types import SamplingParams

# torch, safetensors and the server load inside the functions: `loraplex --help` imports this
# module to list the command.

_HF = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


@dataclass
class RegistrationBenchArgs:
    rank: int = 64
    pairs: int = 5  # quiet/busy phase pairs
    adapters_per_phase: int = 3
    streams: int = 8  # concurrent generation requests
    quiet_seconds: float = 3.0
    in_process: bool = False  # register on the server's writer thread (the baseline without a worker)
    threads: int | None = None  # torch threads of the server process during the run (None: as set)
    out: Path | None = None


@dataclass
class PhaseResult:
    kind: str  # "quiet" or "busy"
    steps: int
    median_ms: float
    seconds: float


@dataclass
class RegistrationReport:
    args: dict[str, Any]
    adapter_bytes: int  # of one adapter's safetensors file
    phases: list[PhaseResult] = field(default_factory=list)
    registrations: list[float] = field(default_factory=list)  # seconds each

    def summary(self) -> dict[str, float]:
        quiet = [p.median_ms for p in self.phases if p.kind == "quiet"]
        busy = [p.median_ms for p in self.phases if p.kind == "busy"]
        pairs = [b / q for q, b in zip(quiet, busy, strict=True)]
        return {
            "quiet_median_ms": statistics.median(quiet),
            "busy_median_ms": statistics.median(busy),
            "ratio": statistics.median(busy) / statistics.median(quiet),
            # each busy phase against the quiet one just before it: the machine's own drifts in
            # speed (a shared VM's steps vary 2x from one second to the next) cancel in a pair
            "pair_ratio_median": statistics.median(pairs),
            "pair_ratios_max": max(pairs),
            "registration_s_median": statistics.median(self.registrations),
        }


def write_adapter(path: Path, rank: int, seed: int) -> Path:
    """A PEFT LoRA adapter of rank `rank` on every projection of the demo model."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    dims = {
        "q_proj": (hidden, config["num_attention_heads"] * config["head_dim"]),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (config["num_attention_heads"] * config["head_dim"], hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for target, (d_in, d_out) in dims.items():
            key = f"base_model.model.model.layers.{layer}.{_HF[target]}.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen) * 0.01
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    peft = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(dims)}
    (path / "adapter_config.json").write_text(json.dumps(peft))
    return path


class _Traffic:
    """Keeps `streams` requests running on the async engine and times every step."""

    def __init__(self, server: Any, streams: int) -> None:  # noqa: ANN401
        self.engine = server.async_engine.engine
        self.async_engine = server.async_engine
        self.streams = streams
        self.durations: list[float] = []
        self._ids = 0
        self._live: set[str] = set()
        step = self.engine.step_overlapped  # what the engine thread calls in its loop

        def timed() -> Any:  # noqa: ANN401
            start = time.perf_counter()
            deltas = step()
            self.durations.append(time.perf_counter() - start)
            for delta in deltas:
                if delta.finished and delta.request_id in self._live:
                    self._live.discard(delta.request_id)
                    self.engine.release(delta.request_id)
            self._top_up()
            return deltas

        self.engine.step_overlapped = timed

    def _top_up(self) -> None:
        while len(self._live) < self.streams:  # on the engine thread: safe to admit here
            self._ids += 1
            rid = f"load-{self._ids}"
            self.engine.add_request(rid, "abcdefgh=", SamplingParams(max_tokens=40))
            self._live.add(rid)

    def start(self) -> None:
        self.async_engine.call(lambda e: self._top_up()).result(timeout=60)

    def take(self) -> list[float]:
        out, self.durations = self.durations, []
        return out


def run(args: RegistrationBenchArgs) -> RegistrationReport:
    import torch

    previous = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        report = _run(args)
    finally:
        torch.set_num_threads(previous)
    if args.out is not None:
        _write(report, args.out)
    return report


def _run(args: RegistrationBenchArgs) -> RegistrationReport:
    import torch

    from loraplex.adapters.registration_worker import prepare
    from loraplex.config import EngineConfig, LoRAConfig, SchedulerConfig
    from loraplex.server.admin_ops import AdminOps
    from loraplex.server.auth import Principal
    from loraplex.server.serve import ServerSettings, build_server

    with tempfile.TemporaryDirectory(prefix="loraplex-bench-reg-") as tmp:
        root = Path(tmp)
        sources = root / "sources"
        total = args.pairs * args.adapters_per_phase + 1
        paths = [write_adapter(sources / f"big{i}", args.rank, seed=i) for i in range(total)]
        settings = ServerSettings(model=str(DEMO_MODEL_DIR), data_dir=str(root / "data"))
        settings.source_roots = [str(sources)]
        config = EngineConfig(
            model_dir=str(DEMO_MODEL_DIR),
            lora=LoRAConfig(max_rank=max(64, args.rank)),
            scheduler=SchedulerConfig(max_num_seqs=args.streams),
        )
        server = build_server(settings, config, progress=False)
        if args.in_process:
            server.control.plane.runner = prepare
        nbytes = (paths[0] / "adapter_model.safetensors").stat().st_size
        facts = {"out": str(args.out), "torch_threads": torch.get_num_threads()}
        report = RegistrationReport(asdict(args) | facts, nbytes)
        ops = AdminOps(server.control)
        who = Principal("admin", "default", "bench")
        try:
            server.async_engine.start()
            traffic = _Traffic(server, args.streams)
            traffic.start()
            # warm-up: the worker process starts and imports torch; steps settle
            ops.register(who, "warmup", str(paths[-1]), None, None, "shared")
            time.sleep(1.0)
            traffic.take()
            for pair in range(args.pairs):
                time.sleep(args.quiet_seconds)
                quiet = traffic.take()
                report.phases.append(_phase("quiet", quiet, args.quiet_seconds))
                busy_start = time.perf_counter()
                for i in range(args.adapters_per_phase):
                    path = paths[pair * args.adapters_per_phase + i]
                    start = time.perf_counter()
                    name = f"big-{pair}-{i}"
                    # on the control service's writer thread, as the admin API does
                    server.control.writer.submit(
                        ops.register, who, name, str(path), None, None, "shared"
                    ).result(timeout=600)
                    report.registrations.append(time.perf_counter() - start)
                busy = traffic.take()
                report.phases.append(_phase("busy", busy, time.perf_counter() - busy_start))
        finally:
            server.close()
    return report


def _phase(kind: str, durations: list[float], seconds: float) -> PhaseResult:
    if not durations:
        raise RuntimeError(f"no engine step completed during a {kind} phase")
    return PhaseResult(kind, len(durations), 1000 * statistics.median(durations), seconds)


def _write(report: RegistrationReport, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    data = {"args": report.args, "adapter_bytes": report.adapter_bytes, "summary": report.summary()}
    data["phases"] = [asdict(p) for p in report.phases]
    data["registrations_s"] = report.registrations
    (out / "registration.json").write_text(json.dumps(data, indent=2))
    s = report.summary()
    lines = [
        "# Engine step time while adapters register",
        "",
        f"Demo model on the CPU (torch threads: {report.args['torch_threads']}), "
        f"{report.args['streams']} greedy streams; each busy phase registers "
        f"{report.args['adapters_per_phase']} rank-{report.args['rank']} adapters on every target "
        f"({report.adapter_bytes / 2**20:.1f} MiB each), "
        f"{'on the writer thread (no worker)' if report.args['in_process'] else 'in the worker process'}.",
        "",
        f"- median step, quiet: {s['quiet_median_ms']:.2f} ms; busy: {s['busy_median_ms']:.2f} ms; "
        f"ratio {s['ratio']:.2f}; busy / quiet per pair, median {s['pair_ratio_median']:.2f} "
        f"(target <= 1.5), worst {s['pair_ratios_max']:.2f}",
        f"- one registration: {s['registration_s_median']:.2f} s (median)",
        "",
        "| phase | steps | median step (ms) | seconds |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {p.kind} | {p.steps} | {p.median_ms:.2f} | {p.seconds:.1f} |" for p in report.phases]
    (out / "registration.md").write_text("\n".join(lines) + "\n")


def add_parser(sub: Any) -> None:  # noqa: ANN401  (argparse's private subparsers type)
    r = sub.add_parser("registration", help="engine step time while large adapters register (CPU)")
    r.add_argument("--rank", type=int, default=64, help="rank on every target of the demo model")
    r.add_argument("--pairs", type=int, default=5, help="quiet/busy phase pairs")
    r.add_argument("--adapters-per-phase", type=int, default=3)
    r.add_argument("--streams", type=int, default=8, help="concurrent generation requests")
    r.add_argument("--quiet-seconds", type=float, default=3.0)
    r.add_argument("--threads", type=int, help="torch threads of the server process")
    r.add_argument("--in-process", action="store_true", help="no worker process (the baseline)")
    r.add_argument("--out", type=Path, default=Path("bench-results/registration"))
    r.set_defaults(run=_cli)


def _cli(args: Any) -> int:  # noqa: ANN401
    fields = {f: getattr(args, f) for f in RegistrationBenchArgs.__dataclass_fields__}
    report = run(RegistrationBenchArgs(**fields))
    print(json.dumps(report.summary(), indent=2))
    print(f"wrote {args.out}/registration.json and registration.md")
    return 0

"""`loraplex bench prefix`: time to first token with the prefix cache warm against cold.

Every request is one system prompt shared by all (`prefix_len` tokens) followed by a suffix of its
own (`suffix_len` tokens), on one of `num_adapters` adapters in turn; all of a run's requests
arrive together, greedy, EOS ignored. The engine is `bench serve`'s (bench/serve_model.py) and
its driver `run_in_process`; the requests are a `bench/workloads.py` workload. In one process, on
one engine, one after the other:

1. rehearsal (untimed): the same shapes with other suffixes under a cache salt of its own, so
   that one-time costs of the process (first calls, prefill kernel specializations) land on no
   measured run;
2. cold, nothing shared: the requests, each under a salt of its own, so that no request finds
   anything cached, not even what another request of the run computed: the TTFT the prefix cache
   is measured against (the target);
3. cold: the requests under one salt no earlier request used, so that nothing is cached for them
   at arrival. Blocks computed during the run are shared within it, as on any empty cache (a
   request admitted after its adapter's first request computed the system prompt finds it); each
   request's cached tokens are reported;
4. prime: one request per adapter (the system prompt and a suffix of its own) under the warm salt:
   the cache then holds the system prompt once per adapter revision (the prefix seed is a
   revision's);
5. warm: the cold run's requests again (the same prompts: the same suffixes) under the warm salt.
   Each finds the system prompt cached; its suffix blocks were cached under the cold salt, so
   they are no hits.

Then, unless `cache_off` is off, a second engine without a prefix cache (built after the first is
torn down, with the same seeded weights and adapters) runs the same requests: nothing reused at
all. Greedy tokens are compared per request between cold and warm (and cache-off); where they
differ, the report gives the first differing step and the cold run's top-2 logprob margin there.
"""

from __future__ import annotations

import gc
import random
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from loraplex.bench.prefix_reference import (
    ReferenceRequest,
    agreement_by_run,
    compare_tokens,
    compare_with_reference,
    reference_steps,
)
from loraplex.bench.serve_metrics import percentiles
from loraplex.bench.serve_model import ServeBenchArgs, build_engine, prompt_ids
from loraplex.bench.workloads import Workload, WorkloadRequest, WorkloadSpec, generate

TARGET_RATIO = 0.2  # issue 19: TTFT warm <= 0.2 x cold
SALTS = {
    "rehearsal": "bench-prefix/rehearsal",
    "unshared": "bench-prefix/unshared",  # + "/<request index>"
    "cold": "bench-prefix/cold",
    "warm": "bench-prefix/warm",
}


@dataclass(frozen=True)
class PrefixBenchArgs:
    device: str = "cuda"
    model: str | None = None  # a model directory; None: random weights (or the demo model: smoke)
    random_layers: int = 32
    random_shape: str = "llama3-8b"
    dtype: str | None = None  # None: bench serve's default (bfloat16; float32 for the demo model)
    num_adapters: int = 8
    rank: int = 16
    requests: int = 64
    prefix_len: int = 1024
    suffix_len: int = 64
    output_len: int = 32
    max_num_batched_tokens: int = 2048
    logprobs: int = 2  # top-2 per token: the margin where cold and warm tokens differ
    cache_off: bool = True  # the cache-off baseline on a second engine
    # transformers + PEFT in float32 along the cold run's tokens (bench/prefix_reference.py): warm
    # and cold must agree wherever its top-2 margin decides. Random weights then go through files.
    fp32_reference: bool = False
    workdir: str = "bench-results/serve-checkpoint"  # those files (reused while shape and seed hold)
    seed: int = 0
    smoke: bool = False

    @classmethod
    def smoke_args(cls, **overrides: Any) -> PrefixBenchArgs:  # noqa: ANN401
        """The CPU demo model (float32, a 64-token context): 16 requests on its 4 adapters, a
        budget of 64 tokens a step, so the cold run spans several steps."""
        smoke = cls(
            device="cpu",
            num_adapters=4,
            requests=16,
            prefix_len=32,
            suffix_len=8,
            output_len=8,
            max_num_batched_tokens=64,
            smoke=True,
        )
        return replace(smoke, **overrides)

    def spec(self) -> WorkloadSpec:
        """The measured requests as a workload: whole prompts (system prompt + suffix), adapters
        in turn, all in flight at once."""
        return WorkloadSpec(
            seed=self.seed,
            num_requests=self.requests,
            num_adapters=self.num_adapters,
            popularity="distinct",
            base_share=0.0,
            ranks=str(self.rank),
            prompt_len=f"fixed:{self.prefix_len + self.suffix_len}",
            output_len=f"fixed:{self.output_len}",
            arrivals=f"closed:{self.requests}",
        )

    def serve_args(self, prefix_caching: bool = True) -> ServeBenchArgs:
        return ServeBenchArgs(
            workload=self.spec(),
            device=self.device,
            model=self.model,
            random_layers=None if self.smoke else self.random_layers,
            random_shape=self.random_shape,
            max_num_seqs=self.requests,
            max_num_batched_tokens=self.max_num_batched_tokens,
            dtype=self.dtype,
            prefix_caching=prefix_caching,
            smoke=self.smoke,
            hf_compare=self.fp32_reference and not self.smoke and self.model is None,
            workdir=self.workdir,
        )


class _Prompts:
    """The system prompt (from the seed) and each request's suffix (from the run's suffix seed)."""

    def __init__(self, args: PrefixBenchArgs, vocab: int) -> None:
        rng = random.Random(args.seed * 7_919 + 17)
        self.system = [rng.randrange(4, vocab) for _ in range(args.prefix_len)]
        self.suffix_len = args.suffix_len
        self.vocab = vocab

    def maker(self, suffix_seed: int) -> Any:  # noqa: ANN401 (a prompt_of for Replay)
        def prompt_of(req: WorkloadRequest) -> list[int]:
            suffix = prompt_ids(replace(req, prompt_len=self.suffix_len), self.vocab, suffix_seed)
            return self.system + suffix

        return prompt_of


def run_phase(
    engine: Any,  # noqa: ANN401
    names: list[str],
    workload: Workload,
    prompt_of: Any,  # noqa: ANN401
    salt: Any,  # noqa: ANN401 (a salt, or a salt per request: Replay.cache_salt)
    args: PrefixBenchArgs,
    label: str | None,
) -> dict[str, Any]:
    """One run of `workload` (all requests at once): its TTFT percentiles, per-request TTFT,
    cached tokens and greedy tokens (with top-`logprobs` margins), and `run_in_process`'s summary."""
    from loraplex.bench.serve import Replay, run_in_process

    replay = Replay(prompt_of, salt, args.logprobs, outputs={}, timings=[], label=label)
    summary = run_in_process(engine, names, workload, False, progress=label is not None, replay=replay)
    assert replay.outputs is not None and replay.timings is not None
    order = sorted(replay.outputs)
    ttft = {t.index: t.ttft for t in replay.timings}
    cached = [replay.outputs[i].num_cached_tokens for i in order]
    return {
        "ttft_s": percentiles([ttft[i] for i in order]),
        "cached_tokens": {"mean": sum(cached) / len(cached), "min": min(cached), "max": max(cached)},
        "requests": [
            {
                "index": i,
                "adapter": workload.requests[i].adapter,
                "ttft_s": ttft[i],
                "cached_tokens": replay.outputs[i].num_cached_tokens,
                "token_ids": replay.outputs[i].token_ids,
                "margins": [_margin(lp) for lp in replay.outputs[i].logprobs or []],
            }
            for i in order
        ],
        "summary": summary,
    }


def _margin(logprobs: dict[int, float]) -> float | None:
    top = sorted(logprobs.values(), reverse=True)
    return top[0] - top[1] if len(top) > 1 else None


def ttft_ratios(num: dict[str, Any], den: dict[str, Any]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for k in ("p50", "p90", "p99", "mean"):
        a, b = num["ttft_s"][k], den["ttft_s"][k]
        out[k] = a / b if a is not None and b else None
    return out


def _counters(engine: Any) -> dict[str, int]:  # noqa: ANN401
    return {"kernel_compiles": engine.kernel_compiles, "graph_captures": engine.graph_captures}


def _since(engine: Any, before: dict[str, int]) -> dict[str, int]:  # noqa: ANN401
    return {k: v - before[k] for k, v in _counters(engine).items()}


class _Session:
    """The bench's runs on one engine: built on entering, torn down on leaving, its memory given
    back before another is built (the engine froze the collector's view of everything alive at its
    start, itself included)."""

    def __init__(
        self, args: PrefixBenchArgs, workload: Workload, prefix_caching: bool, progress: bool
    ) -> None:
        self.args, self.workload, self.progress = args, workload, progress
        self.engine, self.names, self.adapter_dirs = build_engine(args.serve_args(prefix_caching), workload)
        self.model_dir = str(self.engine.config.model_dir)
        self.prompts = _Prompts(args, self.engine.model_config.vocab_size)
        self.startup = {"warmup_s": self.engine.warmup_s, **_counters(self.engine)}

    def __enter__(self) -> _Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.tiers.close()
        del self.engine, self.names
        gc.unfreeze()
        gc.collect()
        if self.args.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()

    def phase(
        self,
        suffix_seed: int,
        salt: Any,
        shown: str | None = None,
        workload: Workload | None = None,  # noqa: ANN401
    ) -> dict[str, Any]:
        """The workload's requests (all at once) with the suffixes of `suffix_seed`, under `salt`;
        `shown`: the progress bar's name (None: no bar)."""
        label = f"bench prefix ({shown})" if shown is not None and self.progress else None
        prompt_of = self.prompts.maker(suffix_seed)
        return run_phase(
            self.engine, self.names, workload or self.workload, prompt_of, salt, self.args, label
        )

    def reference_requests(self, run: dict[str, Any]) -> list[ReferenceRequest]:
        """A run's requests (the cold run's) for the float32 reference: prompt, greedy tokens and
        adapter name of each."""
        prompt_of = self.prompts.maker(self.args.seed)
        out = []
        for r in run["requests"]:
            req = self.workload.requests[r["index"]]
            adapter = None if req.adapter is None else self.names[req.adapter]
            out.append(ReferenceRequest(prompt_of(req), list(r["token_ids"]), adapter))
        return out

    def rehearse(self) -> float:
        """The untimed rehearsal; its seconds."""
        _say(self.progress, "rehearsal (untimed)")
        t0 = time.perf_counter()
        self.phase(self.args.seed + 1, SALTS["rehearsal"])
        return time.perf_counter() - t0

    def cached_runs(self) -> dict[str, Any]:
        """Rehearsal, cold, prime and warm on the prefix-caching engine, with its startup numbers."""
        engine, seed, n = self.engine, self.args.seed, self.args.num_adapters
        report: dict[str, Any] = {"model": _model(engine), "startup": self.startup}
        report["rehearsal_s"] = self.rehearse()
        before = _counters(engine)
        runs = report["runs"] = {"cold_unshared": self.phase(seed, _own_salt, "cold, nothing shared")}
        runs["cold"] = self.phase(seed, SALTS["cold"], "cold")
        _say(self.progress, f"prime: one request per adapter ({n})")
        prime = generate(replace(self.workload.spec, num_requests=n, arrivals=f"closed:{n}"))
        runs["prime"] = self.phase(seed + 2, SALTS["warm"], workload=prime)
        runs["warm"] = self.phase(seed, SALTS["warm"], "warm")
        report["measured_runs"] = _since(engine, before)
        report["after_startup"] = {k: v - self.startup[k] for k, v in _counters(engine).items()}
        return report


def _own_salt(req: WorkloadRequest) -> str:
    return f"{SALTS['unshared']}/{req.index}"


def _say(progress: bool, what: str) -> None:
    if progress:
        print(f"bench prefix: {what}", file=sys.stderr, flush=True)


def run(args: PrefixBenchArgs, out_dir: Path | None = None, progress: bool = True) -> dict[str, Any]:
    from loraplex.bench.serve import _environment

    workload = generate(args.spec())
    report: dict[str, Any] = {
        "bench": "prefix",
        "args": asdict(args),
        "workload": asdict(workload.spec),
        "environment": {**_environment(args.device), **_versions()},
    }
    if args.fp32_reference and args.model is not None:
        raise SystemExit(
            "--fp32-reference loads the model and its adapters from files; with --model the adapters "
            "are random and in memory only: leave --model out (random weights are written to --workdir)"
        )
    _say(progress, "building the engine (startup warm-up)")
    with _Session(args, workload, True, progress) as session:
        report.update(session.cached_runs())
        reference = (
            session.model_dir,
            session.adapter_dirs,
            session.reference_requests(report["runs"]["cold"]),
        )
    runs = report["runs"]
    if args.cache_off:  # the same requests with nothing reused, after a rehearsal of their own
        _say(progress, "building a second engine without a prefix cache")
        with _Session(args, workload, False, progress) as session:
            report["cache_off_startup"] = session.startup
            session.rehearse()
            runs["cache_off"] = session.phase(args.seed, SALTS["cold"], "cache off")
    report["ratios"] = {
        "warm_vs_cold_unshared": ttft_ratios(runs["warm"], runs["cold_unshared"]),
        "warm_vs_cold": ttft_ratios(runs["warm"], runs["cold"]),
    }
    report["outputs"] = {
        "warm_vs_cold": compare_tokens(runs["cold"], runs["warm"]),
        "cold_unshared_vs_cold": compare_tokens(runs["cold"], runs["cold_unshared"]),
    }
    if "cache_off" in runs:
        report["ratios"]["warm_vs_cache_off"] = ttft_ratios(runs["warm"], runs["cache_off"])
        report["ratios"]["cold_vs_cache_off"] = ttft_ratios(runs["cold"], runs["cache_off"])
        report["outputs"]["cache_off_vs_cold"] = compare_tokens(runs["cold"], runs["cache_off"])
    if args.fp32_reference:  # after the engines are gone: the float32 model needs their memory
        _say(progress, "transformers + PEFT in float32 along the cold run's tokens")
        refs = reference_steps(*reference, args.device)
        report["fp32_reference"] = compare_with_reference(runs["cold"], runs["warm"], refs)
        report["fp32_reference"]["by_run"] = agreement_by_run(runs, refs)
        for req, ref in zip(runs["cold"]["requests"], refs, strict=True):
            req["reference"] = [[token, round(margin, 4)] for token, margin in ref]
    same = report["outputs"]["warm_vs_cold"]
    decided = report.get("fp32_reference")
    report["target"] = {
        "ttft_ratio_max": TARGET_RATIO,
        # against the cold run that shares nothing (the target), the cold run that shares blocks
        # within itself, and no prefix cache
        "ttft_ratio_pass": _passes(report["ratios"]["warm_vs_cold_unshared"]),
        "ttft_ratio_pass_vs_shared_cold": _passes(report["ratios"]["warm_vs_cold"]),
        "ttft_ratio_pass_vs_cache_off": _passes(report["ratios"].get("warm_vs_cache_off")),
        "identical_outputs": same["identical"] == same["requests"],
        # the bf16 rule: identical wherever the float32 reference's margin decides
        "identical_where_decided": None if decided is None else decided["pass"],
    }
    if out_dir is not None:
        from loraplex.bench.prefix_report import write_report

        write_report(report, out_dir)
    return report


def _passes(ratios: dict[str, float | None] | None) -> bool | None:
    """Every statistic's ratio within the target (None: no such baseline)."""
    if ratios is None:
        return None
    return all(v is not None and v <= TARGET_RATIO for v in ratios.values())


def _model(engine: Any) -> dict[str, Any]:  # noqa: ANN401
    mc = engine.model_config
    return {
        "architecture": mc.architecture,
        "layers": mc.num_hidden_layers,
        "hidden_size": mc.hidden_size,
        "intermediate_size": mc.intermediate_size,
        "attention_heads": mc.num_attention_heads,
        "kv_heads": mc.num_key_value_heads,
        "head_dim": mc.head_dim,
        "vocab_size": mc.vocab_size,
        "dtype": engine.config.dtype,
        "block_size": engine.config.cache.block_size,
        "max_num_seqs": engine.config.scheduler.max_num_seqs,
        "max_num_batched_tokens": engine.config.scheduler.step_token_budget,
    }


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for package in ("loraplex", "triton", "transformers"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return out

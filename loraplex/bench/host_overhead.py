"""Host overhead of a pure decode step: `Engine.step()` with the model forward stubbed out.

    python -m loraplex.bench.host_overhead [--batch 64] [--vocab 256] [--steps 300] [--profile]
    python -m loraplex.bench.host_overhead --device cuda --vocab 128256 --forward-ms 7

The engine of the engine bench (tiny random Llama, no tokenizer) is filled with `batch` requests
of `context`-token prompts and stepped until every request decodes. `runner.run` is replaced by a
stub that returns precomputed logits (on the engine's device) for the rows that sample, so the
model never runs, and the median wall time of `Engine.step()` less the stub's own host time is
the host work around the forward: scheduling, sampling, stop checks, deltas and StepStats. With
`--forward-ms` (CUDA only) the stub also queues a GPU sleep of that length, standing in for the
forward's GPU time; `exposed` is then the step time minus that: the host work the GPU does not
hide. Each case varies the sampling params (greedy / sampled, logprobs, stop strings, a
tokenizer); the engine bench's case is the first.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import time
from dataclasses import MISSING, fields
from typing import Any

import torch

from loraplex.bench.random_weights import random_model, tiny_hf_dict
from loraplex.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from loraplex.engine.engine import Engine
from loraplex.engine.model_runner import ForwardResult
from loraplex.lora.metadata import BASE_SLOT, LoRABatchMetadata
from loraplex.types import SamplingParams

CASES: dict[str, dict[str, Any]] = {
    "greedy (bench)": dict(temperature=0.0, ignore_eos=True),
    "greedy, logprobs=1": dict(temperature=0.0, ignore_eos=True, logprobs=1),
    "sampled t=0.8 p=0.9": dict(temperature=0.8, top_p=0.9, ignore_eos=True),
    "sampled, seeded": dict(temperature=0.8, top_p=0.9, ignore_eos=True, seed=1),
    "sampled, logprobs=5": dict(temperature=0.8, top_p=0.9, ignore_eos=True, logprobs=5),
    # stop strings the stand-in tokenizer never produces (searched every step, never found)
    "greedy, stop strings, tokenizer": dict(temperature=0.0, ignore_eos=True, stop=("~~", "\n\n")),
}


class _CharTokenizer:
    """A stand-in tokenizer: one character in '!'..'z' per token id (decode only)."""

    eos_token_id = None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(33 + t % 90) for t in ids)


def build_engine(batch: int, context: int, vocab: int, steps: int, device: str = "cpu") -> Engine:
    hf = tiny_hf_dict()
    hf["vocab_size"] = vocab
    mc = ModelConfig.from_hf_dict(hf)
    model = random_model(mc, torch.float32, torch.device(device), 0)
    block = 16
    max_len = context + steps + 64
    config = EngineConfig(
        model_dir="<random weights>",
        dtype="float32",
        device=device,
        seed=0,
        cache=CacheConfig(block_size=block, num_blocks=batch * -(-max_len // block), max_model_len=max_len),
        scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max(2048, batch)),
    )
    return Engine(config, model=model)


def _stub_runner(engine: Engine, logits: torch.Tensor, forward_ms: float, spent: list[float]) -> Any:
    """runner.run without the model: `logits` rows for the completing chunks, nothing else. Appends
    its own host time to `spent` (subtracted from the step's: it stands in for the runner's)."""
    values: dict[str, Any] = {
        "prompt_logits": logits[:0],
        "prompt_rows": (),
        "num_adapters": 0,
        "lora_meta": LoRABatchMetadata.build([BASE_SLOT], engine.lora_table, logits.device),
    }
    present = {f.name for f in fields(ForwardResult)}
    required = {f.name for f in fields(ForwardResult) if f.default is MISSING}
    fixed = {k: v for k, v in values.items() if k in present}
    assert required <= fixed.keys() | {"sample_logits", "sample_chunks"}, required
    cycles: float = 0
    if forward_ms > 0:
        cycles = _sleep_cycles_per_ms(logits.device) * forward_ms

    def run(plan: Any, slots: Any, **_: Any) -> ForwardResult:  # noqa: ARG001 (the runner's signature)
        t0 = time.perf_counter()
        if cycles:
            torch.cuda._sleep(int(cycles))
        sample = tuple(i for i, c in enumerate(plan.chunks) if c.completes)
        result = ForwardResult(sample_logits=logits[: len(sample)], sample_chunks=sample, **fixed)
        spent.append(time.perf_counter() - t0)
        return result

    return run


def _sleep_cycles_per_ms(device: torch.device) -> float:
    torch.cuda._sleep(1_000_000)  # warm up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    torch.cuda.synchronize(device)
    return 20_000_000 / start.elapsed_time(end)


def measure(
    case: dict[str, Any],
    batch: int = 64,
    context: int = 64,
    vocab: int = 256,
    steps: int = 300,
    tokenizer: bool = False,
    profile: bool = False,
    device: str = "cpu",
    forward_ms: float = 0.0,
) -> dict[str, Any]:
    """Median / mean / min ms per decode step with the forward stubbed (and cProfile stats)."""
    engine = build_engine(batch, context, vocab, steps, device)
    if tokenizer:
        engine.tokenizer = engine.stop.tokenizer = _CharTokenizer()
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=steps + 40, **case)
    for i in range(batch):
        engine.add_request(f"r{i}", torch.randint(0, vocab, (context,), generator=gen).tolist(), params)
    logits = (torch.randn(batch, vocab, generator=gen) * 3).to(device)
    spent: list[float] = []
    engine.runner.run = _stub_runner(engine, logits, forward_ms, spent)  # type: ignore[method-assign]
    decoding: set[str] = set()
    while len(decoding) < batch:
        decoding.update(d.request_id for d in engine.step())
    for _ in range(10):
        engine.step()
    # A full collection now, not one inside the timed steps: building the model leaves enough new
    # objects that the first full collection (tens of ms) would land there.
    gc.collect()
    spent.clear()
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    times = []
    prof = cProfile.Profile() if profile else None
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        deltas = engine.step()
        if prof is not None:
            prof.disable()
        sync()
        times.append(time.perf_counter() - t0)
        stats = engine.last_stats
        if len(deltas) != batch or stats is None or stats.num_decode_rows != batch:
            reasons = sorted({str(d.finish_reason) for d in deltas})
            raise RuntimeError(f"not a pure decode step: {len(deltas)} deltas {reasons}, {stats}")
    times = [t - s for t, s in zip(times, spent, strict=True)]
    out: dict[str, Any] = {
        "median_ms": statistics.median(times) * 1e3,
        "mean_ms": statistics.fmean(times) * 1e3,
        "min_ms": min(times) * 1e3,
    }
    if prof is not None:
        out["profile"] = pstats.Stats(prof)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--forward-ms", type=float, default=0.0, help="GPU sleep standing in for the forward")
    ap.add_argument("--profile", action="store_true", help="cProfile each case (top 25 by tottime)")
    ap.add_argument("--case", action="append", help="only these cases (substring match)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(
        f"batch {args.batch}, vocab {args.vocab}, {args.steps} steps, device {args.device}, "
        f"{torch.get_num_threads()} thread(s), forward {args.forward_ms} ms"
    )
    for name, case in CASES.items():
        if args.case and not any(c in name for c in args.case):
            continue
        r = measure(
            case,
            args.batch,
            args.context,
            args.vocab,
            args.steps,
            tokenizer="tokenizer" in name,
            profile=args.profile,
            device=args.device,
            forward_ms=args.forward_ms,
        )
        line = f"{name:34s} median {r['median_ms']:.3f} ms  mean {r['mean_ms']:.3f}  min {r['min_ms']:.3f}"
        if args.forward_ms:
            line += f"  exposed {r['median_ms'] - args.forward_ms:.3f}"
        print(line)
        if args.profile:
            r["profile"].sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()

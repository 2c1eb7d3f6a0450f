"""How many Triton specializations (separate compilations) the LoRA kernels need, counted on the
CPU with Triton's own specialization keys: `JITFunction.run` is replaced by a function that binds
the arguments as the JIT does for an sm_90 device and records the cache key; nothing compiles.

    python benchmarks/lora_specializations.py decode [--max-batch 64] [--max-rank 64]
    python benchmarks/lora_specializations.py eager [--steps 200]
    python benchmarks/lora_specializations.py warmup [--max-batch 64] [--max-rank 64] [--max-segments 64]

`decode`: every LoRA key the engine captures at startup (`StaticStepRunner.warm_up`), on
Llama-3-8B shapes. `eager`: random mixed steps (1-4 prefill chunks of 1-512 rows, up to 63 decode
rows, 20% base rows, 24 adapters of ranks 8-64 over 5 target sets). Prints the variants per
kernel and, for each kernel, the arguments whose specialization differs between launches.
`warmup`: everything the engine's startup warm-up compiles (`lora/warmup.py` eager steps, then the
decode graph keys), then random eager steps after it (0-4 prefill chunks of 1-512 rows and 1-63
decode rows, 20% base rows, adapters of every rank 1..max-rank over 5 target sets): the keys they
add must be 0.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)  # the JIT's binder, not the interpreter
_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE.parent), str(_HERE)]

import torch  # noqa: E402
from lora_kernel_code import H200_SMS, LLAMA3_8B  # noqa: E402

from loraplex.lora.spec_keys import KeyCounter  # noqa: E402

GROUP_TARGETS = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}
TARGET_SETS = [None, ("q", "v"), ("o",), ("gate", "up", "down"), ("q", "k", "v", "o")]


def report(counter: KeyCounter) -> None:
    """Variants per kernel and, for each kernel, the arguments whose specialization differs."""
    import loraplex.lora.triton_kernels as kernels

    for name, keys in sorted(counter.keys.items()):
        print(f"{name}: {len(keys)} variants, {len({o for _, o in keys})} option sets")
        params = [p.name for p in getattr(kernels, name).params]
        specs = [s for s, _ in keys]
        for i, param in enumerate(params):
            values = sorted({str(s[i]) for s in specs})
            if len(values) > 1:
                more = ", ..." if len(values) > 4 else ""
                print(f"    {param}: {len(values)} ({', '.join(values[:4])}{more})")
    print(f"total {counter.total}")


def _table(slots: int, ranks: tuple[int, ...] = (8, 16, 32, 64)) -> Any:
    from loraplex.lora.weights import AdapterWeights, LoRAPair, LoRASlotTable

    table = LoRASlotTable(1, torch.bfloat16)
    for slot in range(slots):
        rank, targets = ranks[slot % len(ranks)], TARGET_SETS[slot % len(TARGET_SETS)]
        pairs = {}
        for group, (d_in, widths) in LLAMA3_8B.items():
            for t, d_out in zip(GROUP_TARGETS[group], widths, strict=True):
                if targets is None or t in targets:
                    a = torch.empty(rank, d_in, dtype=torch.bfloat16)  # never read: nothing runs
                    pairs[(0, t)] = LoRAPair(a, torch.empty(d_out, rank, dtype=torch.bfloat16), 2.0)
        table.set(slot, AdapterWeights(pairs))
    return table


def _forward(backend: Any, meta: Any, table: Any, rows: int) -> None:
    from loraplex.lora.step import LoRAContext

    LoRAContext.begin(meta, table, backend)
    for group, (d_in, widths) in LLAMA3_8B.items():
        x = torch.empty(rows, d_in, dtype=torch.bfloat16)
        y = torch.empty(rows, sum(widths), dtype=torch.bfloat16)
        offsets = [0]
        for w in widths:
            offsets.append(offsets[-1] + w)
        backend.apply(y, x, meta, table, 0, group, offsets)


def decode(max_batch: int, max_rank: int) -> None:
    from loraplex.engine.cuda_graphs import batch_bucket
    from loraplex.lora.graph_inputs import LoRAGraphInputs
    from loraplex.lora.ops_triton import TritonLoRABackend

    backend, table, n = TritonLoRABackend(), _table(4), 0
    for b in sorted({bb for i in range(1, max_batch + 1) if (bb := batch_bucket(i, max_batch))}):
        host = torch.zeros(LoRAGraphInputs.words(b), dtype=torch.int64)
        inputs = LoRAGraphInputs(b, host.numpy(), host, table, backend)
        for key in inputs.keys(max_rank):
            inputs.pack_empty(key)
            _forward(backend, inputs.metadata(key), table, b)
            n += 1
    print(f"{n} LoRA graph keys (graphs up to batch {max_batch}, ranks up to {max_rank})")


def eager(steps: int) -> None:
    from loraplex.lora.metadata import LoRABatchMetadata
    from loraplex.lora.ops_triton import TritonLoRABackend

    backend, table, rng = TritonLoRABackend(), _table(24), random.Random(0)
    for _ in range(steps):
        runs: list[tuple[int, int, int]] = []
        row = 0
        for n in [rng.randint(1, 512) for _ in range(rng.randint(1, 4))] + [1] * rng.randint(0, 63):
            runs.append((-1 if rng.random() < 0.2 else rng.randrange(24), row, n))
            row += n
        meta = LoRABatchMetadata.build_runs(runs, row, table, "cpu")
        if meta.num_segments:
            _forward(backend, meta, table, row)
    print(f"{steps} random eager steps")


def _random_eager(steps: int, max_rank: int, seed: int) -> None:
    """Random eager steps over adapters of random ranks 1..max_rank and target sets."""
    from loraplex.lora.metadata import LoRABatchMetadata
    from loraplex.lora.ops_triton import TritonLoRABackend

    rng = random.Random(seed)
    backend = TritonLoRABackend()
    ranks = list(range(1, max_rank + 1))
    rng.shuffle(ranks)
    table = _table(max_rank, tuple(ranks))  # one adapter of every rank, over the target sets
    n_slots = max_rank
    for _ in range(steps):
        runs: list[tuple[int, int, int]] = []
        row = 0
        for n in [rng.randint(1, 512) for _ in range(rng.randint(0, 4))] + [1] * rng.randint(1, 63):
            runs.append((-1 if rng.random() < 0.2 else rng.randrange(n_slots), row, n))
            row += n
        meta = LoRABatchMetadata.build_runs(runs, row, table, "cpu")
        if meta.num_segments:
            _forward(backend, meta, table, row)


def warmup(max_batch: int, max_rank: int, max_segments: int, steps: int) -> None:
    from loraplex.lora.ops_triton import TritonLoRABackend
    from loraplex.lora.warmup import EagerWarmup

    counter = KeyCounter()
    with counter.installed():
        warm = EagerWarmup(TritonLoRABackend(), dict(LLAMA3_8B), torch.bfloat16, torch.device("cpu"),
                           max_rank, max_segments)  # fmt: skip
        for step in warm.steps:
            warm.run(step)
        eager_keys = counter.total
        decode(max_batch, max_rank)
        report(counter)
        print(f"warm-up: {len(warm.steps)} eager steps ({eager_keys} variants), then the decode graphs: "
              f"{counter.total} variants in all")  # fmt: skip
        before = counter.snapshot()
        _random_eager(steps, max_rank, seed=1)
        new = counter.new_since(before)
    print(
        f"after warm-up, {steps} random eager steps (ranks 1..{max_rank}): {sum(new.values())} new keys {new}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="mode", required=True)
    d = sub.add_parser("decode")
    d.add_argument("--max-batch", type=int, default=64)
    d.add_argument("--max-rank", type=int, default=64)
    e = sub.add_parser("eager")
    e.add_argument("--steps", type=int, default=200)
    w = sub.add_parser("warmup")
    w.add_argument("--max-batch", type=int, default=64)
    w.add_argument("--max-rank", type=int, default=64)
    w.add_argument("--max-segments", type=int, default=64)
    w.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    from loraplex.lora.ops_triton import TritonLoRABackend

    TritonLoRABackend._num_sms = lambda self, device: H200_SMS  # type: ignore[method-assign]
    if args.mode == "warmup":
        warmup(args.max_batch, args.max_rank, args.max_segments, args.steps)
        return
    counter = KeyCounter()
    with counter.installed():
        if args.mode == "decode":
            decode(args.max_batch, args.max_rank)
        else:
            eager(args.steps)
    report(counter)


if __name__ == "__main__":
    main()

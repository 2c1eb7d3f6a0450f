"""How many Triton specializations (separate compilations) the LoRA kernels need, counted on the
CPU with Triton's own specialization keys: `JITFunction.run` is replaced by a function that binds
the arguments as the JIT does for an sm_90 device and records the cache key; nothing compiles.

    python benchmarks/lora_specializations.py decode [--max-batch 64] [--max-rank 64]
    python benchmarks/lora_specializations.py eager [--steps 200]

`decode`: every LoRA key the engine captures at startup (`StaticDecodeRunner.warm_up`), on
Llama-3-8B shapes. `eager`: random mixed steps (1-4 prefill chunks of 1-512 rows, up to 63 decode
rows, 20% base rows, 24 adapters of ranks 8-64 over 5 target sets). Prints the variants per
kernel and, for each kernel, the arguments whose specialization differs between launches.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)  # the JIT's binder, not the interpreter
_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE.parent), str(_HERE)]

import torch  # noqa: E402
from lora_kernel_code import H200_SMS, LLAMA3_8B, Recorder  # noqa: E402

GROUP_TARGETS = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}
TARGET_SETS = [None, ("q", "v"), ("o",), ("gate", "up", "down"), ("q", "k", "v", "o")]


class KeyCounter:
    """Replaces `JITFunction.run`: records (specialization, options) per kernel name."""

    def __init__(self) -> None:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        self.backend = make_backend(GPUTarget("cuda", 90, 32))
        self.keys: dict[str, set[tuple[Any, str]]] = defaultdict(set)
        self._binders: dict[int, Any] = {}

    def install(self) -> None:
        from triton.runtime.jit import JITFunction, create_function_from_signature

        counter = self

        def run(fn: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
            kwargs = Recorder._as_on_cuda(kwargs)
            kwargs.setdefault("debug", False)
            kwargs["instrumentation_mode"] = ""
            binder = counter._binders.get(id(fn))
            if binder is None:
                binder = create_function_from_signature(fn.signature, fn.params, counter.backend)
                counter._binders[id(fn)] = binder
            _, spec, options = binder(*args, **kwargs)
            counter.keys[fn.__name__].add((tuple(spec), str(options)))

        JITFunction.run = run  # type: ignore[method-assign]

    @property
    def total(self) -> int:
        return sum(len(v) for v in self.keys.values())

    def report(self) -> None:
        import loraplex.lora.triton_kernels as kernels

        for name, keys in sorted(self.keys.items()):
            print(f"{name}: {len(keys)} variants, {len({o for _, o in keys})} option sets")
            params = [p.name for p in getattr(kernels, name).params]
            specs = [s for s, _ in keys]
            for i, param in enumerate(params):
                values = sorted({str(s[i]) for s in specs})
                if len(values) > 1:
                    more = ", ..." if len(values) > 4 else ""
                    print(f"    {param}: {len(values)} ({', '.join(values[:4])}{more})")
        print(f"total {self.total}")


def _table(slots: int) -> Any:
    from loraplex.lora.weights import AdapterWeights, LoRAPair, LoRASlotTable

    table = LoRASlotTable(1, torch.bfloat16)
    for slot in range(slots):
        rank, targets = (8, 16, 32, 64)[slot % 4], TARGET_SETS[slot % len(TARGET_SETS)]
        pairs = {}
        for group, (d_in, widths) in LLAMA3_8B.items():
            for t, d_out in zip(GROUP_TARGETS[group], widths, strict=True):
                if targets is None or t in targets:
                    a = torch.zeros(rank, d_in, dtype=torch.bfloat16)
                    pairs[(0, t)] = LoRAPair(a, torch.zeros(d_out, rank, dtype=torch.bfloat16), 2.0)
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
    args = parser.parse_args()
    from loraplex.lora.ops_triton import TritonLoRABackend

    TritonLoRABackend._num_sms = lambda self, device: H200_SMS  # type: ignore[method-assign]
    counter = KeyCounter()
    counter.install()
    if args.mode == "decode":
        decode(args.max_batch, args.max_rank)
    else:
        eager(args.steps)
    counter.report()


if __name__ == "__main__":
    main()

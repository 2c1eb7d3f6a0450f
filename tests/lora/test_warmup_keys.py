"""The startup warm-up's eager LoRA steps (`lora/warmup.py`) reach every kernel specialization a
random eager workload reaches: counted with Triton's own keys for an sm_90 device
(`lora/spec_keys.py`, nothing compiles or runs), so this checks the logic on the CPU; the GPU
test (`tests/engine/test_warmup_gpu.py`) checks the real compile counter."""

from __future__ import annotations

import os
import random

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("counts the compiler's keys (the interpreter's launch path differs)", allow_module_level=True)

from loraplex.lora.metadata import LoRABatchMetadata  # noqa: E402
from loraplex.lora.ops_triton import TritonLoRABackend  # noqa: E402
from loraplex.lora.spec_keys import KeyCounter  # noqa: E402
from loraplex.lora.step import LoRAContext  # noqa: E402
from loraplex.lora.warmup import EagerWarmup, _adapter  # noqa: E402
from loraplex.lora.weights import LoRASlotTable  # noqa: E402

# small shapes with the 8B's structure (k/v narrower than q; gate_up the widest group)
SHAPES = {
    "qkv": (256, (256, 64, 64)),
    "o": (256, (256,)),
    "gate_up": (256, (1024, 1024)),
    "down": (1024, (256,)),
}
TARGET_SETS = [("q", "v"), ("o",), ("gate", "up", "down"), ("k",), ("q", "k", "v", "o", "gate", "up", "down")]
MAX_RANK, MAX_SEGMENTS = 64, 12


class _Backend(TritonLoRABackend):
    def _num_sms(self, device: torch.device) -> int:
        return 8  # a small GPU: the split plans change over the segment counts tested


def _forward(backend: TritonLoRABackend, meta: LoRABatchMetadata, table: LoRASlotTable, rows: int) -> None:
    LoRAContext.begin(meta, table, backend)
    for group, (d_in, widths) in SHAPES.items():
        offsets = [0]
        for w in widths:
            offsets.append(offsets[-1] + w)
        x = torch.empty(rows, d_in, dtype=torch.bfloat16)
        backend.apply(torch.empty(rows, offsets[-1], dtype=torch.bfloat16), x, meta, table, 0, group, offsets)


def test_random_eager_steps_after_warmup_add_no_keys() -> None:
    counter = KeyCounter()
    with counter.installed():
        warm = EagerWarmup(_Backend(), SHAPES, torch.bfloat16, torch.device("cpu"), MAX_RANK, MAX_SEGMENTS)
        for step in warm.steps:
            warm.run(step)
        warmed = counter.snapshot()
        assert counter.total > 0
        rng = random.Random(0)
        # adapters registered "after startup": random ranks 1..64 (odd ones too), random target sets
        table = LoRASlotTable(1, torch.bfloat16)
        for slot in range(MAX_SEGMENTS):
            table.set(
                slot,
                _adapter(
                    SHAPES,
                    rng.choice(TARGET_SETS),
                    rng.randint(1, MAX_RANK),
                    torch.bfloat16,
                    torch.device("cpu"),
                ),
            )
        backend = _Backend()
        for _ in range(150):
            runs, row = [], 0
            # long chunks (one popular adapter's prefill: 33-256 rows still take the decode tiling
            # when few) and decode rows
            chunks = [rng.randint(2, 300) for _ in range(rng.randint(0, 3))]
            chunks += [1] * rng.randint(0 if chunks else 1, 20)
            for n in chunks:
                runs.append((-1 if rng.random() < 0.2 else rng.randrange(MAX_SEGMENTS), row, n))
                row += n
            meta = LoRABatchMetadata.build_runs(runs, row, table, "cpu")
            if meta.num_segments:
                _forward(backend, meta, table, row)
        assert counter.new_since(warmed) == {}


def test_long_segments_of_a_small_engine_add_no_keys() -> None:
    """An engine of two segments at most: one or two long segments (a popular adapter's prefill
    chunk, 33-256 rows: the decode tiling up to 16 row tiles) reach only warmed keys."""
    counter = KeyCounter()
    with counter.installed():
        warm = EagerWarmup(_Backend(), SHAPES, torch.bfloat16, torch.device("cpu"), 16, 2)
        for step in warm.steps:
            warm.run(step)
        warmed = counter.snapshot()
        table = LoRASlotTable(1, torch.bfloat16)
        for slot in range(2):
            table.set(slot, _adapter(SHAPES, TARGET_SETS[-1], 16, torch.bfloat16, torch.device("cpu")))
        backend = _Backend()
        for rows in [(64,), (129,), (256,), (257,), (40, 70), (65, 65), (300, 1)]:
            runs, row = [], 0
            for slot, n in enumerate(rows):
                runs.append((slot, row, n))
                row += n
            _forward(backend, LoRABatchMetadata.build_runs(runs, row, table, "cpu"), table, row)
        assert counter.new_since(warmed) == {}

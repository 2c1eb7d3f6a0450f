"""Startup warm-up: every Triton kernel specialization and CUDA graph a server can need, compiled
and captured before the first request, with a progress bar and the time reported
(`Engine.warmup_s`, metric `loraplex_startup_warmup_seconds`). Afterwards
`Engine.kernel_compiles` and `Engine.graph_captures` stay flat (tests/engine/test_warmup_gpu.py).

Three parts:
1. eager LoRA steps (`lora/warmup.py`): every (group, rank tile up to `max_rank`, tiling, split
   bucket, row-loop) variant an eager step can reach, on a private table and backend;
2. two eager base-model forwards that write nothing to the KV cache (a prefill chunk beside decode
   rows): the attention and fused kernels' eager variants;
3. the decode graphs (`StaticDecodeRunner.warm_up`), which also compile the decode kernels'
   graph variants (per-step segment tables).
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from loraplex.config import EngineConfig
    from loraplex.engine.engine import Engine


def warm_up(engine: Engine, config: EngineConfig, progress: bool) -> float:
    """Seconds spent warming everything up (0.0 off CUDA or with `capture_at_startup` off)."""
    if engine.device.type != "cuda" or not config.graphs.capture_at_startup:
        return 0.0
    t0 = time.perf_counter()
    compiles0 = engine.kernel_compiles
    steps = warm_eager_lora(engine, config, progress)
    _warm_base_forward(engine)
    graphs = 0
    static = engine.runner.static_decode
    if static is not None and static.capture:
        graphs = static.warm_up(config.lora.max_rank, progress)
    torch.cuda.synchronize(engine.device)
    seconds = time.perf_counter() - t0
    if progress:
        compiled = engine.kernel_compiles - compiles0
        print(
            f"warm-up: {steps} eager LoRA steps, {compiled} kernel compilations, {graphs} decode graphs "
            f"in {seconds:.1f} s",
            file=sys.stderr,
        )
    return seconds


def warm_eager_lora(engine: Engine, config: EngineConfig, progress: bool) -> int:
    """Run `lora.warmup.eager_steps` for the engine's model and limits; the steps run."""
    from loraplex.lora.ops_triton import TritonLoRABackend
    from loraplex.lora.warmup import EagerWarmup, group_shapes

    if not isinstance(engine.lora_backend, TritonLoRABackend):
        return 0
    max_segments = min(config.scheduler.max_num_seqs, config.lora.max_resident)
    shapes = group_shapes(engine.model)
    warm = EagerWarmup(
        engine.lora_backend, shapes, engine.lora_table.dtype or torch.bfloat16, engine.device,
        config.lora.max_rank, max_segments,
    )  # fmt: skip
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(warm.steps), desc="compiling eager LoRA kernels", unit="step")
    for step in warm.steps:
        warm.run(step)
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    return len(warm.steps)


@torch.inference_mode()
def _warm_base_forward(engine: Engine) -> None:
    """Base-only eager forwards: a 40-token prefill chunk beside two decode rows, then a prefill
    chunk alone. KV slots -1 (no write); the rows attend to block 0, whatever it holds, and the
    output is dropped."""
    from loraplex.layers.attention_metadata import AttentionMetadata

    bs = engine.kv.block_size
    for lens in ((40, 1, 1), (40,)):
        positions: list[int] = []
        query_start, context = [0], []
        for n in lens:
            positions += list(range(n)) if n > 1 else [8]
            query_start.append(query_start[-1] + n)
            context.append(n if n > 1 else 9)
        tables = [[0] * -(-c // bs) for c in context]
        attn = AttentionMetadata.build(
            positions, [-1] * len(positions), query_start, context, tables, bs, engine.device
        )
        ids = torch.zeros(len(positions), dtype=torch.int64, device=engine.device)
        hidden = engine.model(ids, attn, engine.kv.k, engine.kv.v, None)
        engine.model.logits(hidden[-1:]).float()

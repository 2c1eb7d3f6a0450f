"""Startup warm-up: every Triton kernel specialization and CUDA graph a server can need, compiled
and captured before the first request, with a progress bar and the time reported
(`Engine.warmup_s`, metric `loraplex_startup_warmup_seconds`). Afterwards
`Engine.kernel_compiles` and `Engine.graph_captures` stay flat (tests/engine/test_warmup_gpu.py).

Three parts:
1. eager LoRA steps (`lora/warmup.py`): every (group, rank tile up to `max_rank`, tiling, split
   bucket, row-loop) variant an eager step can reach, on a private table and backend;
2. two eager base-model forwards that write nothing to the KV cache (a prefill chunk beside decode
   rows): the attention and fused kernels' eager variants;
3. the CUDA graphs of decode and mixed steps (`StaticStepRunner.warm_up`), which also compile
   the kernels' graph variants (per-step segment tables, the prefill tile map).
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
    static = engine.runner.static_steps
    if static is not None and static.capture:
        graphs = static.warm_up(config.lora.max_rank, progress)
    torch.cuda.synchronize(engine.device)
    seconds = time.perf_counter() - t0
    if progress:
        compiled = engine.kernel_compiles - compiles0
        print(
            f"warm-up: {steps} eager LoRA steps, {compiled} kernel compilations, {graphs} CUDA graphs "
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
    _warm_decode_splits(engine)


def _warm_decode_splits(engine: Engine) -> None:
    """The eager decode attention's split-K factor follows the step's decode rows and context
    length (`decode_splits`): compile every factor it can pick, on one decode row per distinct
    (sliding window) layer kind, its K/V not written. q, k and v are views of one qkv row as in
    the model, so the kernels see the strides they see when serving."""
    from loraplex.layers.attention_metadata import AttentionMetadata
    from loraplex.layers.attention_tiling import tiling_for
    from loraplex.layers.attention_triton import paged_attention_triton

    cfg = engine.model_config
    bs = engine.kv.block_size
    attn = AttentionMetadata.build([8], [-1], [0, 1], [9], [[0]], bs, engine.device, for_kernels=True)
    q_size, kv_size = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    dtype = engine.kv.k[0].dtype
    qkv = torch.zeros(1, q_size + 2 * kv_size, dtype=dtype, device=engine.device)
    q = qkv[:, :q_size].view(1, cfg.num_attention_heads, cfg.head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(1, cfg.num_key_value_heads, cfg.head_dim)
    v = qkv[:, q_size + kv_size :].view(1, cfg.num_key_value_heads, cfg.head_dim)
    tiling = tiling_for(cfg.head_dim)
    for window in sorted(set(cfg.layer_sliding_windows), key=lambda w: -1 if w is None else w):
        splits = 1
        while splits <= tiling.max_splits:
            layer = cfg.layer_sliding_windows.index(window)
            paged_attention_triton(
                q, k, v, engine.kv.k[layer], engine.kv.v[layer], attn, cfg.head_dim**-0.5, window,
                tiling, splits,
            )  # fmt: skip
            splits *= 2

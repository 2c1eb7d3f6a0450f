"""The CUDA-graph replay counter: counted for steps the engine ran as graph replays, not for steps
that only used the static buffers eagerly (the CPU test mode) or ran eagerly."""

from __future__ import annotations

import re
from types import SimpleNamespace

import torch

from loraplex.adapters.device_pool import AdapterPool
from loraplex.adapters.host_cache import HostCache
from loraplex.adapters.residency import AdapterResidency
from loraplex.adapters.tiers import AdapterTiers
from loraplex.engine.stats import StepStats
from loraplex.lora.weights import LoRASlotTable
from loraplex.server.metrics import ServerMetrics


def _stats(static_replay: bool) -> StepStats:
    return StepStats(
        num_rows=4,
        rows_per_request={},
        num_prefill_rows=0,
        num_decode_rows=4,
        num_base_rows=4,
        num_lora_segments=0,
        lora_op_calls=0,
        kv_blocks_used=1,
        num_running=4,
        num_waiting=0,
        preempted=(),
        static_replay=static_replay,
    )


def _replays(metrics: ServerMetrics) -> float:
    text = metrics.render().decode()
    return float(re.search(r"^loraplex_cuda_graph_replays_total (\S+)$", text, re.M).group(1))


def _tiers() -> AdapterTiers:
    """Real, empty adapter tiers (a 1 KiB pool) for the fake engine."""
    table = LoRASlotTable(1, torch.float32)
    pool = AdapterPool(1024, torch.float32, "cpu")
    residency = AdapterResidency(table, torch.float32, "cpu", pool)
    return AdapterTiers(residency, pool, HostCache(0, torch.float32), lambda: ([], []))


def test_graph_replays_counted_only_for_real_replays() -> None:
    metrics = ServerMetrics()
    engine = SimpleNamespace(
        scheduler=SimpleNamespace(running=[1, 2, 3, 4], waiting=[]),
        pool=SimpleNamespace(num_used=1, num_blocks=8),
        last_stats=_stats(True),
        graph_replays=1,
        graph_captures=3,
        kernel_compiles=5,
        warmup_s=1.5,
        tiers=_tiers(),
        prefix_cache=None,  # (the prefix-cache series have their own test)
        config=SimpleNamespace(scheduler=SimpleNamespace(step_token_budget=64)),  # the step budget
    )
    metrics.on_step(engine)
    metrics.on_step(engine)
    assert _replays(metrics) == 2
    text = metrics.render().decode()
    assert re.search(r"^loraplex_cuda_graphs_captured 3\.0$", text, re.M)
    assert re.search(r"^loraplex_kernel_compiles 5\.0$", text, re.M)
    assert re.search(r"^loraplex_startup_warmup_seconds 1\.5$", text, re.M)
    assert re.search(r'^loraplex_adapter_tier_budget_bytes\{tier="device"\} 1024\.0$', text, re.M)
    assert re.search(r"^loraplex_adapter_load_failures_total 0\.0$", text, re.M)
    engine.last_stats = _stats(False)  # an eager step
    metrics.on_step(engine)
    engine.last_stats, engine.graph_replays = _stats(True), 0  # static buffers, no graphs (CPU)
    metrics.on_step(engine)
    assert _replays(metrics) == 2

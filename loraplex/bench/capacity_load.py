"""`loraplex bench capacity --load-latency`: how long an adapter load takes until a step may use
its slot, against the time its bytes need at the pinned host -> device bandwidth, both measured
in the same run.

Per rank (r = 8 and 16 by default, all seven targets of every layer): one random adapter, packed
in the host tier as serving keeps it (pinned on CUDA), is loaded into a device pool through the
serving path (`AsyncLoads`: reserve, side-stream copy, event, commit) `repeats` times; each time
runs from `start` until `finished()` reports the slot resident, polled in a tight loop. The
bandwidth is the median time of `pinned.to(device, non_blocking=True)` plus a synchronize over
`bandwidth_mib` MiB; the target is load time <= 1.5 x bytes / bandwidth.

On the CPU (tests, tiny shapes) the copy is synchronous: the same bookkeeping runs, the numbers
mean little.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

GATE = 1.5


class _Done:
    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class ImmediateCopier:
    """The CPU stand-in for the side stream: copies at once, the event already complete."""

    def copy(self, dst: Any, src: Any) -> _Done:  # noqa: ANN401
        from loraplex.adapters.h2d_copy import copy_weights

        copy_weights(dst, src, non_blocking=False)
        return _Done()


def _sync(device: Any) -> None:  # noqa: ANN401
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def h2d_seconds(device: Any, nbytes: int, repeats: int) -> float:  # noqa: ANN401
    """Median seconds of a pinned host tensor of `nbytes` copied to `device` (non_blocking, then
    synchronize)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    src.fill_(1)
    times = []
    for i in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        # (on the CPU `.to` of a CPU tensor is the tensor itself: a copy stands in)
        dst = src.to(device, non_blocking=True) if device.type == "cuda" else src.clone()
        _sync(device)
        if i:  # the first one allocates
            times.append(time.perf_counter() - t0)
        del dst
    return statistics.median(times)


def run(
    device: str = "cuda",
    shape: str = "llama3-8b",
    layers: int | None = None,
    ranks: tuple[int, ...] = (8, 16),
    repeats: int = 20,
    bandwidth_mib: int = 256,
) -> dict[str, Any]:
    import torch

    from loraplex.adapters.device_pool import AdapterPool
    from loraplex.adapters.h2d_copy import AsyncLoads, build_async_loads
    from loraplex.adapters.host_cache import HostCache
    from loraplex.adapters.residency import AdapterResidency
    from loraplex.bench.capacity_sweep import SweepArgs, _model_config
    from loraplex.bench.engine import random_adapter
    from loraplex.lora.layout import TARGETS
    from loraplex.lora.weights import LoRASlotTable

    dev = torch.device(device)
    mc = _model_config(SweepArgs(device=device, shape=shape, layers=layers))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    adapters = {r: random_adapter(mc, r, 7 + r, dtype, dev).weights for r in ranks}
    probe = AdapterPool(1 << 20, dtype, "meta")
    room = 2 * max(probe.footprint(w) for w in adapters.values())
    residency = AdapterResidency(
        LoRASlotTable(mc.num_hidden_layers, dtype), dtype, dev, AdapterPool(room, dtype, dev)
    )
    host = HostCache(1 << 40, dtype, pin=dev.type == "cuda")
    loads = build_async_loads(residency, dev) or AsyncLoads(residency, ImmediateCopier())
    bandwidth = bandwidth_mib * (1 << 20) / h2d_seconds(dev, bandwidth_mib << 20, repeats)
    per_rank = []
    for rank, weights in adapters.items():
        packed = host.host_copy(weights)  # as the host tier keeps it: one pinned buffer
        times = []
        for i in range(repeats + 1):
            revision = f"r{rank}-{i}"
            _sync(dev)
            t0 = time.perf_counter()
            loads.start(revision, packed)
            while not loads.finished():
                pass
            if i:  # the first one warms the side stream and the copy path
                times.append(time.perf_counter() - t0)
            residency.evict(revision)
        nbytes = packed.nbytes
        bound = nbytes / bandwidth
        per_rank.append(
            {
                "rank": rank,
                "bytes": nbytes,
                "load_median_s": statistics.median(times),
                "load_max_s": max(times),
                "same_bytes_pinned_copy_s": h2d_seconds(dev, nbytes, repeats),
                "copy_bound_s": bound,
                "ratio": statistics.median(times) / bound,
                "meets_target": statistics.median(times) <= GATE * bound,
            }
        )
    from loraplex.bench.serve import _environment

    return {
        "device": device,
        "shape": shape,
        "layers": mc.num_hidden_layers,
        "dtype": str(dtype).removeprefix("torch."),
        "targets": list(TARGETS),
        "repeats": repeats,
        "bandwidth_copy_bytes": bandwidth_mib << 20,
        "h2d_bytes_per_s": bandwidth,
        "per_rank": per_rank,
        "environment": _environment(device),
    }

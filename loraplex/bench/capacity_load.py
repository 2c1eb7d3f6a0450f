"""`loraplex bench capacity --load-latency`: how long an adapter load takes until a step may use
its slot, against the time its bytes need at the pinned host -> device bandwidth, both measured
in the same run, and how much host CPU time a load costs.

Per rank (r = 8 and 16 by default, all seven targets of every layer): one random adapter, packed
in the host tier as serving keeps it (pinned on CUDA), is loaded into a device pool that already
holds `others` adapters, through the serving path, `repeats` times. Each load is timed from the
load request until a step could use the slot, i.e. the same sequence a serving step runs:

1. `AsyncLoads.start`: reserve the extent, queue the side-stream copy, claim the slot;
2. the kernels' pointer tables brought up to date (`LoRADeviceTable.sync`, what the next step's
   `begin_step` does: on CUDA it runs while the copy is in flight);
3. `AsyncLoads.finished()` polled in a tight loop until it commits the load (its copy event has
   completed), then the tables synced again (a no-op unless the commit changed them);
4. on CUDA a device synchronize, so the tables' own upload has landed too.

The previous load's eviction is left for step 2 to pick up, as a serving poll that evicts and
loads at once would. The load time (`load_*_s`) is 1 to 4; the host time (`host_*_s`) is the
CPU time of the calls in 1, 2 and 3 except the polls that found the copy still running, and on
the CPU, where the copy is a synchronous memcpy, except the copy itself. The bandwidth is the
median time of `pinned.to(device, non_blocking=True)` plus a synchronize over `bandwidth_mib`
MiB; the target is load time <= 1.5 x bytes / bandwidth.

On the CPU there is no copy engine, so the load time means little, but the host time is the
same Python work the GPU's host does per load.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

GATE = 1.5
_PHASES = ("to_copy_queued_s", "start_returned_s", "tables_synced_s", "committed_s", "copy_gpu_s")


class _Done:
    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class ImmediateCopier:
    """The CPU stand-in for the side stream: copies at once (timed: `seconds`), the event already
    complete."""

    seconds = 0.0

    def copy(self, dst: Any, src: Any) -> _Done:  # noqa: ANN401
        from loraplex.adapters.h2d_copy import copy_weights

        t0 = time.perf_counter()
        copy_weights(dst, src, non_blocking=False)
        self.seconds = time.perf_counter() - t0
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
    others: int = 4,
) -> dict[str, Any]:
    import torch

    from loraplex.adapters.device_pool import AdapterPool
    from loraplex.adapters.h2d_copy import AsyncLoads, StreamCopier, build_async_loads
    from loraplex.adapters.host_cache import HostCache
    from loraplex.adapters.residency import AdapterResidency
    from loraplex.bench.capacity_sweep import SweepArgs, _model_config
    from loraplex.bench.random_weights import random_adapter
    from loraplex.lora.layout import TARGETS
    from loraplex.lora.triton_table import LoRADeviceTable
    from loraplex.lora.weights import LoRASlotTable

    dev = torch.device(device)
    mc = _model_config(SweepArgs(device=device, shape=shape, layers=layers))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    host = HostCache(1 << 40, dtype, pin=dev.type == "cuda")
    # as the host tier keeps them: one (pinned) buffer each
    adapters = {r: host.host_copy(random_adapter(mc, r, 7 + r, dtype, dev).weights) for r in ranks}
    probe = AdapterPool(1 << 20, dtype, "meta")
    biggest = max(probe.footprint(w) for w in adapters.values())
    table = LoRASlotTable(mc.num_hidden_layers, dtype, others + 1)
    residency = AdapterResidency(table, dtype, dev, AdapterPool((others + 2) * biggest, dtype, dev))
    for i in range(others):  # resident neighbours: the tables hold other slots, as when serving
        residency.load(f"other-{i}", adapters[ranks[i % len(ranks)]])
    cuda = dev.type == "cuda"
    tables = LoRADeviceTable(torch.device("cuda", torch.cuda.current_device()) if cuda else dev)
    tables.sync(table)
    copier = ImmediateCopier()
    # (not `or`: AsyncLoads is falsy while no load is in flight, which sent CUDA to the CPU copier)
    async_loads = build_async_loads(residency, dev)
    loads = async_loads if async_loads is not None else AsyncLoads(residency, copier)
    bandwidth = bandwidth_mib * (1 << 20) / h2d_seconds(dev, bandwidth_mib << 20, repeats)
    # Where a load's time goes: host timestamps of its phases, and on CUDA the copy's own GPU time
    # (an event the side stream records just before the copy, to the load's completion event).
    queued_at = 0.0
    copy_start: Any = None
    stream_copier = loads.copier if isinstance(loads.copier, StreamCopier) else None
    if stream_copier is not None:

        def before_copy() -> None:
            nonlocal copy_start, queued_at
            queued_at = time.perf_counter()
            copy_start = torch.cuda.Event(enable_timing=True)
            copy_start.record()  # on the side stream: the copier calls this inside its stream

        stream_copier.before_copy = before_copy
    per_rank = []
    for rank, packed in adapters.items():
        times, host_times = [], []
        phases: dict[str, list[float]] = {k: [] for k in _PHASES}
        previous = None
        for i in range(repeats + 1):
            revision = f"r{rank}-{i}"
            if previous is not None:
                residency.evict(previous)  # picked up by this load's table sync, as in serving
            _sync(dev)
            t0 = time.perf_counter()
            loads.start(revision, packed)
            t_started = time.perf_counter()
            copy_end = None
            if stream_copier is not None:  # queued behind the copy on the side stream: its end
                copy_end = torch.cuda.Event(enable_timing=True)
                copy_end.record(stream_copier.stream)
            tables.sync(table)
            t_synced = time.perf_counter()
            host_s = t_synced - t0 - copier.seconds
            while True:
                t1 = time.perf_counter()
                done = loads.finished()
                if done:
                    tables.sync(table)
                    host_s += time.perf_counter() - t1
                    break
            t_committed = time.perf_counter()
            _sync(dev)
            t2 = time.perf_counter()
            assert done == [revision], done
            if i:  # the first one warms the side stream and the copy path
                times.append(t2 - t0)
                host_times.append(host_s)
                if stream_copier is not None:
                    phases["to_copy_queued_s"].append(queued_at - t0)
                phases["start_returned_s"].append(t_started - t0)
                phases["tables_synced_s"].append(t_synced - t0)
                phases["committed_s"].append(t_committed - t0)
                if copy_start is not None and copy_end is not None:
                    phases["copy_gpu_s"].append(copy_start.elapsed_time(copy_end) * 1e-3)
            previous = revision
        if previous is not None:
            residency.evict(previous)
        nbytes = packed.nbytes
        bound = nbytes / bandwidth
        per_rank.append(
            {
                "rank": rank,
                "bytes": nbytes,
                "load_median_s": statistics.median(times),
                "load_max_s": max(times),
                "host_median_s": statistics.median(host_times),
                "host_max_s": max(host_times),
                # medians of the phases: time from the load request until the copy was queued, start()
                # returned, the tables were synced, the load was committed (and tables re-synced);
                # and the copy's own GPU time (CUDA)
                "phases_median_s": {k: statistics.median(v) for k, v in phases.items() if v},
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
        "other_resident_adapters": others,
        "host_time_excludes_cpu_memcpy": dev.type != "cuda",
        "bandwidth_copy_bytes": bandwidth_mib << 20,
        "h2d_bytes_per_s": bandwidth,
        "per_rank": per_rank,
        "environment": _environment(device),
    }

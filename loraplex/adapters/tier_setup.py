"""An engine's adapter tiers, sized and built: the device pool's and host tier's byte budgets
(configured, or defaults from free memory) and the objects of `tiers.py` wired together. Kept apart
from the tiers themselves, which never look at memory sizes or devices beyond what they are given.
"""

from __future__ import annotations

import torch

from loraplex.adapters.device_pool import AdapterPool
from loraplex.adapters.h2d_copy import build_async_loads
from loraplex.adapters.host_cache import HostCache
from loraplex.adapters.residency import AdapterResidency
from loraplex.adapters.tier_room import Demand
from loraplex.adapters.tiers import AdapterTiers
from loraplex.config import LoRAConfig
from loraplex.lora.weights import LoRASlotTable

_CPU_DEVICE_BYTES = 1 << 30  # CPU: host memory; torch.empty commits pages only as adapters use them
_CUDA_FREE_FRACTION = 0.25  # CUDA: of the memory free after the model and the KV cache
_HOST_BYTES = 4 << 30


def default_budgets(
    device: torch.device, device_bytes: int | None, host_bytes: int | None
) -> tuple[int, int]:
    """Device and host tier budgets: the configured ones, else 1 GiB (CPU) or a quarter of the GPU
    memory free once the model and KV cache are allocated (CUDA graphs and activations need the
    rest), and 4 GiB of host memory."""
    if device_bytes is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            device_bytes = int(free * _CUDA_FREE_FRACTION)
        else:
            device_bytes = _CPU_DEVICE_BYTES
    return device_bytes, _HOST_BYTES if host_bytes is None else host_bytes


def build_tiers(
    table: LoRASlotTable, device: torch.device, config: LoRAConfig, demand: Demand
) -> AdapterTiers:
    """An engine's tiers: the device pool preallocated now (so after the model and the KV cache,
    sized from what they left), the host tier (pinned on CUDA), and residency over the pool."""
    assert table.dtype is not None, "the slot table's dtype sizes the pool"
    device_bytes, host_bytes = default_budgets(device, config.adapter_device_bytes, config.adapter_host_bytes)
    pool = AdapterPool(device_bytes, table.dtype, device)
    residency = AdapterResidency(table, table.dtype, device, pool)
    host = HostCache(host_bytes, table.dtype, pin=device.type == "cuda")
    return AdapterTiers(residency, pool, host, demand, copies=build_async_loads(residency, device))

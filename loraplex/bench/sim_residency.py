"""Adapter residency in the simulator: a fixed number of device slots, a host cache, disk behind it.

Deliberately simpler than the engine's tiers (adapters/tiers.py): least recently used eviction
at both levels (the host cache counts the device-resident adapters too: their host copies stay),
and one loader that copies one adapter at a time, so loads queue. A slot is taken when its load
starts; an adapter is `ready` (the scheduler's gate) once its load has finished. An adapter that
running sequences use is never evicted, nor one whose load finished since the last step was planned
(`planned`): as in the engine, where a finished load is placed right before the scheduler runs, a
step is planned with every finished load resident, so the waiting sequence it is for can be
admitted before another load takes its slot. Without that, two loads could keep evicting each
other's finished adapters before any step saw them, and nothing would be admitted again.
Everything is on the simulator's virtual clock; nothing here sleeps.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class SimResidency:
    def __init__(
        self,
        device_slots: int,
        host_slots: int,
        host_load_s: float,
        disk_load_s: float,
        preload: Iterable[int] = (),
    ) -> None:
        if device_slots < 1:
            raise ValueError("device_slots must be >= 1")
        self.device_slots = device_slots
        self.host_slots = host_slots
        self.host_load_s = host_load_s
        self.disk_load_s = disk_load_s
        # adapter -> None, least recently used first (touched by every step that uses it)
        self._device: OrderedDict[int, None] = OrderedDict()
        self._host: OrderedDict[int, None] = OrderedDict()
        self._loading: dict[int, float] = {}  # adapter -> when its load finishes
        self._unseen: set[int] = set()  # loaded since the last step was planned: not evicted
        self._loader_free_at = 0.0
        self.loads = {"host": 0, "disk": 0}
        for a in preload:
            if len(self._device) < device_slots:
                self._device[a] = None
            self._remember_on_host(a)

    def ready(self, adapter: int) -> bool:
        return adapter in self._device

    def tier(self, adapter: int) -> str:
        """Where the adapter is now: device (also while loading), host or disk."""
        if adapter in self._device or adapter in self._loading:
            return "device"
        return "host" if adapter in self._host else "disk"

    def touch(self, adapters: Iterable[int]) -> None:
        for a in adapters:
            if a in self._device:
                self._device.move_to_end(a)

    def advance(self, now: float) -> None:
        """Loads finished by `now` become ready."""
        if not self._loading:
            return
        for a, done in list(self._loading.items()):
            if done <= now:
                del self._loading[a]
                self._device[a] = None
                self._unseen.add(a)

    def planned(self) -> None:
        """A step was planned with the adapters resident now: they may be evicted from here on."""
        self._unseen.clear()

    def next_event(self) -> float | None:
        """When the next load finishes (None: none in flight)."""
        return min(self._loading.values()) if self._loading else None

    def request(self, adapter: int, now: float, in_use: set[int]) -> bool:
        """Start loading `adapter` unless it is resident or loading; False when no slot can be
        freed (every resident adapter is in use or loaded since the last step was planned), so the
        caller tries again after a step."""
        if adapter in self._device or adapter in self._loading:
            return True
        if len(self._device) + len(self._loading) >= self.device_slots:
            victim = next((a for a in self._device if a not in in_use and a not in self._unseen), None)
            if victim is None:
                return False
            del self._device[victim]
            self._remember_on_host(victim)  # its host copy was used last just now
        cost = self.host_load_s if adapter in self._host else self.disk_load_s
        self.loads["host" if adapter in self._host else "disk"] += 1
        start = max(now, self._loader_free_at)
        self._loader_free_at = start + cost
        self._loading[adapter] = start + cost
        self._remember_on_host(adapter)
        return True

    def _remember_on_host(self, adapter: int) -> None:
        self._host[adapter] = None
        self._host.move_to_end(adapter)
        while len(self._host) > self.host_slots:
            self._host.popitem(last=False)

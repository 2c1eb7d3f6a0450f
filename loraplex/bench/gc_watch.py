"""The Python garbage collector's passes over a bench run: how many by generation, the longest,
and how many the engine's pacer ran after a launch (engine/gc_pacing.py), where the device had
work queued. A pass that starts anywhere else holds up the step loop for its whole length, so
the longest of those bounds a step's worst time from the host side."""

from __future__ import annotations

import gc
import time
from typing import Any


class GcWatch:
    def __init__(self, pacer: Any = None) -> None:  # noqa: ANN401 (the engine's GcPacer, if any)
        self._pacer = pacer
        self._paced_before = list(pacer.passes) if pacer is not None else [0, 0, 0]
        self._started: float | None = None
        self.passes = [0, 0, 0]
        self.longest_s = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.longest_s = max(self.longest_s, time.perf_counter() - self._started)
            self.passes[info["generation"]] += 1
            self._started = None

    def __enter__(self) -> GcWatch:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, Any]:
        paced = [0, 0, 0]
        if self._pacer is not None:
            paced = [now - before for now, before in zip(self._pacer.passes, self._paced_before, strict=True)]
        return {"passes": self.passes, "paced": paced, "longest_s": self.longest_s}

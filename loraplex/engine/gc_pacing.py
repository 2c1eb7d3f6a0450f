"""Python's cyclic garbage collector, run where a serving loop can afford it.

The interpreter starts a collection on whichever allocation crosses its threshold: in the step
loop, that can be the moment before a launch, and the device then idles for the whole pass. A
full (generation 2) pass walks every tracked object created since the engine froze its startup
heap (`Engine.__init__`); on the H200, serving the issue workload (3,000 requests, 82 s), one such
pass took 13.4 ms inside a 6.9 ms decode step and made it the run's slowest step (2.9x its
median), with no other cause in the step.

`GcPacer.after_launch` runs, right after a step's device work was queued, the collection the
interpreter would run soon: once the youngest generation's count reaches `share` of its
threshold, the generation the interpreter's next automatic pass would take (by the same counts
and thresholds). One step ahead (`Engine.step_overlapped`) the device then holds the step in
flight and the one just launched, so the pass overlaps their kernels instead of delaying the
next launch (by as much of it as they take: a 23 ms pass still outlasted them on the H200). The
step loop allocates few tracked objects per step, so its own allocations rarely
reach the threshold between two launches; other threads' allocations (the server's event loop)
still can, and their passes stay where the interpreter puts them.

So what a full pass walks must stay small: what `freeze_long_lived` has not frozen. The engine
freezes its heap at the end of startup, and again after each adapter registration: on the H200
the 32 bench adapters' weights, registered after startup (14,432 tensors, 7,168 pair records and
their lists and dicts, ~51k tracked objects), made every full pass take 9-13 ms. Adapters loaded
at runtime are not frozen; they leave a few objects each (`lora/packed.py` shares layouts, and a
host copy keeps no per-pair views).

Nothing here changes the collector's thresholds: with collection disabled (`gc.disable()`, or a
zero threshold) the pacer does nothing, and an application that tunes `gc.set_threshold` is
paced by its own thresholds.
"""

from __future__ import annotations

import gc
import time

DEFAULT_SHARE = 0.5


class GcPacer:
    def __init__(self, share: float = DEFAULT_SHARE) -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share must be in (0, 1], got {share}")
        self.share = share
        self.passes = [0, 0, 0]  # collections run here, by generation
        self.seconds = 0.0  # their time in all

    def due(self) -> int | None:
        """The generation to collect now, or None: the youngest generation's count is under `share`
        of its threshold (or collection is off)."""
        if not gc.isenabled():
            return None
        t0, t1, t2 = gc.get_threshold()
        c0, c1, c2 = gc.get_count()
        if t0 <= 0 or c0 < self.share * t0:
            return None
        # As the interpreter picks: the oldest generation whose count (passes of the generation
        # below since its own last pass) is over its threshold. (It also skips a full pass while
        # few objects await one, which it does not expose: here a full pass runs whenever due.)
        if c2 > t2:
            return 2
        if c1 > t1:
            return 1
        return 0

    def after_launch(self) -> None:
        gen = self.due()
        if gen is None:
            return
        start = time.perf_counter()
        gc.collect(gen)
        self.seconds += time.perf_counter() - start
        self.passes[gen] += 1


def freeze_long_lived() -> None:
    """Collect, then move every object alive now out of the collector's reach (`gc.freeze`): for
    what lives until shutdown or retirement (the model, an adapter's weights). Frozen objects are
    still freed by reference counting when dropped; only a reference cycle alive at the freeze
    that is dropped later stays, so this runs at rare moments (startup, a registration), not per
    request."""
    gc.collect()
    gc.freeze()

"""Making room for a starved sequence whose adapter is not resident, without stopping admissions.

The adaptive policy's starvation bound (`max_wait_ms`, engine/policies.py) puts a sequence that
waited that long first among its tenant's. If its adapter is not on the device and every device
slot is pinned by running sequences, its load has nowhere to go until some adapter's running
sequences have all finished. `SlotDrain` picks one such adapter, the *target* (the running adapter
whose running sequences are the nearest to done by their token limits: the soonest free slot,
kept until the starved sequence is admitted or leaves), and while the starved sequence waits, the
admission pass:

- admits nothing new on the target, so it drains and its slot comes free for the starved load;
- asks no other sequence's adapter to load, and the residency keeps the target's slot for the
  starved load alone (`Scheduler.drain_reservation`, read by adapters/tiers.py: the target is a
  victim for that load even while requests of its own queue, and for no other, such as a load
  an arrival started), so no one else takes the slot that comes free;
- goes on admitting sequences on the other resident adapters and on the base model, so the batch
  stays full meanwhile.

An urgent sequence (its TTFT deadline within `deadline_slack_ms`, engine/policies.py) is never held
back by a drain, and one whose adapter is not resident gets a drain of its own, taking over one
made for a starved sequence: the policy ranks deadlines before the starvation bound.

The earlier rule stopped every admission behind the starved sequence until a slot came free. That
emptied the batch while it drained, and under overload with few slots the starved sequences'
drains followed one another. In the simulator (32 adapters on 8 device slots, Poisson 25/s), the
adaptive policy then served a third less than FCFS, and 6,250 of 10,000 requests waited over 10 s
(docs/bench.md).
"""

from __future__ import annotations

from collections.abc import Callable, Container
from collections.abc import Sequence as SeqView

from loraplex.engine.policies import adapter_key
from loraplex.engine.sequence import Sequence


class SlotDrain:
    def __init__(self) -> None:
        self.starved: Sequence | None = None  # the sequence the room is made for
        self.target: str | None = None  # the running adapter that takes no new sequences meanwhile
        self._running: set[str] = set()  # adapter keys of the running set, as of `begin`

    def begin(self, waiting: Container[Sequence], running: SeqView[Sequence]) -> bool:
        """At the start of an admission pass: whether a drain is on (its starved sequence still
        waits); if so, the running set's adapters are noted for `admits`."""
        if self.starved is not None and self.starved not in waiting:
            self.starved = self.target = None  # admitted, aborted or finished meanwhile
        if self.starved is None:
            return False
        self._note(running)
        return True

    def start(self, seq: Sequence, running: SeqView[Sequence]) -> None:
        """`seq` is starved and its adapter not resident: drain a running adapter for it."""
        if self.starved is not seq:
            self.starved, self.target = seq, None
        # tokens until each running adapter's last sequence reaches its token limit (a bound:
        # EOS and stop strings may end them sooner)
        left: dict[str, int] = {}
        for s in running:
            key = adapter_key(s)
            if key is not None and key != adapter_key(seq):
                left[key] = max(left.get(key, 0), s.params.max_tokens - len(s.output_token_ids))
        if self.target not in left:  # the old target has drained (or none yet): the next one
            self.target = min(left, key=lambda k: (left[k], k)) if left else None
        self._note(running)

    def admits(self, seq: Sequence, resident: Callable[[Sequence], bool] | None) -> bool:
        """Whether `seq`, not the starved one, may be admitted (or ask for its adapter) while the
        drain is on: on the base model, or on a resident adapter other than the target
        (`resident` asks without starting a load; None: the running set's adapters only)."""
        key = adapter_key(seq)
        if key is None:
            return True
        if key == self.target:
            return False
        return key in self._running or (resident is not None and resident(seq))

    def _note(self, running: SeqView[Sequence]) -> None:
        self._running = {k for s in running if (k := adapter_key(s)) is not None}

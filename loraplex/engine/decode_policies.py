"""Running-set policies: the decode side of scheduling, a piece the scheduler consults.

The admission policy (engine/policies.py) decides which waiting sequences start, that is which
prefills begin. This piece decides which running sequences keep their slot and their KV blocks
(engine/scheduler.py asks):

- `victim(running)`: who is preempted when a running sequence needs a KV block and none is free;
- `displace(seq, running, now)`: whom admitting `seq` may preempt when every slot is taken (None:
  nobody);
- `started` / `stopped`: a sequence entered / left the running set.

fcfs      the last admitted is preempted first, nobody is displaced: the scheduler's behavior
          before decode policies.
adaptive  victims from the tenant holding the most running slots per weight (`tenant_weights`), its
          lowest priority first, then its last admitted; a sequence of a tenant under its share of
          the slots that has waited `displace_after_ms` takes one from the tenant most over it (the
          scheduler allows one such displacement per step).

The order rows are given in is not a policy's: the running pass goes in admission order, and a
sequence still prefilling is always the last admitted (a chunk that does not finish a prompt takes
the rest of the step's budget, so nothing is admitted behind it), so decode rows never wait behind
prefill chunks.

A tenant's share here is running sequences / weight: each running sequence gets one decode row a
step, so that is the tenant's share of decode service. Displacing only while the newcomer's
tenant, after admission, still holds no more per weight than the victim's keeps afterwards means a
displacement can never be answered by one in the other direction: the slots settle at the weighted
split (as far as the tenants have work) instead of changing hands every step. The wait before
displacing is there because a displaced sequence is recomputed: where slots turn over every few
hundred milliseconds, fair admission alone hands the next free one to the tenant under its share,
and displacing for every burst would only throw work away (on the simulator's default workload it
cost the busiest tenant a P99 TTFT 6x worse for no gain to the others). It is for a tenant whose
requests hold every slot for long.
"""

from __future__ import annotations

from collections import Counter
from typing import Protocol

from loraplex.config import SchedulerConfig
from loraplex.engine.policies import parse_weights
from loraplex.engine.sequence import Sequence


class DecodePolicy(Protocol):
    def victim(self, running: list[Sequence]) -> Sequence: ...
    def displace(self, seq: Sequence, running: list[Sequence], now: float) -> Sequence | None: ...
    def started(self, seq: Sequence) -> None: ...
    def stopped(self, seq: Sequence) -> None: ...


class FCFSDecodePolicy:
    def victim(self, running: list[Sequence]) -> Sequence:
        return running[-1]

    def displace(self, seq: Sequence, running: list[Sequence], now: float) -> Sequence | None:
        return None

    def started(self, seq: Sequence) -> None:
        pass

    def stopped(self, seq: Sequence) -> None:
        pass


class AdaptiveDecodePolicy:
    """Preemption and displacement by tenant share of the running slots."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.weights = parse_weights(config.tenant_weights)
        self.displace_after = config.displace_after_ms / 1000
        self._running: Counter[str] = Counter()  # tenant -> running sequences

    def started(self, seq: Sequence) -> None:
        self._running[seq.tenant] += 1

    def stopped(self, seq: Sequence) -> None:
        tenant = seq.tenant
        self._running[tenant] -= 1
        if not self._running[tenant]:
            del self._running[tenant]  # only tenants that hold a slot are candidates for victims

    def victim(self, running: list[Sequence]) -> Sequence:
        share = self._shares()
        top = max(share.values())
        best: Sequence | None = None
        # The latest admitted first: among tenants equally over, the one admitted last loses a slot
        # (as FCFS would), and within the tenant the least computed work is lost.
        for s in reversed(running):
            if best is None:
                if share[s.tenant] == top:
                    best = s
            elif s.tenant == best.tenant and s.priority < best.priority:
                best = s
        assert best is not None, "a tenant with running sequences has one in the running list"
        return best

    def displace(self, seq: Sequence, running: list[Sequence], now: float) -> Sequence | None:
        if now - seq.waiting_since < self.displace_after:
            return None
        tenant = seq.tenant
        after = (self._running[tenant] + 1) / self._weight(tenant)
        # Settled slots (the common case while every slot is taken) are told from the counters
        # alone, without the walk over the running list that picking the victim takes.
        if all((n - 1) / self._weight(t) < after for t, n in self._running.items() if t != tenant):
            return None
        victim = self.victim(running)
        over = victim.tenant
        if over == tenant or after > (self._running[over] - 1) / self._weight(over):
            return None
        return victim

    def _weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def _shares(self) -> dict[str, float]:
        return {t: n / self._weight(t) for t, n in self._running.items()}


def make_decode_policy(config: SchedulerConfig) -> FCFSDecodePolicy | AdaptiveDecodePolicy:
    name = config.running_policy
    if name == "fcfs":
        return FCFSDecodePolicy()
    if name == "adaptive":
        return AdaptiveDecodePolicy(config)
    raise ValueError(f"unknown decode policy {name!r}: fcfs or adaptive")

"""`loraplex bench simulate`'s core: the real scheduler (engine/scheduler.py, real `Sequence`s, a
real `BlockPool`) driven on a virtual clock, each step priced by the step-cost model
(bench/sim_cost.py), adapters kept resident by a slot model (bench/sim_residency.py) behind the
scheduler's `ready` gate. The workload is bench/workloads.py's, as `bench serve` replays it.

One loop iteration is one engine step: arrivals due by now are added; finished loads become
ready and loads start for waiting sequences; the scheduler plans a step and it is launched (its
rows count as computed, and a chunk that completes its sequence's known tokens has a token
pending); a step completes: the clock advances by its cost, each pending token (a dummy id)
arrives, and a sequence with all its output tokens finishes. Then the clock advances by the host
gap between steps. As engine.step() does it (`SimConfig.one_ahead` False), the step completed is
the one just launched; one step ahead, as the engine's serving loops run
(Engine.step_overlapped), it is the one launched in the iteration before, so a step is planned
while the one before it still runs: an arrival waits for the step in flight, and a sequence
whose pending token ends it by length gets no row in it.

A policy is a parameter (`Policy`): today the FCFS scheduler with admission batching on or off;
an adapter-aware policy plugs in as one more `Policy` whose `build` returns its scheduler.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as SeqView
from dataclasses import dataclass, field
from typing import Any, Protocol

from loraplex.bench.sim_cost import StepCost, StepShape
from loraplex.bench.sim_residency import SimResidency
from loraplex.bench.workload_fields import Arrivals
from loraplex.bench.workloads import Workload, WorkloadRequest
from loraplex.config import SchedulerConfig
from loraplex.engine.scheduler import Scheduler, StepPlan
from loraplex.engine.sequence import Sequence
from loraplex.kv.block_pool import BlockPool
from loraplex.types import AdapterRef, SamplingParams


class SimScheduler(Protocol):
    """What the simulator needs of a scheduler (engine/scheduler.Scheduler's interface)."""

    running: list[Sequence]

    @property
    def waiting(self) -> SeqView[Sequence]: ...

    def add(self, seq: Sequence) -> None: ...
    def schedule(self) -> StepPlan: ...
    def finish(self, seq: Sequence) -> None: ...
    def has_work(self) -> bool: ...


# (config, pool, block size, the adapter gate, the clock) -> a scheduler
SchedulerBuild = Callable[
    [SchedulerConfig, BlockPool, int, Callable[[Sequence], bool], Callable[[], float]], SimScheduler
]


_SIM_REVISION = "sim-{}"  # the revision of simulated adapter k


@dataclass(frozen=True)
class Policy:
    name: str
    admission_batch_tokens: int | None = None  # None: half the step token budget
    admission_max_wait_ms: int = 50
    build: SchedulerBuild | None = None  # None: the Scheduler with the knobs above
    policy: str = "fcfs"  # the admission order (engine/policies.py)
    knobs: tuple[tuple[str, int | str], ...] = ()  # SchedulerConfig fields of that policy

    def scheduler(
        self,
        sim: SimConfig,
        pool: BlockPool,
        ready: Callable[[Sequence], bool],
        clock: Callable[[], float],
    ) -> SimScheduler:
        config = SchedulerConfig(
            max_num_seqs=sim.max_num_seqs,
            max_num_batched_tokens=sim.max_num_batched_tokens,
            admission_max_wait_ms=self.admission_max_wait_ms,
            policy=self.policy,
        )
        batch = self.admission_batch_tokens
        batch = config.step_token_budget // 2 if batch is None else batch
        knobs: dict[str, Any] = dict(self.knobs)
        config = dataclasses.replace(config, admission_batch_tokens=batch, **knobs)
        if self.build is not None:
            return self.build(config, pool, sim.block_size, ready, clock)
        return Scheduler(config, pool, sim.block_size, ready, batch, clock=clock)


# The policies that exist today, by name (`--policies`).
POLICIES: dict[str, Policy] = {
    "fcfs": Policy("fcfs", admission_batch_tokens=0),
    "fcfs-batched": Policy("fcfs-batched"),
    # Adapter-aware and fair (engine/policies.py), every arrival admitted at once as in `fcfs`, so
    # the two differ in order only: a new adapter waits up to 150 ms for company, nothing past 5 s.
    "adaptive": Policy(
        "adaptive", admission_batch_tokens=0, policy="adaptive", knobs=(("locality_window_ms", 150),)
    ),
}


@dataclass(frozen=True)
class SimConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # None: the engine's default (`SchedulerConfig`)
    block_size: int = 16
    kv_blocks: int | None = None  # None: every running sequence fits at its longest (no preemption)
    graph_max_batch: int = 256  # pure decode steps of up to this many sequences replay a graph
    device_slots: int | None = None  # None: every adapter resident from the start
    host_slots: int | None = None  # None: every adapter in host memory from the start
    # The serving loop one step ahead (Engine.step_overlapped, as the server and bench serve run
    # it): each step is planned while the one before it is still in flight; False: engine.step()
    one_ahead: bool = True


@dataclass
class SimRequest:
    index: int
    tenant: str
    popularity: str  # base | hot | cold (Workload.popularity_class)
    adapter: int | None
    tier: str  # where its adapter was when it arrived: base | device | host | disk
    arrival_s: float
    deadline_s: float | None
    prompt_len: int
    output_len: int
    first_token_s: float | None = None
    finish_s: float | None = None

    @property
    def ttft(self) -> float:
        assert self.first_token_s is not None
        return self.first_token_s - self.arrival_s


@dataclass(frozen=True)
class SimStep:
    start_s: float
    seconds: float
    shape: StepShape


@dataclass
class SimRun:
    policy: str
    requests: list[SimRequest]
    steps: list[SimStep]
    wall_s: float  # virtual seconds from the first arrival to the last token
    runtime_s: float  # real seconds the simulation took
    served_rows: dict[str, int] = field(default_factory=dict)  # tenant -> rows computed for it
    # the same, counted only while requests still arrive: the share under load, not the drain's
    served_rows_open: dict[str, int] = field(default_factory=dict)
    loads: dict[str, int] = field(default_factory=dict)
    preemptions: int = 0


@dataclass(frozen=True)
class _Launched:
    shape: StepShape
    seconds: float
    adapters: set[int]
    sampled: list[Sequence]  # the sequences a token is sampled for, pending until it completes


@dataclass
class _Live:
    req: SimRequest
    adapter: int  # -1: base model


def simulate(workload: Workload, policy: Policy, cost: StepCost, sim: SimConfig | None = None) -> SimRun:
    """Run `workload` through `policy`'s scheduler on a virtual clock; deterministic."""
    sim = sim or SimConfig()
    started = time.perf_counter()
    reqs = workload.requests
    n_adapters = workload.spec.num_adapters
    longest = max(r.prompt_len + r.output_len for r in reqs)
    blocks = sim.kv_blocks or sim.max_num_seqs * -(-longest // sim.block_size)
    pool = BlockPool(blocks)
    slots = n_adapters if sim.device_slots is None else sim.device_slots
    residency = SimResidency(
        max(1, slots),
        n_adapters if sim.host_slots is None else sim.host_slots,
        cost.host_load_s,
        cost.disk_load_s,
        preload=range(n_adapters) if sim.device_slots is None else (),
    )
    all_resident = slots >= n_adapters and sim.device_slots is None
    refs = [AdapterRef(f"adapter-{k}", _SIM_REVISION.format(k)) for k in range(n_adapters)]
    live: dict[Sequence, _Live] = {}
    now = 0.0

    asked: dict[int, None] = {}  # adapters the gate was asked about and had not resident

    def ready(seq: Sequence) -> bool:
        # As the engine's gate (engine/adapter_admission.py), asking starts the load: here once
        # the step is planned, so a sequence the policy tries first gets its load even when it
        # is further back in the queue than `_start_loads` looks.
        a = live[seq].adapter
        if a < 0 or residency.ready(a):
            return True
        asked[a] = None
        return False

    sched = policy.scheduler(sim, pool, ready, lambda: now)
    if isinstance(sched, Scheduler):  # the gate's side-effect-free twin (engine/slot_drain.py)
        sched.resident = lambda seq: live[seq].adapter < 0 or residency.ready(live[seq].adapter)
    concurrency = Arrivals.parse(workload.spec.arrivals).concurrency
    pending: deque[WorkloadRequest] = deque(reqs)
    results: list[SimRequest] = []
    steps: list[SimStep] = []
    served: dict[str, int] = {}
    served_open: dict[str, int] = {}
    preemptions = 0
    order = 0

    def add(r: WorkloadRequest, arrival: float) -> None:
        nonlocal order
        a = -1 if r.adapter is None else r.adapter
        tier = "base" if a < 0 else residency.tier(a)
        req = SimRequest(
            r.index, r.tenant, workload.popularity_class(r.adapter), r.adapter, tier, arrival,
            r.deadline_s, r.prompt_len, r.output_len,
        )  # fmt: skip
        results.append(req)
        seq = Sequence(
            f"w{r.index}", [0] * r.prompt_len, SamplingParams(max_tokens=r.output_len, temperature=0.0),
            None if a < 0 else refs[a], order, tenant=r.tenant,
            deadline=None if r.deadline_s is None else arrival + r.deadline_s,
        )  # fmt: skip
        order += 1
        live[seq] = _Live(req, a)
        sched.add(seq)

    def launch(plan: StepPlan) -> _Launched:
        """The step's rows count as computed from here, and a sequence it samples for has a token
        pending (as the engine's launch does), so a step planned before this one completes plans
        around it."""
        shape, adapters = _shape(plan, live, sim.graph_max_batch)
        sampled = []
        for chunk in plan.chunks:
            seq, n = chunk.seq, chunk.num_tokens
            if chunk.completes:
                seq.pending += 1
                sampled.append(seq)
            seq.num_computed += n
            tenant = live[seq].req.tenant
            served[tenant] = served.get(tenant, 0) + n
            if pending:
                served_open[tenant] = served_open.get(tenant, 0) + n
        return _Launched(shape, cost.seconds(shape), adapters, sampled)

    in_flight: _Launched | None = None  # one ahead: the step launched and not completed
    while pending or live:
        if concurrency is not None:
            while pending and len(live) < concurrency:
                add(pending.popleft(), now)
        else:
            while pending and (pending[0].arrival_s or 0.0) <= now:
                r = pending.popleft()
                add(r, r.arrival_s or 0.0)
        if not all_resident:
            residency.advance(now)
            _start_loads(sched, live, residency, now, sim.max_num_seqs)
        plan = sched.schedule()
        if not all_resident:
            residency.planned()
        preemptions += len(plan.preempted)
        if asked:
            _load_asked(list(asked), sched, live, residency, now)
            asked.clear()
        launched = launch(plan) if plan.chunks else None
        done, in_flight = (in_flight, launched) if sim.one_ahead else (launched, None)
        if done is None:
            if in_flight is None:
                now = _idle_until(now, pending, concurrency, residency)
            continue  # (one ahead: the first step after an idle one is launched, nothing completes)
        steps.append(SimStep(now, done.seconds, done.shape))
        now += done.seconds
        if not all_resident:
            residency.touch(done.adapters)
        for seq in done.sampled:
            seq.pending -= 1
            seq.output_token_ids.append(0)
            lv = live[seq]
            if lv.req.first_token_s is None:
                lv.req.first_token_s = now
            if len(seq.output_token_ids) >= lv.req.output_len:
                lv.req.finish_s = now
                sched.finish(seq)
                del live[seq]
        now += cost.gap_s
    results.sort(key=lambda q: q.index)
    return SimRun(
        policy.name,
        results,
        steps,
        now,
        time.perf_counter() - started,
        dict(sorted(served.items())),
        dict(sorted(served_open.items())),
        dict(residency.loads),
        preemptions,
    )


def _shape(plan: StepPlan, live: dict[Sequence, _Live], graph_max_batch: int) -> tuple[StepShape, set[int]]:
    prefill = decode = lora = 0
    adapters: set[int] = set()
    for c in plan.chunks:
        n = c.num_tokens
        if c.is_decode:
            decode += n
        else:
            prefill += n
        a = live[c.seq].adapter
        if a >= 0:
            lora += n
            adapters.add(a)
    seqs = len(plan.chunks)
    graph = prefill == 0 and seqs <= graph_max_batch
    return StepShape(prefill, decode, lora, len(adapters), seqs, graph), adapters


def _start_loads(
    sched: SimScheduler, live: dict[Sequence, _Live], residency: SimResidency, now: float, window: int
) -> None:
    """Load the adapters the first `window` waiting sequences need (a bounded look, so a long
    backlog costs no more per step than a short one). Adapters that running sequences use, or
    waiting ones ahead of the one a load is for, are never evicted for it (as in
    adapters/eviction.py), else loads would evict each other's adapters before any step used them;
    one needed only further back may go, or a stream of later work could keep a slot forever."""
    head = [live[s].adapter for s in itertools.islice(sched.waiting, window)]
    if all(a < 0 or residency.ready(a) for a in head):
        return
    in_use = {live[s].adapter for s in sched.running}
    for a in head:
        if a >= 0 and not residency.ready(a) and not residency.request(a, now, _kept(sched, in_use, a)):
            return  # every slot is in use: nothing more can start before a step ends
        in_use.add(a)


def _load_asked(
    asked: list[int], sched: SimScheduler, live: dict[Sequence, _Live], residency: SimResidency, now: float
) -> None:
    """Start the loads the gate was asked for, in the order asked; adapters of running sequences,
    and those asked earlier, are never evicted for them."""
    in_use = {live[s].adapter for s in sched.running}
    for a in asked:
        if not residency.request(a, now, _kept(sched, in_use, a)):
            return
        in_use.add(a)


def _kept(sched: SimScheduler, in_use: set[int], adapter: int) -> set[int]:
    """The adapters a load of `adapter` may not evict: `in_use`, and the one drained for a starved
    sequence unless the load is that sequence's (`Scheduler.drain_reservation`, as the engine's
    tiers keep it)."""
    reservation = getattr(sched, "drain_reservation", None)
    starved, drained = reservation() if reservation is not None else (None, None)
    if drained is None or starved == _SIM_REVISION.format(adapter):
        return in_use
    return in_use | {int(drained.removeprefix(_SIM_REVISION.format("")))}


def _idle_until(
    now: float, pending: deque[WorkloadRequest], concurrency: int | None, residency: SimResidency
) -> float:
    """Nothing to run: the clock jumps to the next arrival or the next finished load."""
    events = [t for t in (residency.next_event(),) if t is not None]
    if pending and concurrency is None:
        events.append(pending[0].arrival_s or 0.0)
    later = [t for t in events if t > now]
    if not later:
        raise RuntimeError("simulation stuck: work waits, and no arrival or load can unblock it")
    return min(later)

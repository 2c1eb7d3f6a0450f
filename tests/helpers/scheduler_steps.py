"""The engine's part between scheduler plans, for tests of the scheduler on its own.

`Stepper` adds each chunk's rows to the sequence's computed count and, when the chunk completes the
sequence's known tokens, appends a token and finishes the request at `max_tokens`. After every plan
it checks the bookkeeping the engine relies on (docs/architecture.md, "KV accounting").
`ScheduledChunk.completes` reads the live sequence, so it only means something before the step is
applied: `Stepper.sampled` keeps it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

from loraplex.config import SchedulerConfig
from loraplex.engine.scheduler import Scheduler, StepPlan
from loraplex.engine.sequence import Sequence, SequenceStatus
from loraplex.kv.block_pool import BlockPool
from loraplex.types import SamplingParams

BS = 4  # block size


def blocks(tokens: int) -> int:
    return -(-tokens // BS)


class Stepper:
    """`knobs`: more SchedulerConfig fields (policies and their settings)."""

    def __init__(
        self,
        num_blocks: int,
        budget: int = 2048,
        max_num_seqs: int = 64,
        clock: Callable[[], float] = time.monotonic,
        **knobs: str | int,
    ) -> None:
        self.pool = BlockPool(num_blocks)
        self.config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, **knobs)  # type: ignore[arg-type]
        self.sched = Scheduler(self.config, self.pool, BS, clock=clock)
        self._arrivals = itertools.count()
        self.seqs: list[Sequence] = []
        self.sampled: list[str] = []  # request ids whose chunk completed in the last step
        self.pure_decode_plans = 0  # plans flagged pure decode (each checked in `_check_plan`)

    def make(
        self,
        rid: str,
        prompt_len: int,
        max_tokens: int = 16,
        arrival: int | None = None,
        tenant: str = "default",
        priority: int = 0,
    ) -> Sequence:
        return Sequence(
            request_id=rid,
            prompt_token_ids=list(range(1, prompt_len + 1)),
            params=SamplingParams(max_tokens=max_tokens),
            adapter=None,
            arrival=next(self._arrivals) if arrival is None else arrival,
            tenant=tenant,
            priority=priority,
        )

    def add(
        self, rid: str, prompt_len: int, max_tokens: int = 16, tenant: str = "default", priority: int = 0
    ) -> Sequence:
        seq = self.make(rid, prompt_len, max_tokens, tenant=tenant, priority=priority)
        self.sched.add(seq)
        self.seqs.append(seq)
        return seq

    def step(self) -> StepPlan:
        plan = self.sched.schedule()
        self._check_plan(plan)
        completing = [c.seq for c in plan.chunks if c.completes]
        self.sampled = [s.request_id for s in completing]
        for chunk in plan.chunks:
            chunk.seq.num_computed += chunk.num_tokens
        for seq in completing:
            seq.output_token_ids.append(1000 + len(seq.output_token_ids))
            if len(seq.output_token_ids) == seq.params.max_tokens:
                self.sched.finish(seq)
        self.check()
        return plan

    def tenants_running(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.sched.running:
            out[s.tenant] = out.get(s.tenant, 0) + 1
        return out

    def _check_plan(self, plan: StepPlan) -> None:
        seqs = [c.seq for c in plan.chunks]
        assert len(set(map(id, seqs))) == len(seqs), "a sequence planned twice in one step"
        assert not set(plan.preempted) & {s.request_id for s in seqs}, "a preempted sequence planned"
        assert plan.num_rows <= self.config.max_num_batched_tokens
        assert seqs == [s for s in self.sched.running if s in seqs], "chunks not in running order"
        assert len(self.sched.running) <= self.config.max_num_seqs
        for c in plan.chunks:
            assert c.seq.status is SequenceStatus.RUNNING
            assert 1 <= c.num_tokens <= c.seq.num_uncomputed
            # the blocks for this step's rows are already there, and no more
            assert len(c.seq.block_ids) == blocks(c.seq.num_computed + c.num_tokens)
            one_new_row = c.num_tokens == c.seq.num_uncomputed == 1 and bool(c.seq.output_token_ids)
            assert c.is_decode == one_new_row
        if plan.pure_decode:  # the flag the graph runner trusts instead of its own pass
            assert plan.chunks and all(c.num_tokens == 1 and c.completes for c in plan.chunks)
            self.pure_decode_plans += 1

    def check(self) -> None:
        self.pool.check_integrity()
        running, waiting = self.sched.running, self.sched.waiting
        owned = [b for s in running for b in s.block_ids]
        assert len(owned) == len(set(owned)) == self.pool.num_used, "KV blocks leaked or shared"
        for s in running:
            assert s.status is SequenceStatus.RUNNING
            assert len(s.block_ids) == blocks(s.num_computed)
        for s in waiting:
            assert s.status is SequenceStatus.WAITING
            assert s.block_ids == [] and s.num_computed == 0
        if self.config.policy == self.config.running_policy == "fcfs":  # others reorder both
            arrivals = [s.arrival for s in running] + [s.arrival for s in waiting]
            assert arrivals == sorted(arrivals), "running, then waiting, each in arrival order"


def rows(plan: StepPlan) -> list[tuple[str, int]]:
    return [(c.seq.request_id, c.num_tokens) for c in plan.chunks]

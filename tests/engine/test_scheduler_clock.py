"""The scheduler's injectable clock (the simulator's virtual time) and its bounded per-step work
under a long backlog (bench/simulate.py drives it with 10,000 requests)."""

from __future__ import annotations

from loraplex.config import SchedulerConfig
from loraplex.engine.scheduler import Scheduler
from loraplex.engine.sequence import Sequence, SequenceStatus
from loraplex.kv.block_pool import BlockPool
from loraplex.types import SamplingParams


def _seq(i: int, prompt: int = 8) -> Sequence:
    return Sequence(f"r{i}", [1] * prompt, SamplingParams(max_tokens=50), None, i)


def _decode_one_step(sched: Scheduler) -> None:
    for chunk in sched.schedule().chunks:
        chunk.seq.num_computed += chunk.num_tokens
        if chunk.seq.num_computed == chunk.seq.num_tokens:
            chunk.seq.output_token_ids.append(0)


def test_admission_batching_waits_on_the_injected_clock() -> None:
    now = [100.0]
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, admission_max_wait_ms=50)
    sched = Scheduler(config, BlockPool(256), 4, admission_batch_tokens=100, clock=lambda: now[0])
    sched.add(_seq(0))
    _decode_one_step(sched)  # prefill of r0
    sched.add(_seq(1))
    assert sched.waiting[0].waiting_since == 100.0
    now[0] = 100.049  # under the 50 ms wait: the pure decode step holds r1 back
    assert [c.seq.request_id for c in sched.schedule().chunks] == ["r0"]
    now[0] = 100.051
    assert [c.seq.request_id for c in sched.schedule().chunks] == ["r0", "r1"]


def test_a_backlog_of_not_resident_adapters_is_looked_at_boundedly() -> None:
    asked: list[str] = []

    def ready(seq: Sequence) -> bool:
        asked.append(seq.request_id)
        return False

    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256)
    sched = Scheduler(config, BlockPool(4096), 4, ready=ready)
    for i in range(1000):
        sched.add(_seq(i))
    assert sched.schedule().chunks == ()
    assert len(asked) == 4 * 4  # 4 x max_num_seqs, not the whole queue


def test_finish_takes_a_sequence_out_of_whichever_queue_holds_it() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=1), BlockPool(64), 4)
    a, b = _seq(0), _seq(1)
    sched.add(a)
    sched.add(b)
    sched.schedule()  # a runs, b waits (max_num_seqs=1)
    assert a.status is SequenceStatus.RUNNING and sched.waiting == [b]
    sched.finish(a)
    sched.finish(b)  # an abort while queued
    assert not sched.running and not sched.waiting and sched.pool.num_free == 64


def test_step_budget_changes_between_steps_within_the_configured_one() -> None:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    sched = Scheduler(config, BlockPool(256), 4, admission_batch_tokens=32)
    for i in range(3):
        sched.add(_seq(i, prompt=40))
    sched.set_step_budget(24, 0)
    assert sched.schedule().num_rows == 24 and sched.admission_batch_tokens == 0
    sched.set_step_budget(64, 32)
    assert sched.schedule().num_rows == 64
    for bad in (0, 65):
        try:
            sched.set_step_budget(bad, 0)
        except ValueError as err:
            assert "max_num_batched_tokens" in str(err)
        else:
            raise AssertionError(f"budget {bad} accepted")
    assert sched.token_budget == 64

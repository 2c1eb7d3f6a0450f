"""The scheduler on its own: plans over sequences and block ids, no model and no tensors, stepped
by `helpers.scheduler_steps.Stepper` (the engine's part between plans, with the bookkeeping checks).
"""

from __future__ import annotations

import random

import pytest
from helpers.scheduler_steps import BS, Stepper, rows

from loraplex.config import SchedulerConfig
from loraplex.engine.scheduler import Scheduler
from loraplex.engine.sequence import SequenceStatus

# --- order and budget ---------------------------------------------------------------------------


def test_waiting_sequences_are_admitted_in_arrival_order() -> None:
    st = Stepper(num_blocks=16)
    for rid, prompt_len, arrival in (("late", 3, 7), ("early", 2, 1), ("mid", 1, 4)):
        st.sched.add(st.make(rid, prompt_len, arrival=arrival))
    assert [s.request_id for s in st.sched.waiting] == ["early", "mid", "late"]
    assert rows(st.step()) == [("early", 2), ("mid", 1), ("late", 3)]


def test_token_budget_caps_a_step_and_chunks_the_last_prompt() -> None:
    st = Stepper(num_blocks=16, budget=10)
    a, b, c = st.add("a", 4), st.add("b", 4), st.add("c", 4)
    plan = st.step()
    assert rows(plan) == [("a", 4), ("b", 4), ("c", 2)]
    assert st.sampled == ["a", "b"]
    assert (len(a.output_token_ids), len(b.output_token_ids), len(c.output_token_ids)) == (1, 1, 0)
    plan = st.step()
    assert rows(plan) == [("a", 1), ("b", 1), ("c", 2)]
    assert [ch.is_decode for ch in plan.chunks] == [True, True, False]
    assert st.sampled == ["a", "b", "c"] and len(c.output_token_ids) == 1


def test_default_step_budget_is_per_sequence_and_admission_is_immediate() -> None:
    assert SchedulerConfig().step_token_budget == 384  # 64 sequences; the floor
    assert SchedulerConfig(max_num_seqs=4).step_token_budget == 384
    assert SchedulerConfig(max_num_seqs=256).step_token_budget == 6 * 256
    assert SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=300).step_token_budget == 300
    assert SchedulerConfig().admission_batch_tokens == 0
    config = SchedulerConfig(max_num_seqs=100)
    sched = Scheduler(config, Stepper(num_blocks=16).sched.pool, BS)
    assert sched.token_budget == 600
    with pytest.raises(ValueError, match="1..600"):
        sched.set_step_budget(601, 0)


def test_a_long_prompt_is_prefilled_in_chunks_across_steps() -> None:
    st = Stepper(num_blocks=16, budget=8)
    seq = st.add("long", 20, max_tokens=3)
    seen = []
    for _ in range(3):
        plan = st.step()
        (chunk,) = plan.chunks
        seen.append((chunk.num_tokens, st.sampled == ["long"], chunk.is_decode, len(seq.block_ids)))
    # blocks grow with each chunk, not all at admission
    assert seen == [(8, False, False, 2), (8, False, False, 4), (4, True, False, 5)]
    assert seq.num_computed == 20 and len(seq.output_token_ids) == 1
    first = st.step().chunks[0]
    assert (first.num_tokens, first.is_decode, st.sampled) == (1, True, ["long"])
    assert st.step().chunks[0] is first  # a decoding sequence's chunk is made once
    assert seq.is_finished and st.pool.num_used == 0


def test_decode_rows_and_a_prefill_chunk_share_a_step() -> None:
    st = Stepper(num_blocks=16, budget=6)
    st.add("a", 3)
    st.step()
    st.add("b", 10)
    plan = st.step()
    assert rows(plan) == [("a", 1), ("b", 5)]
    assert [c.is_decode for c in plan.chunks] == [True, False]
    plan = st.step()
    assert rows(plan) == [("a", 1), ("b", 5)] and st.sampled == ["a", "b"]
    assert rows(st.step()) == [("a", 1), ("b", 1)]


def test_waiting_sequences_get_only_the_budget_running_ones_leave() -> None:
    st = Stepper(num_blocks=16, budget=2)
    st.add("a", 1)
    st.add("b", 1)
    st.step()
    st.add("c", 1)
    plan = st.step()
    assert rows(plan) == [("a", 1), ("b", 1)]  # the budget is gone: c waits
    assert st.sched.waiting[0].request_id == "c"
    st.sched.finish(st.seqs[0])
    assert rows(st.step()) == [("b", 1), ("c", 1)]


def test_max_num_seqs_limits_running_sequences_not_the_budget() -> None:
    st = Stepper(num_blocks=16, max_num_seqs=2)
    a = st.add("a", 2, max_tokens=2)
    st.add("b", 2)
    c = st.add("c", 2)
    assert rows(st.step()) == [("a", 2), ("b", 2)]
    assert c.status is SequenceStatus.WAITING
    assert rows(st.step()) == [("a", 1), ("b", 1)]  # a finishes after this step
    assert a.is_finished
    assert rows(st.step()) == [("b", 1), ("c", 2)]


# --- KV blocks ----------------------------------------------------------------------------------


def test_decode_allocates_a_block_only_when_crossing_a_boundary() -> None:
    st = Stepper(num_blocks=16)
    seq = st.add("a", 3, max_tokens=7)
    counts = []
    while not seq.is_finished:
        st.step()
        counts.append((seq.num_computed, len(seq.block_ids)))
    assert counts[:-1] == [(3, 1), (4, 1), (5, 2), (6, 2), (7, 2), (8, 2)]
    assert st.pool.num_used == 0  # finishing freed them


def test_admission_with_exactly_enough_blocks_and_with_one_short() -> None:
    st = Stepper(num_blocks=4)
    st.add("a", 3)
    st.step()  # a holds 1 block, which also takes its next row; 3 free
    b = st.add("b", 12)  # 3 blocks: exactly what is free
    assert rows(st.step()) == [("a", 1), ("b", 12)]
    assert st.pool.num_free == 0 and len(b.block_ids) == 3

    st = Stepper(num_blocks=4)
    st.add("a", 3)
    st.step()
    b = st.add("b", 13)  # 4 blocks, one more than is free
    c = st.add("c", 1)
    assert rows(st.step()) == [("a", 1)]
    # strict FCFS: c would fit, but waits behind b
    assert b.status is c.status is SequenceStatus.WAITING
    assert st.pool.num_free == 3  # nothing was allocated


def test_admission_needs_blocks_only_for_the_first_chunk() -> None:
    st = Stepper(num_blocks=3, budget=5)
    st.add("a", 3)
    st.step()
    b = st.add("b", 12)  # 3 blocks in all, 2 free: its first chunk (4 rows) needs 1
    assert rows(st.step()) == [("a", 1), ("b", 4)]
    assert len(b.block_ids) == 1 and st.pool.num_free == 1


def test_the_latest_arrival_is_preempted_when_blocks_run_out() -> None:
    st = Stepper(num_blocks=2)
    a = st.add("a", 4, max_tokens=3)
    b = st.add("b", 4, max_tokens=2)
    st.step()  # each prefilled 4 tokens into its 1 block and sampled a token
    b_block = list(b.block_ids)
    plan = st.step()  # a's decode row (position 4) needs a second block; none is free
    assert plan.preempted == ("b",)
    assert rows(plan) == [("a", 1)]
    assert b.status is SequenceStatus.WAITING and b.block_ids == [] and b.num_computed == 0
    assert b.num_preemptions == 1 and b.output_token_ids == [1000]  # its token survives
    assert a.block_ids[1:] == b_block  # a got the block b freed
    st.step()  # a finishes, freeing both blocks
    assert a.is_finished and st.pool.num_free == 2
    plan = st.step()
    # b is recomputed from position 0: its prompt and its generated token, then samples anew
    assert rows(plan) == [("b", 5)] and not plan.chunks[0].is_decode and st.sampled == ["b"]
    assert b.output_token_ids == [1000, 1001] and b.is_finished and st.pool.num_used == 0


def test_a_sequence_that_is_itself_the_latest_preempts_itself() -> None:
    st = Stepper(num_blocks=2)
    a = st.add("a", 3)
    b = st.add("b", 4)
    st.step()
    plan = st.step()  # a's position 3 fits its block; b's position 4 needs one more
    assert plan.preempted == ("b",) and rows(plan) == [("a", 1)]
    assert b.status is SequenceStatus.WAITING and st.pool.num_free == 1
    assert a.status is SequenceStatus.RUNNING


def test_recompute_after_preemption_is_chunked_by_the_budget() -> None:
    st = Stepper(num_blocks=2, budget=3)
    a = st.add("a", 1, max_tokens=5)
    b = st.add("b", 1, max_tokens=5)
    for _ in range(4):
        assert rows(st.step()) == [("a", 1), ("b", 1)]
    plan = st.step()  # a's position 4 needs a second block: b goes, with 4 generated tokens
    assert plan.preempted == ("b",) and rows(plan) == [("a", 1)] and a.is_finished
    assert b.num_tokens == 5 and b.num_computed == 0
    assert rows(st.step()) == [("b", 3)] and st.sampled == []
    assert rows(st.step()) == [("b", 2)] and st.sampled == ["b"]
    assert b.is_finished and len(b.output_token_ids) == 5 and st.pool.num_used == 0


def test_a_sequence_preempted_in_a_step_is_not_planned_in_that_step() -> None:
    st = Stepper(num_blocks=3, budget=4)
    st.add("a", 4, max_tokens=5)
    st.add("b", 3, max_tokens=9)
    for _ in range(3):
        st.step()
    plan = st.step()  # b's position 4 needs a block; none is free and b is the latest
    assert plan.preempted == ("b",)
    assert rows(plan) == [("a", 1)]


def test_finish_frees_blocks_of_running_and_forgets_waiting() -> None:
    st = Stepper(num_blocks=8, max_num_seqs=1)
    a = st.add("a", 9)
    b = st.add("b", 2)
    st.step()
    assert len(a.block_ids) == 3 and st.pool.num_used == 3
    st.sched.finish(a)
    assert a.is_finished and a.block_ids == [] and st.pool.num_used == 0 and a not in st.sched.running
    st.sched.finish(b)  # aborted before it ever ran
    assert b.is_finished and not st.sched.has_work()
    assert st.step().chunks == ()
    st.check()


# The adaptive policies reorder admission and pick victims and displacements (here without a wait)
# by tenant, priority and weight: the same bookkeeping must hold and every request finish.
@pytest.mark.parametrize(
    "knobs",
    [
        {},
        {"policy": "adaptive", "displace_after_ms": 0},
        {"policy": "adaptive", "displace_after_ms": 0, "tenant_weights": "a:2,b:0.5"},
    ],
)
def test_random_workloads_keep_the_bookkeeping_and_finish(knobs: dict[str, str | int]) -> None:
    rnd = random.Random(15)
    who = random.Random(16)  # tenants and priorities (the workloads stay those of `rnd`)
    preemptions = pure_decode_plans = 0
    for trial in range(30):
        st = Stepper(
            num_blocks=rnd.randint(6, 16),
            budget=rnd.choice([3, 5, 8, 16, 64]),
            max_num_seqs=rnd.randint(1, 6),
            **knobs,
        )
        todo = [(f"r{trial}.{i}", rnd.randint(1, 12), rnd.randint(1, 10)) for i in range(rnd.randint(1, 8))]
        # every request fits the pool on its own (the engine refuses the others at add_request)
        todo = [(rid, p, min(m, st.pool.num_blocks * BS - p)) for rid, p, m in todo]
        added = []
        steps = 0
        while todo or st.sched.has_work():
            if todo and rnd.random() < 0.5:
                added.append(st.add(*todo.pop(0), tenant=who.choice("abc"), priority=who.randint(-1, 1)))
            st.step()
            steps += 1
            assert steps < 2000, "no progress"
        for seq in added:
            assert seq.is_finished and len(seq.output_token_ids) == seq.params.max_tokens
            preemptions += seq.num_preemptions
        assert st.pool.num_used == 0
        pure_decode_plans += st.pure_decode_plans
    assert preemptions > 0  # the workloads did exercise preemption
    assert pure_decode_plans > 0  # and steady decode steps, whose flag each plan check verified


def _batching_stepper(batch_tokens: int, max_wait_ms: int) -> Stepper:
    st = Stepper(num_blocks=512, budget=256)
    st.config = SchedulerConfig(
        max_num_seqs=64, max_num_batched_tokens=256, admission_max_wait_ms=max_wait_ms
    )
    st.sched = Scheduler(st.config, st.pool, BS, admission_batch_tokens=batch_tokens)
    return st


def test_admission_batching_holds_prompts_out_of_pure_decode_steps_until_enough_tokens_wait() -> None:
    st = _batching_stepper(batch_tokens=100, max_wait_ms=60_000)
    st.add("a", 8, max_tokens=50)
    st.step()  # a's prefill
    st.add("b", 40)
    plan = st.step()
    assert [c.seq.request_id for c in plan.chunks] == ["a"] and plan.chunks[0].is_decode
    st.add("c", 40)
    assert [c.seq.request_id for c in st.step().chunks] == ["a"]  # 80 tokens wait: still held
    st.add("d", 30)  # 110 >= 100: one step admits all three
    assert [c.seq.request_id for c in st.step().chunks] == ["a", "b", "c", "d"]


def test_admission_batching_admits_after_the_wait_limit_and_into_steps_that_prefill_anyway() -> None:
    st = _batching_stepper(batch_tokens=100, max_wait_ms=0)
    st.add("a", 8, max_tokens=50)
    st.step()
    st.add("b", 10)
    assert [c.seq.request_id for c in st.step().chunks] == ["a", "b"]  # waited >= 0 ms

    st = _batching_stepper(batch_tokens=10_000, max_wait_ms=60_000)
    st.add("a", 300, max_tokens=50)  # longer than the 256-token budget: prefilled in chunks
    st.step()
    st.add("b", 10)
    plan = st.step()  # a's second chunk makes this a prefill step: b rides along
    assert [c.seq.request_id for c in plan.chunks] == ["a", "b"] and not plan.chunks[0].is_decode
    # With nothing running, nothing is held (there is no decode step to protect).
    st = _batching_stepper(batch_tokens=10_000, max_wait_ms=60_000)
    st.add("x", 10)
    assert [c.seq.request_id for c in st.step().chunks] == ["x"]


def test_admission_batching_config_is_validated() -> None:
    with pytest.raises(ValueError, match="admission_batch_tokens"):
        SchedulerConfig(admission_batch_tokens=-1)
    with pytest.raises(ValueError, match="admission_max_wait_ms"):
        SchedulerConfig(admission_max_wait_ms=-5)

"""The decode side of scheduling (engine/decode_policies.py) on the bare scheduler: who is preempted
when KV blocks run out, and a tenant that filled every slot giving slots up to a backlogged one.
Each property is shown failing under `fcfs`, the default, whose behavior is the scheduler's before
decode policies (tests/engine/test_scheduler_unit.py, whose random workloads also run under
the adaptive policies)."""

from __future__ import annotations

import argparse

import pytest
from helpers.scheduler_steps import Stepper, rows

from loraplex.config import SchedulerConfig
from loraplex.config_cli import add_engine_args, engine_config_from_args
from loraplex.engine.scheduler import StepPlan


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_decode_policy_follows_the_admission_policy_unless_set() -> None:
    assert SchedulerConfig().running_policy == "fcfs"
    assert SchedulerConfig(policy="adaptive").running_policy == "adaptive"
    assert SchedulerConfig(policy="adaptive", decode_policy="fcfs").running_policy == "fcfs"
    with pytest.raises(ValueError, match="decode_policy must be fcfs or adaptive"):
        SchedulerConfig(decode_policy="lifo")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--policy", "fcfs", "--decode-policy", "adaptive"])
    assert engine_config_from_args("m", args).scheduler.running_policy == "adaptive"
    assert engine_config_from_args("m", parser.parse_args([])).scheduler.decode_policy is None


def _kv_short(decode: str) -> tuple[Stepper, StepPlan]:
    """Tenant a holds three running sequences, tenant b (arrived last) one; at their next rows each
    needs a block, and one is free."""
    run = Stepper(num_blocks=8, decode_policy=decode)
    run.add("a0", 4, max_tokens=9, tenant="a")
    run.add("a1", 8, max_tokens=9, tenant="a", priority=-1)  # a's least important
    run.add("a2", 8, max_tokens=9, tenant="a")
    run.add("b0", 8, max_tokens=9, tenant="b")
    run.step()  # every prompt's blocks are full: 7 of 8 held
    return run, run.step()  # a0 takes the free block; a1 finds none


def test_kv_preemption_takes_from_the_tenant_over_its_share_lowest_priority_first() -> None:
    _, plan = _kv_short("fcfs")
    assert plan.preempted == ("b0",)  # the latest arrival: the one tenant b had
    run, plan = _kv_short("adaptive")
    assert plan.preempted == ("a1",)  # tenant a holds 3 of 4 slots; a1 is its lowest priority
    assert rows(plan) == [("a0", 1), ("a2", 1), ("b0", 1)]
    assert run.tenants_running() == {"a": 2, "b": 1}


def _flooded(decode: str, weights: str = "", after_ms: int = 0, clock: _Clock | None = None) -> Stepper:
    """Tenant a's six long requests take every one of 4 slots; then b asks for four."""
    run = Stepper(
        num_blocks=256, max_num_seqs=4, clock=clock or _Clock(), policy="adaptive",
        decode_policy=decode, tenant_weights=weights, displace_after_ms=after_ms,
    )  # fmt: skip
    for i in range(6):
        run.add(f"a{i}", 4, max_tokens=200, tenant="a")
    run.step()
    for i in range(4):
        run.add(f"b{i}", 4, max_tokens=200, tenant="b")
    return run


def test_a_tenant_that_filled_every_slot_gives_slots_up_to_a_backlogged_one() -> None:
    run = _flooded("adaptive")
    seen = []
    for _ in range(6):
        plan = run.step()
        seen.append(run.tenants_running())
        assert len(plan.preempted) <= 1  # one displacement a step
    # Once the admission policy offers b's request (first, a's: even counters, a is older), a's
    # latest give way one a step until both hold their share; then nothing moves.
    assert seen == [{"a": 4}, {"a": 3, "b": 1}] + [{"a": 2, "b": 2}] * 4
    displaced = [s for s in run.sched.waiting if s.tenant == "a" and s.num_preemptions]
    assert sorted(s.request_id for s in displaced) == ["a2", "a3"]

    # Fair admission alone (FCFS running set): b waits for a's requests to finish.
    run = _flooded("fcfs")
    for _ in range(6):
        run.step()
    assert run.tenants_running() == {"a": 4}


def test_a_request_displaces_only_after_it_waited_displace_after_ms() -> None:
    clock = _Clock()
    run = _flooded("adaptive", after_ms=200, clock=clock)
    for _ in range(3):
        run.step()
    assert run.tenants_running() == {"a": 4}  # slots may free up soon: b waits for them first
    clock.now = 0.2
    run.step()
    assert run.tenants_running() == {"a": 3, "b": 1}


def test_displacement_settles_at_the_weighted_split() -> None:
    run = _flooded("adaptive", weights="a:3,b:1")
    for _ in range(5):
        run.step()
    assert run.tenants_running() == {"a": 3, "b": 1}

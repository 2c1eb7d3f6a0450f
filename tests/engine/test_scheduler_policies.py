"""Admission-order policies (engine/policies.py): the adaptive policy's order on the bare scheduler,
and on a real (tiny) engine, on the CPU, the same per-request outputs as FCFS in another admission
order, with preemptions (engine/decode_policies.py) and cancellation at every phase freeing
everything; greedy outputs equal transformers + PEFT's (a policy changes order, never outputs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from helpers.reference import load_peft_mixture, mixed_batch_greedy
from helpers.tiny_models import build_hf_model, make_peft_adapter, save_hf_model

from loraplex import LLM, SamplingParams
from loraplex.config import CacheConfig, EngineConfig, SchedulerConfig
from loraplex.demo import DEMO_MODEL_DIR
from loraplex.engine.engine import Engine
from loraplex.engine.scheduler import Scheduler
from loraplex.engine.sequence import Sequence
from loraplex.kv.block_pool import BlockPool
from loraplex.types import AdapterRef

# --- the order, on the bare scheduler (a virtual clock) -------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _sched(clock: _Clock, **knobs: int | str) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, policy="adaptive", **knobs)  # type: ignore[arg-type]
    return Scheduler(config, BlockPool(64), 16, clock=clock)


def _seq(
    rid: str, arrival: int, tenant: str = "t", priority: int = 0, adapter: str | None = None
) -> Sequence:
    ref = None if adapter is None else AdapterRef(adapter, adapter + "-rev")
    return Sequence(
        rid, [1] * 8, SamplingParams(max_tokens=2), ref, arrival, tenant=tenant, priority=priority
    )


def _next(sched: Scheduler) -> str:
    """Admit one (one slot), finish it, and say which it was."""
    plan = sched.schedule()
    assert len(plan.chunks) == 1
    seq = plan.chunks[0].seq
    sched.finish(seq)
    return seq.request_id


def test_the_least_served_tenant_goes_first_and_idle_time_banks_no_credit() -> None:
    clock = _Clock()
    sched = _sched(clock)
    for i in range(4):
        sched.add(_seq(f"a{i}", i, "a"))
    assert [_next(sched) for _ in range(2)] == ["a0", "a1"]  # a alone: its own order
    sched.add(_seq("b0", 10, "b"))
    sched.add(_seq("b1", 11, "b"))
    # b arrives after a was served twice; lifted to a's counter, it alternates with a rather than
    # taking every turn until it has "caught up" with service it never asked for.
    assert [_next(sched) for _ in range(4)] == ["a2", "b0", "a3", "b1"]


def test_a_starved_sequence_drains_one_running_adapter_and_admissions_go_on() -> None:
    # Two slots, both pinned: adapter "a" runs one sequence near its limit, "b" two far from it.
    # "c" is not resident; once it has waited past the bound, "a" (the sooner free slot) takes
    # no new sequences and no other load is asked for, while "b" and the base model are admitted.
    clock = _Clock()
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, policy="adaptive", max_wait_ms=1000)
    resident, asked = {"a-rev", "b-rev"}, []

    def ready(seq: Sequence) -> bool:
        asked.append(seq.request_id)
        return seq.adapter is None or seq.adapter.revision in resident

    sched = Scheduler(config, BlockPool(64), 16, ready, clock=clock)

    def seq(rid: str, adapter: str | None, max_tokens: int, arrival: float) -> Sequence:
        ref = None if adapter is None else AdapterRef(adapter, adapter + "-rev")
        return Sequence(rid, [1] * 4, SamplingParams(max_tokens=max_tokens), ref, arrival)

    for rid, adapter, max_tokens in (("a0", "a", 2), ("b0", "b", 50), ("b1", "b", 50)):
        sched.add(seq(rid, adapter, max_tokens, 0.0))
    sched.add(seq("c0", "c", 5, 0.1))
    sched.schedule()  # a0, b0, b1 admitted; c0 passed over (its adapter loads)
    assert [s.request_id for s in sched.running] == ["a0", "b0", "b1"]
    clock.now = 1.5  # c0 has waited past the bound
    for rid, adapter in (("a1", "a"), ("b2", "b"), ("base", None), ("d0", "d")):
        sched.add(seq(rid, adapter, 5, 1.2))
    asked.clear()
    sched.schedule()
    running = [s.request_id for s in sched.running]
    assert "b2" in running and "base" in running  # admissions go on beside the drain
    assert "a1" not in running and "d0" not in running
    assert "d0" not in asked  # nobody else's load is started meanwhile
    resident.add("c-rev")  # a0 drained, its slot took c's load: c0 is admitted, the drain ends
    sched.finish(next(s for s in sched.running if s.request_id == "a0"))
    sched.schedule()
    running = [s.request_id for s in sched.running]
    assert "c0" in running and "a1" in running


def test_an_urgent_request_takes_a_drain_over() -> None:
    # As above, c0 starved and adapter "a" draining for it; then u0 arrives on "d" (not resident)
    # with a TTFT deadline inside the slack: deadlines go before the starvation bound, so the
    # drain is made for u0 now (its load asked for, the drained slot reserved for it).
    clock = _Clock()
    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=64, policy="adaptive", max_wait_ms=1000, deadline_slack_ms=100
    )
    asked: list[str] = []

    def ready(seq: Sequence) -> bool:
        asked.append(seq.request_id)
        return seq.adapter is None or seq.adapter.revision in {"a-rev", "b-rev"}

    sched = Scheduler(config, BlockPool(64), 16, ready, clock=clock)

    def seq(rid: str, adapter: str, max_tokens: int, deadline: float | None = None) -> Sequence:
        ref = AdapterRef(adapter, adapter + "-rev")
        s = Sequence(rid, [1] * 4, SamplingParams(max_tokens=max_tokens), ref, 0.0)
        s.deadline = deadline
        return s

    for rid, adapter, max_tokens in (("a0", "a", 2), ("b0", "b", 50)):
        sched.add(seq(rid, adapter, max_tokens))
    sched.add(seq("c0", "c", 5))
    sched.schedule()
    clock.now = 1.5
    sched.schedule()  # c0 starved: the drain is for it
    assert sched.drain_reservation() == ("c-rev", "a-rev")
    sched.add(seq("u0", "d", 5, deadline=1.55))
    asked.clear()
    sched.schedule()
    assert "u0" in asked and sched.drain_reservation() == ("d-rev", "a-rev")


def test_priority_orders_a_tenants_requests_and_the_starvation_bound_overrides_it() -> None:
    clock = _Clock()
    sched = _sched(clock, max_wait_ms=1000)
    sched.add(_seq("low", 0, priority=0))
    clock.now = 0.5
    for i in range(3):
        sched.add(_seq(f"high{i}", 1 + i, priority=5))
    assert _next(sched) == "high0"
    clock.now = 1.2  # "low" has waited past the bound: it goes first, whatever its priority
    assert _next(sched) == "low"


def test_a_deadline_stays_urgent_after_a_step_that_stopped_at_it() -> None:
    clock = _Clock()
    sched = _sched(clock)
    r0 = _seq("r0", 0, tenant="b")
    sched.add(r0)
    sched.schedule()  # r0 prefills: tenant b has 8 rows of service
    sched.add(_seq("c1", 1, tenant="c"))  # c starts level with b
    r0.output_token_ids.append(1)
    sched.schedule()  # r0 decodes: b 9, c 8
    d = _seq("d", 2, tenant="b")
    d.deadline = 1.0
    sched.add(d)
    clock.now = 0.95  # d's deadline is 50 ms away: urgent, ahead of fairness
    assert not sched.schedule().chunks[1:]  # the only slot is r0's: the pass stops at d
    sched.finish(r0)
    assert _next(sched) == "d"  # (its deadline entry was dropped when the pass stopped: c1 went)


def test_a_stray_adapter_waits_for_company_until_the_window_ends() -> None:
    clock = _Clock()
    config = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=64, policy="adaptive", locality_window_ms=100
    )
    sched = Scheduler(config, BlockPool(64), 16, clock=clock)
    sched.add(_seq("hot", 0, adapter="h"))
    assert [c.seq.request_id for c in sched.schedule().chunks] == ["hot"]
    sched.add(_seq("stray", 1, adapter="s"))
    assert [c.seq.request_id for c in sched.schedule().chunks] == ["hot"]  # held: s is not running
    clock.now = 0.05
    sched.add(_seq("company", 2, adapter="s"))  # two of s now wait: admitted together
    assert {c.seq.request_id for c in sched.schedule().chunks} == {"hot", "stray", "company"}
    sched.add(_seq("late", 3, adapter="x"))
    clock.now = 0.2  # past the window: mixed in alone
    assert "late" in {c.seq.request_id for c in sched.schedule().chunks}


# --- on the engine -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root: Path = tmp_path_factory.mktemp("policies")
    hf = build_hf_model("llama", seed=9)
    model_dir = save_hf_model(hf, root / "base")
    paths = [
        make_peft_adapter(hf, root / f"a{i}", r=8, target_modules=["q_proj", "v_proj"], seed=500 + i)
        for i in range(3)
    ]
    return {"model_dir": model_dir, "paths": paths, "hf": hf}


def _engine(env: dict, policy: str, num_blocks: int = 64, displace_after_ms: int = 500) -> Engine:
    # 3 sequences and 48 tokens a step: most requests wait, so the two policies order them differently.
    sched = SchedulerConfig(
        max_num_seqs=3, max_num_batched_tokens=48, policy=policy, locality_window_ms=5,
        displace_after_ms=displace_after_ms,
    )  # fmt: skip
    cache = CacheConfig(num_blocks=num_blocks)
    config = EngineConfig(model_dir=str(env["model_dir"]), cache=cache, scheduler=sched)
    llm = LLM.from_config(config)
    for i, path in enumerate(env["paths"]):
        llm.register_adapter(f"a{i}", path)
    return llm.engine


def _requests() -> list[tuple[str, list[int], str | None, str, int, SamplingParams]]:
    out = []
    for i in range(14):
        prompt = [(13 * i + 5 * j) % 90 + 3 for j in range(3 + (7 * i) % 29)]
        adapter = None if i % 4 == 3 else f"a{i % 3}"
        # greedy, and seeded sampling (a per-request generator: order-independent by design)
        params = SamplingParams(
            max_tokens=4 + i % 5, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True
        )
        out.append((f"r{i}", prompt, adapter, "ab"[i % 3 == 0], i % 3, params))
    return out


@dataclass
class _Ran:
    outputs: dict[str, list[int]]  # request id -> generated token ids
    aborted: set[str] = field(default_factory=set)
    order: list[str] = field(default_factory=list)  # request ids in the order they first got rows
    preemptions: int = 0


def _run(e: Engine, abort_at: tuple[int, ...] = (), late: str | None = None) -> _Ran:
    """Run every request (those of tenant `late` only after the first step); at each step in
    `abort_at`, cancel one in the next phase of (queued, prefilling, decoding) that has one."""

    def add(now: bool) -> None:
        for rid, prompt, adapter, tenant, priority, params in _requests():
            if (tenant != late) == now:
                e.add_request(rid, prompt, params, adapter, tenant=tenant, priority=priority)

    add(now=True)
    phases = [
        lambda s: s in e.scheduler.waiting,
        lambda s: s in e.scheduler.running and not s.output_token_ids,
        lambda s: s in e.scheduler.running and bool(s.output_token_ids),
    ]
    ran = _Ran({})
    aborted = ran.aborted
    step = 0
    while e.has_unfinished():
        if step == 1 and late is not None:
            add(now=False)
        if step in abort_at and phases:
            live = [s for s in e._seqs.values() if not s.is_finished]
            for i, phase in enumerate(phases):
                victim = next((s for s in live if phase(s)), None)
                if victim is not None:
                    assert e.abort(victim.request_id)
                    aborted.add(victim.request_id)
                    del phases[i]
                    break
        e.step()
        e.check_integrity()
        stats = e.last_stats
        assert stats is not None
        ran.order += [rid for rid in stats.rows_per_request if rid not in ran.order]
        ran.preemptions += len(stats.preempted)
        step += 1
    ran.outputs = {rid: e.output(rid).token_ids for rid, *_ in _requests()}
    return ran


@pytest.fixture(scope="module")
def fcfs(env: dict) -> _Ran:
    return _run(_engine(env, "fcfs"))


@pytest.fixture(scope="module")
def peft_greedy(env: dict) -> dict[str, list[int]]:
    """transformers + PEFT's tokens for each greedy request."""
    greedy = [r for r in _requests() if r[5].temperature == 0.0]
    model = load_peft_mixture(env["hf"], {f"a{i}": p for i, p in enumerate(env["paths"])})
    steps = max(r[5].max_tokens for r in greedy)
    runs = mixed_batch_greedy(model, [r[1] for r in greedy], [r[2] for r in greedy], steps)
    return {r[0]: run.tokens[: r[5].max_tokens] for r, run in zip(greedy, runs, strict=True)}


def test_the_adaptive_policy_changes_the_order_never_the_outputs(
    env: dict, fcfs: _Ran, peft_greedy: dict[str, list[int]]
) -> None:
    assert fcfs.order == [rid for rid, *_ in _requests()] and fcfs.preemptions == 0
    adaptive = _run(_engine(env, "adaptive"))
    # The comparison means something only if the order really differed.
    assert adaptive.order != fcfs.order and sorted(adaptive.order) == sorted(fcfs.order)
    assert adaptive.outputs == fcfs.outputs
    for rid, tokens in peft_greedy.items():
        assert fcfs.outputs[rid] == tokens, rid


def test_preempting_for_kv_space_changes_no_output(
    env: dict, fcfs: _Ran, peft_greedy: dict[str, list[int]]
) -> None:
    # 5 blocks of 16 for 3 sequences of up to 39 tokens (3 blocks): running ones are preempted.
    for policy in ("fcfs", "adaptive"):
        tight = _run(_engine(env, policy, num_blocks=5))
        assert tight.preemptions > 0, policy
        assert tight.outputs == fcfs.outputs, policy
        for rid, tokens in peft_greedy.items():
            assert tight.outputs[rid] == tokens, (policy, rid)


def test_a_late_tenant_displacing_running_sequences_changes_no_output(env: dict, fcfs: _Ran) -> None:
    # Tenant a's requests fill the 3 slots before b's arrive; KV never runs short here, so every
    # preemption is b, under its share of the slots, taking one from a (engine/decode_policies.py).
    late = _run(_engine(env, "adaptive", displace_after_ms=0), late="b")
    assert late.preemptions > 0
    assert late.outputs == fcfs.outputs


def test_cancelling_at_every_phase_frees_everything(env: dict, fcfs: _Ran) -> None:
    e = _engine(env, "adaptive")
    ran = _run(e, abort_at=(0, 1, 2, 3, 4, 5, 6, 7, 8))
    aborted = ran.aborted
    assert len(aborted) == 3  # one queued, one prefilling, one decoding
    for rid, tokens in ran.outputs.items():
        if rid not in aborted:
            assert tokens == fcfs.outputs[rid], rid
    # nothing waits or runs, and check_integrity (every step) found no block or adapter hold
    # but the live requests'
    assert not e.scheduler.waiting and not e.scheduler.running


def test_llm_generate_passes_priorities_and_deadlines_and_bad_deadlines_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    llm = LLM(str(DEMO_MODEL_DIR))
    engine = llm.engine
    seen: list[tuple[float | None, int]] = []
    original = engine.add_request

    def add_request(request_id: str, *args: Any, **kwargs: Any) -> None:  # noqa: ANN401
        original(request_id, *args, **kwargs)
        seq = engine.sequence(request_id)
        seen.append((seq.deadline_s, seq.priority))

    monkeypatch.setattr(engine, "add_request", add_request)
    params = SamplingParams(max_tokens=1)
    llm.generate(["ab=", "cd="], params, deadline_s=[0.5, None], priority=[2, 0])
    assert seen == [(0.5, 2), (None, 0)]
    bad = (0, -1.0, float("nan"), float("inf"))
    for deadline in bad:
        with pytest.raises(ValueError, match="deadline_s must be a positive number of seconds"):
            llm.generate(["ab=", "cd="], params, deadline_s=[1.0, deadline])
    # each refused batch's first request was admitted, then withdrawn with the batch
    assert seen[2:] == [(1.0, 0)] * len(bad) and not engine.has_unfinished()

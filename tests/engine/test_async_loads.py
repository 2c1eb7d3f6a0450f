"""An adapter load in flight never stops the step loop, and its slot is used only once the copy is done.

On the CPU the copy is completed by hand (tests/adapters/test_h2d_copy.py's copier writes NaN into
the reserved room until then); on CUDA a real side-stream copy is held back by a GPU sleep queued
before it. Either way a decoding request keeps stepping while the load is in flight, the cold
request runs only after the load has been committed, and every output equals the output of an
engine with every adapter resident. With one slot and two loads wanted, neither evicts the other
before a step was planned with it (else the adaptive policy's starved request never ran).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers.tiny_models import build_hf_model, make_peft_adapter, save_hf_model

from loraplex import LLM, SamplingParams
from loraplex.adapters.h2d_copy import AsyncLoads, CopyEvent, StreamCopier
from loraplex.config import EngineConfig, LoRAConfig, SchedulerConfig
from loraplex.engine.engine import Engine
from loraplex.engine.policies import AdaptivePolicy
from loraplex.lora.weights import AdapterWeights
from loraplex.types import AdapterRef

SHORT = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
HOT, COLD = [5, 9, 14, 3, 22], [7, 8, 31, 2]


def _setup(tmp: Path, device: str, dtype: str) -> tuple[list[list[int]], LLM]:
    """The all-resident outputs of hot (alone) and cold (alone), and an engine whose device pool
    has room for two adapters of three: a0 and a1 resident, a2 in the host tier only."""
    hf = build_hf_model("llama", seed=3)
    model_dir = save_hf_model(hf, tmp / "base")
    paths = [make_peft_adapter(hf, tmp / f"a{i}", r=8, target_modules=TARGETS, seed=50 + i) for i in range(3)]
    ref = LLM(model_dir, device=device, dtype=dtype, adapter_device_bytes=1 << 26)
    for i, p in enumerate(paths):
        ref.register_adapter(f"a{i}", p)
    want = [ref.generate([HOT], LONG, ["a0"])[0].token_ids, ref.generate([COLD], SHORT, ["a2"])[0].token_ids]
    footprint = max(ref.engine.tiers.pool.allocated_of(r) for r in ref.engine.residency.resident_revisions())
    tiered = LLM(model_dir, device=device, dtype=dtype, adapter_device_bytes=2 * footprint)
    for i, p in enumerate(paths):
        tiered.register_adapter(f"a{i}", p)
    assert tiered.engine.residency.num_resident == 2
    return want, tiered


def _hot_while_cold_loads(e: Engine, release: Callable[[], None]) -> int:
    """Hot (a0, resident) decodes; "cold" (a2) arrives and its load evicts a1 and starts. Hot
    must decode to its end while the copy is in flight, and cold must not run before `release`
    lets the copy complete. Returns the steps taken while the copy was in flight."""
    copies = e.tiers.copies
    assert copies is not None
    e.add_request("hot", HOT, LONG, "a0")
    e.step()
    e.add_request("cold", COLD, SHORT, "a2")
    e.step()  # the step's poll places a2: a1 evicted, a2's room reserved, its copy queued
    assert len(copies) == 1, "a2's load did not start"
    steps = 0
    while not e.output("hot").finished:
        assert len(copies) == 1, "the copy completed before hot finished"
        assert not e.output("cold").token_ids, "cold ran before its copy completed"
        e.step()
        steps += 1
    release()
    while e.has_unfinished():
        e.step()
    return steps


def test_async_load_on_cpu_with_a_manual_copier(tmp_path: Path) -> None:
    from adapters.test_h2d_copy import ManualCopier

    want, tiered = _setup(tmp_path, "cpu", "float32")
    e = tiered.engine
    copier = ManualCopier()
    e.tiers.copies = AsyncLoads(e.residency, copier)
    steps = _hot_while_cold_loads(e, lambda: copier.events[0].complete())
    assert steps >= LONG.max_tokens - 2
    assert [e.output("hot").token_ids, e.output("cold").token_ids] == want
    assert e.tiers.stats()["loads"] == 1 and e.tiers.stats()["evictions"] == 1


def _calibrated_sleep(seconds: float) -> int:
    """GPU clock cycles that `torch.cuda._sleep` needs to last about `seconds`."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    torch.cuda._sleep(cycles)  # the first call pays one-time costs that would shorten the estimate
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles * seconds / (start.elapsed_time(end) / 1e3))


@pytest.mark.gpu
def test_async_load_on_cuda_keeps_decode_stepping(tmp_path: Path) -> None:
    """A real side-stream copy, held back 3 s by a GPU sleep queued before it on the side stream:
    the step stream (which syncs every step to read its tokens) is never blocked by it."""
    want, tiered = _setup(tmp_path, "cuda", "bfloat16")
    e = tiered.engine
    copies = e.tiers.copies
    assert isinstance(copies, AsyncLoads) and isinstance(copies.copier, StreamCopier)
    # warm up on the resident adapters: kernels compiled, decode graphs captured
    tiered.generate([HOT, COLD], LONG, ["a0", "a1"])
    tiered.generate([HOT], LONG, ["a0"])
    cycles = _calibrated_sleep(3.0)
    copies.copier.before_copy = lambda: torch.cuda._sleep(cycles)
    t0 = time.perf_counter()
    steps = _hot_while_cold_loads(e, lambda: None)
    assert steps >= LONG.max_tokens - 2
    # each request ran alone in its batch, as in the reference run: bf16 outputs match exactly
    assert [e.output("hot").token_ids, e.output("cold").token_ids] == want
    # the slot became usable only after the copy (behind the sleep) completed
    elapsed, latency = time.perf_counter() - t0, copies.latencies[-1][1]
    assert elapsed >= 1.5 and latency >= 1.5, f"run {elapsed:.2f} s, load latency {latency:.2f} s"
    rev = e.residency.resident_revisions()
    assert len(rev) == 2 and e.tiers.stats()["loads"] == 1


class _DoneCopier:
    """A side-stream copy whose event has completed by the next `poll` (a short one on CUDA)."""

    def copy(self, dst: AdapterWeights, src: AdapterWeights) -> CopyEvent:
        from adapters.test_h2d_copy import ManualEvent

        event = ManualEvent(dst, src)
        event.complete()
        return event


class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _adaptive_llm(
    tmp_path: Path, seed: int, clock: _Clock, max_num_seqs: int
) -> Callable[[int | None], tuple[LLM, list[AdapterRef]]]:
    """A tiny model with adapters a0..a3 (q_proj, r=8); returns a maker of LLMs over them on the
    adaptive policy (starvation bound 1 s, no locality window) with this much adapter device room
    (None: all), their clocks `clock`."""
    hf = build_hf_model("llama", seed=3)
    model_dir = save_hf_model(hf, tmp_path / "base")
    paths = [
        make_peft_adapter(hf, tmp_path / f"a{i}", r=8, target_modules=["q_proj"], seed=seed + i)
        for i in range(4)
    ]

    def make(device_bytes: int | None) -> tuple[LLM, list[AdapterRef]]:
        sched = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=64,
            policy="adaptive",
            max_wait_ms=1000,
            locality_window_ms=0,
        )
        lora = LoRAConfig(adapter_device_bytes=device_bytes)
        llm = LLM.from_config(EngineConfig(model_dir=str(model_dir), scheduler=sched, lora=lora))
        e = llm.engine
        e.scheduler.clock = clock
        assert isinstance(e.scheduler.policy, AdaptivePolicy)
        e.scheduler.policy._clock = clock
        return llm, [llm.register_adapter(f"a{i}", p) for i, p in enumerate(paths)]

    return make


def _cold_with_room(make: Callable[[int | None], tuple[LLM, list[AdapterRef]]], slots: int) -> LLM:
    """An LLM from `make` with device room for `slots` of its adapters, none of them resident."""
    ref, _ = make(None)
    footprint = max(ref.engine.tiers.pool.allocated_of(r) for r in ref.engine.residency.resident_revisions())
    llm, _ = make(slots * footprint)
    for revision in list(llm.engine.residency.resident_revisions()):
        llm.engine.residency.evict(revision)
    return llm


@pytest.mark.parametrize("copies", ["side-stream", "synchronous"])
def test_two_loads_for_one_slot_do_not_evict_each_other_before_a_step(tmp_path: Path, copies: str) -> None:
    """One device slot, nothing running, the adaptive policy: u0 (tenant c, a2, an urgent
    deadline, added once x0 is done) goes first and y0 (tenant b, a1, starved) next, while a1 is
    not ready. With side-stream copies, a1's copy was
    committed in one poll and a2's placement evicted it in the same poll, then a2's was committed
    and a1's placement evicted it: nothing ran again. Synchronously the same happened as long as a
    request for an adapter not resident arrived before every step (its load placed after the one
    asked for)."""
    clock = _Clock()
    llm = _cold_with_room(_adaptive_llm(tmp_path, 70, clock, max_num_seqs=1), 1)
    e, refs = llm.engine, [llm.engine.adapters.resolve(f"a{i}").ref for i in range(3)]
    if copies == "side-stream":
        e.tiers.copies = AsyncLoads(e.residency, _DoneCopier())
    e.add_request("x0", [5, 6, 7, 8], SHORT, "a0", tenant="a")
    e.step()
    e.add_request("y0", [14, 15, 16], SHORT, "a1", tenant="b")
    clock.now = 2.0  # y0 has waited past max_wait_ms
    while not e.output("x0").finished:
        e.step()
    e.add_request("u0", [17, 18], SHORT, "a2", tenant="c", deadline_s=0.05)
    a0 = refs[0].revision
    steps = 0
    while not (e.output("u0").finished and e.output("y0").finished):
        if copies == "synchronous":  # before every step, a request on an adapter not resident
            adapter = "a2" if e.residency.is_resident(a0) else "a0"
            e.add_request(f"z{steps}", [3, 4], SHORT, adapter, tenant="a")
        e.step()
        e.check_integrity()
        steps += 1
        assert steps <= 20, "no load survived until a step was planned with it"
    while e.has_unfinished():
        e.step()


def test_a_starved_request_drains_one_busy_adapter_while_the_other_keeps_admitting(tmp_path: Path) -> None:
    """Two device slots, both kept busy by tenant h on a0 and a1 (four sequences run at most),
    requests of each always queued;
    tenant r's request on a2 passes the starvation bound. One of a0/a1 drains (its queued
    requests do not keep it resident: their protection from eviction would keep the slot from
    a2's load forever), while the other goes on admitting, so the batch never empties; then a2
    loads into the drained slot and r's request runs. Requests on a3, not resident, arrive all
    along and start their loads at once: none takes the drained slot first. r's output equals a
    run of it alone."""
    clock = _Clock()
    make = _adaptive_llm(tmp_path, 90, clock, max_num_seqs=4)
    alone, _ = make(None)
    want = alone.generate([[21, 22, 23]], SHORT, ["a2"])[0].token_ids
    e = _cold_with_room(make, 2).engine
    count = 0
    lengths = (9, 14, 19, 24)  # staggered, so each adapter's sequences finish at different steps

    def keep_busy() -> None:  # three of a0's and three of a1's requests always waiting or running
        nonlocal count
        live = [s.adapter.revision for s in [*e.scheduler.running, *e.scheduler.waiting] if s.adapter]
        for _ in range(3):
            for name in ("a0", "a1"):
                revision = e.adapters.resolve(name).ref.revision
                if live.count(revision) < 3:
                    params = SamplingParams(max_tokens=lengths[count % 4], temperature=0.0, ignore_eos=True)
                    e.add_request(f"h{count}", [5, 6, 7, count % 50 + 8], params, name, tenant="h")
                    live.append(revision)
                    count += 1

    keep_busy()
    for _ in range(3):
        e.step()
        keep_busy()
    e.add_request("r0", [21, 22, 23], SHORT, "a2", tenant="r")
    e.step()
    clock.now = 2.0  # r0 has waited past max_wait_ms
    admitted_meanwhile, steps = set(), 0
    running_before = {s.request_id for s in e.scheduler.running}
    while "r0" not in {s.request_id for s in e.scheduler.running} and not e.output("r0").finished:
        keep_busy()
        e.add_request(f"x{steps}", [9, 10, 11], SHORT, "a3", tenant="x")
        e.step()
        e.check_integrity()
        running = {s.request_id for s in e.scheduler.running}
        assert e.last_stats is not None and e.last_stats.num_rows > 0, "a step ran nothing meanwhile"
        admitted_meanwhile |= running - running_before - {"r0"}
        running_before = running
        steps += 1
        assert steps <= 2 * max(lengths), "r0 was never given a slot"
    assert admitted_meanwhile, "nothing was admitted while one adapter drained"
    assert not any(s.request_id.startswith("x") for s in e.scheduler.running)
    while not e.output("r0").finished:
        e.step()
    assert e.output("r0").token_ids == want

"""More adapters than device room: loads on demand, eviction by policy, reloads, on the CPU.

Every output of a tiered engine (a device pool with room for a few adapters) must equal the
output of an engine with every adapter resident; evictions and reloads must have happened; a slow
load must not hold up other requests; cancelling releases references; a hot swap mid-decode keeps
the in-flight request on the old revision.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch
from helpers.tiny_models import build_hf_model, make_peft_adapter, save_hf_model

from loraplex import LLM, AdapterRef, SamplingParams
from loraplex.adapters.peft_import import ImportedAdapter, import_peft_adapter
from loraplex.adapters.revision import adapter_revision
from loraplex.adapters.tiers import AdapterTooLarge
from loraplex.engine.engine import Engine
from loraplex.lora.weights import AdapterWeights

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
TARGETS = [["q_proj", "v_proj"], ["o_proj", "down_proj"], ["q_proj", "k_proj", "up_proj"]]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("tiers")
    hf = build_hf_model("llama", seed=11)
    model_dir = save_hf_model(hf, root / "base")
    paths = [
        make_peft_adapter(hf, root / f"a{i}", r=(4, 8)[i % 2], target_modules=TARGETS[i % 3], seed=100 + i)
        for i in range(50)
    ]
    ref = LLM(model_dir, max_num_seqs=32)  # every adapter resident: the reference
    imported = [import_peft_adapter(p, ref.engine.model_config, 64, ref.engine.base) for p in paths]
    for i, imp in enumerate(imported):
        ref.engine.register_imported(f"a{i}", imp)
    footprint = max(ref.engine.tiers.pool.footprint(imp.weights) for imp in imported)
    return {"model_dir": model_dir, "ref": ref, "imported": imported, "footprint": footprint, "hf": hf}


def _prompt(i: int) -> list[int]:
    return [(7 * i + j * 13) % 90 + 3 for j in range(5 + i % 7)]


def _tiered(env: dict, room: int, n: int, store: bool = True, host_bytes: int | None = None) -> Engine:
    """An engine whose device pool holds `room` adapters, with adapters a0..a{n-1}; `store`: they
    come back from a store-like source (the disk tier), else only the host tier holds them."""
    llm = LLM(
        env["model_dir"],
        max_num_seqs=32,
        adapter_device_bytes=room * env["footprint"],
        adapter_host_bytes=host_bytes,
    )
    e = llm.engine
    if store:
        by_rev = {adapter_revision(imp): imp.weights for imp in env["imported"][:n]}
        e.tiers.source = by_rev.__getitem__
    for i in range(n):
        e.register_imported(f"a{i}", env["imported"][i])
    return e


def _reference(
    env: dict, requests: list[tuple[str, list[int], str | None]], params: SamplingParams = GREEDY
) -> dict[str, list[int]]:
    outs = env["ref"].generate([p for _, p, _ in requests], params, [a for _, _, a in requests])
    return {rid: o.token_ids for (rid, _, _), o in zip(requests, outs, strict=True)}


def _drive(
    e: Engine,
    requests: list[tuple[str, list[int], str | None]],
    per_step: int,
    on_step: Callable[[int], None] | None = None,
    params: SamplingParams = GREEDY,
) -> dict[str, list[int]]:
    """Add `per_step` requests before each step (staggered arrivals), step until all finish."""
    pending = list(requests)
    steps = 0
    while pending or e.has_unfinished():
        for rid, prompt, adapter in pending[:per_step]:
            e.add_request(rid, prompt, params, adapter)
        pending = pending[per_step:]
        e.step()
        e.check_integrity()
        e.tiers.pool.check_integrity()
        if on_step is not None:
            on_step(steps)
        steps += 1
        if not e.scheduler.running and e.tiers.busy:
            time.sleep(0.001)  # a load runs on the loader thread
        assert steps < 20_000, "the engine stopped making progress"
    outs = {rid: e.output(rid).token_ids for rid, _, _ in requests}
    for rid, _, _ in requests:
        e.release(rid)
    return outs


def test_twelve_adapters_room_for_three(env: dict) -> None:
    e = _tiered(env, room=3, n=12)
    requests = [(f"r{i}", _prompt(i), None if i % 9 == 8 else f"a{(i * 5) % 12}") for i in range(48)]
    assert _drive(e, requests, per_step=3) == _reference(env, requests)
    stats = e.tiers.stats()
    assert stats["evictions"] > 0 and stats["loads"] > 0, stats
    # mixed ranks: room for 3 of the largest, so a few more of the smaller ones, never all 12
    assert e.residency.num_resident < 12 and e.tiers.pool.allocated_bytes <= 3 * env["footprint"]


def test_host_only_adapters_never_dropped(env: dict) -> None:
    """No store: the host tier keeps every adapter even over its budget, and all outputs are right."""
    e = _tiered(env, room=2, n=6, store=False, host_bytes=1)
    requests = [(f"h{i}", _prompt(i), f"a{i % 6}") for i in range(18)]
    assert _drive(e, requests, per_step=4) == _reference(env, requests)
    assert len(e.tiers.host) == 6 and e.tiers.stats()["evictions"] > 0


def test_two_hundred_requests_fifty_adapters_four_slots(env: dict) -> None:
    e = _tiered(env, room=4, n=50, host_bytes=8 * env["footprint"])
    requests = [(f"q{i}", _prompt(i), f"a{(i * 7) % 50}") for i in range(200)]
    for rid, prompt, adapter in requests:  # all queued at once
        e.add_request(rid, prompt, GREEDY, adapter)
    assert _drive(e, [], per_step=0) == {}
    outs = {rid: e.output(rid).token_ids for rid, _, _ in requests}
    assert all(e.output(rid).finished for rid, _, _ in requests)
    assert outs == _reference(env, requests)
    assert e.tiers.stats()["disk"]["loads"] > 0  # type: ignore[index]


def test_an_adapter_larger_than_the_whole_device_budget_is_refused_at_admission(
    env: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    """No eviction can make room for it: registering says so, a request for it is refused with the
    sizes (not queued to end empty), and every other request runs as if it had never come."""
    pool = env["ref"].engine.tiers.pool
    sizes = [pool.footprint(imp.weights) for imp in env["imported"][:6]]
    small, big = sizes.index(min(sizes)), sizes.index(max(sizes))
    assert sizes[big] > sizes[small]
    e = LLM(env["model_dir"], max_num_seqs=32, adapter_device_bytes=sizes[small]).engine
    e.register_imported(f"a{small}", env["imported"][small])
    e.register_imported(f"a{big}", env["imported"][big])
    warned = capsys.readouterr().err
    assert f"warning: a{big}: " in warned and f"needs {sizes[big]} bytes" in warned
    assert f"a{small}:" not in warned
    with pytest.raises(AdapterTooLarge, match=f"more than the whole adapter device budget of {sizes[small]}"):
        e.add_request("too-big", _prompt(1), GREEDY, f"a{big}")
    e.check_integrity()  # it holds nothing
    requests = [(f"s{i}", _prompt(i), f"a{small}" if i % 2 else None) for i in range(6)]
    assert _drive(e, requests, per_step=2) == _reference(env, requests)


def test_a_failed_load_ends_its_requests_with_the_reason_and_nothing_else(env: dict) -> None:
    """The store cannot give back an evicted adapter: its requests end as "abort" with why (which
    the server turns into an error response), and every other request's output stays right."""
    e = _tiered(env, room=1, n=3, host_bytes=0)
    good = e.tiers.source
    assert good is not None

    def damaged(revision: str) -> AdapterWeights:
        if revision == adapter_revision(env["imported"][1]):
            raise OSError(f"store file of {revision[:12]} is damaged")
        return good(revision)

    e.tiers.source = damaged
    requests = [(f"f{i}", _prompt(i), (None, "a0", "a2")[i % 3]) for i in range(6)]
    e.add_request("lost", _prompt(9), GREEDY, "a1")
    assert _drive(e, requests, per_step=2) == _reference(env, requests)
    lost = e.output("lost")
    assert lost.finished and lost.finish_reason == "abort" and not lost.token_ids
    assert lost.error is not None and lost.error.startswith("adapter a1@") and "is damaged" in lost.error
    e.release("lost")
    e.tiers.source = good  # the store is whole again: the next request for it loads and runs
    again = [("back", _prompt(9), "a1")]
    assert _drive(e, again, per_step=1) == _reference(env, again)


def test_pressure_never_evicts_a_slot_in_use(env: dict) -> None:
    """Slow steps while loads finish on the loader thread: every slot a step runs keeps its
    weights (same tensors, same bytes) through the step, and outputs stay right."""
    e = _tiered(env, room=2, n=8, host_bytes=0)
    run = e.runner.run

    def slow_run(plan, slots, **kw):  # noqa: ANN001, ANN003, ANN202
        before = {s: e.lora_table.weights(s) for s in slots.generations}
        data = {s: [p.a.clone() for p in w.pairs.values()] for s, w in before.items()}
        time.sleep(0.005)
        out = run(plan, slots, **kw)
        for s, w in before.items():
            assert e.lora_table.weights(s) is w
            assert all(torch.equal(a, p.a) for a, p in zip(data[s], w.pairs.values(), strict=True))
        return out

    e.runner.run = slow_run  # type: ignore[method-assign]
    requests = [(f"p{i}", _prompt(i), f"a{(i * 3) % 8}") for i in range(24)]
    assert _drive(e, requests, per_step=2) == _reference(env, requests)
    assert e.tiers.stats()["evictions"] > 0


def _weights_bytes(w: AdapterWeights) -> list[bytes]:
    return [t.contiguous().numpy().tobytes() for k in sorted(w.pairs) for t in (w.pairs[k].a, w.pairs[k].b)]


@pytest.mark.parametrize("host_bytes", [None, 0], ids=["from-host", "from-store"])
def test_reload_is_bit_identical(env: dict, host_bytes: int | None) -> None:
    e = _tiered(env, room=1, n=3, host_bytes=host_bytes)
    rev0 = adapter_revision(env["imported"][0])
    _drive(e, [("x0", _prompt(0), "a0")], per_step=1)
    first = _weights_bytes(e.residency.weights(rev0))
    _drive(e, [("x1", _prompt(1), "a1"), ("x2", _prompt(2), "a2")], per_step=1)
    assert not e.residency.is_resident(rev0)
    _drive(e, [("x3", _prompt(3), "a0")], per_step=1)
    assert _weights_bytes(e.residency.weights(rev0)) == first


def test_slow_load_does_not_delay_other_requests(env: dict) -> None:
    e = _tiered(env, room=2, n=3)
    gate = threading.Event()
    source = e.tiers.source
    assert source is not None

    def slow(revision: str) -> AdapterWeights:
        gate.wait(30)
        return source(revision)

    _drive(e, [("w0", _prompt(0), "a0")], per_step=1)
    e.tiers.host.drop(adapter_revision(env["imported"][2]))
    e.tiers.residency.evict(adapter_revision(env["imported"][2]))
    e.tiers.source = slow
    e.add_request("cold", _prompt(5), GREEDY, "a2")
    e.add_request("hot", _prompt(6), SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True), "a0")
    steps = 0
    while not e.output("hot").finished:
        e.step()
        steps += 1
    assert steps >= 20 and not e.output("cold").token_ids  # hot ran to the end while cold waited
    gate.set()
    while e.has_unfinished():
        e.step()
        time.sleep(0.001)
    assert e.output("cold").token_ids == _reference(env, [("cold", _prompt(5), "a2")])["cold"]


def test_cancel_releases_references(env: dict) -> None:
    e = _tiered(env, room=1, n=3)
    gate = threading.Event()
    source = e.tiers.source
    assert source is not None
    e.tiers.source = lambda r: (gate.wait(30), source(r))[1]
    ref1 = e.adapters.latest("a1")
    # queued/loading: a1 is not resident (room for one: a2 registered last does not fit after a0)
    e.add_request("c0", _prompt(0), GREEDY, "a1")
    e.step()
    assert e.abort("c0") and e.adapters.holds(ref1) == 0
    gate.set()
    # decode: abort mid-way, then another adapter must be able to take the only slot
    e.add_request("c1", _prompt(1), SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), "a0")
    for _ in range(3):
        e.step()
    assert e.output("c1").token_ids
    assert e.abort("c1") and e.adapters.holds(e.adapters.latest("a0")) == 0
    out = _drive(e, [("c2", _prompt(2), "a1")], per_step=1)
    assert out == _reference(env, [("c2", _prompt(2), "a1")])
    e.check_integrity()


def test_hot_swap_mid_decode(env: dict) -> None:
    e = _tiered(env, room=2, n=2)
    old = e.adapters.latest("a0")
    long = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    e.add_request("old", _prompt(1), long, "a0")
    for _ in range(6):
        e.step()
    new_import: ImportedAdapter = env["imported"][7]
    e.tiers.source = {
        **{adapter_revision(i): i.weights for i in env["imported"][:2]},
        adapter_revision(new_import): new_import.weights,
    }.__getitem__
    new = e.register_imported("a0", new_import)
    e.retire_adapter(old)
    e.add_request("new", _prompt(1), long, "a0")
    assert e.output("new").adapter == new
    while e.has_unfinished():
        e.step()
    ref = env["ref"]
    want_old = ref.generate([_prompt(1)], long, "a0")[0].token_ids
    want_new = ref.generate([_prompt(1)], long, "a7")[0].token_ids
    assert e.output("old").token_ids == want_old and e.output("old").adapter == old
    assert e.output("new").token_ids == want_new
    assert not e.residency.is_resident(old.revision)  # drained and dropped
    assert AdapterRef("a0", new.revision) == new


def test_budget_flags_reach_the_config() -> None:
    import argparse

    from loraplex.config_cli import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--adapter-device-bytes", "4096", "--adapter-host-bytes", "0"])
    lora = engine_config_from_args("m", args).lora
    assert (lora.adapter_device_bytes, lora.adapter_host_bytes) == (4096, 0)
    with pytest.raises(ValueError, match="adapter_device_bytes"):
        engine_config_from_args("m", parser.parse_args(["--adapter-device-bytes", "8"]))

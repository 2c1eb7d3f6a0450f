"""Per-tenant residency limits on a real (tiny) engine, on the CPU: a tenant flooding cold adapters
never evicts another tenant's guaranteed adapter, a tenant over its cold-load rate waits (others
keep running) or is refused, and the residency measurements move under eviction pressure. Every
output equals the output of an engine with every adapter resident."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers.tiny_models import build_hf_model, make_peft_adapter, save_hf_model

from engine.test_tiered_residency import _drive, _reference
from loraplex import LLM, SamplingParams
from loraplex.adapters.eviction import TenantLimits
from loraplex.adapters.peft_import import import_peft_adapter
from loraplex.adapters.revision import adapter_revision
from loraplex.adapters.tiers import ColdLoadLimited
from loraplex.engine.engine import Engine

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
N = 9  # a0 is the steady tenant's; a1.. the flooding tenant's


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root: Path = tmp_path_factory.mktemp("tenants")
    hf = build_hf_model("llama", seed=5)
    model_dir = save_hf_model(hf, root / "base")
    paths = [
        make_peft_adapter(hf, root / f"a{i}", r=8, target_modules=["q_proj", "v_proj"], seed=300 + i)
        for i in range(N)
    ]
    ref = LLM(model_dir, max_num_seqs=16)
    imported = [import_peft_adapter(p, ref.engine.model_config, 64, ref.engine.base) for p in paths]
    for i, imp in enumerate(imported):
        ref.engine.register_imported(f"a{i}", imp)
    footprint = max(ref.engine.tiers.pool.footprint(imp.weights) for imp in imported)
    return {"model_dir": model_dir, "ref": ref, "imported": imported, "footprint": footprint}


def _tenant(i: int) -> str:
    return "steady" if i == 0 else "flood"


def _engine(env: dict, room: int, host_bytes: int, limits: dict[str, TenantLimits]) -> Engine:
    """Room for `room` adapters on the device, a store behind them, a0..a8 registered with nothing
    resident (the pool fills by demand, not by registration order)."""
    e = LLM(
        env["model_dir"],
        max_num_seqs=16,
        adapter_device_bytes=room * env["footprint"],
        adapter_host_bytes=host_bytes,
    ).engine
    e.tiers.source = {adapter_revision(imp): imp.weights for imp in env["imported"]}.__getitem__
    e.tiers.set_tenant_limits(limits)
    for i, imp in enumerate(env["imported"]):
        e.register_imported(f"a{i}", imp, tenant=_tenant(i))
    for revision in list(e.residency.resident_revisions()):
        e.residency.evict(revision)  # start cold: the pool fills by demand
    return e


def _prompt(i: int) -> list[int]:
    return [(11 * i + 7 * j) % 90 + 3 for j in range(4 + i % 5)]


def _run(e: Engine, requests: list[tuple[str, list[int], str]], per_step: int, check=None) -> dict:  # noqa: ANN001
    on_step = None if check is None else lambda _step: check()
    return _drive(e, list(requests), per_step, on_step, GREEDY)


def _flood(env: dict, e: Engine) -> tuple[dict, bool]:
    """The steady tenant uses a0 once; then the flooding tenant cycles through a1..a8. Returns the
    outputs and whether a0 stayed on the device through the flood."""
    steady_rev = adapter_revision(env["imported"][0])
    first = [("s0", _prompt(0), "a0")]
    outs = _run(e, first, per_step=1)
    assert e.residency.is_resident(steady_rev)
    kept = [True]

    def check() -> None:
        kept[0] = kept[0] and e.residency.is_resident(steady_rev)

    flood = [(f"f{i}", _prompt(i), f"a{1 + (i * 3) % (N - 1)}") for i in range(24)]
    outs.update(_run(e, flood, per_step=2, check=check))
    assert outs == _reference(env, first + flood, GREEDY)
    return outs, kept[0]


def test_flooding_tenant_cannot_evict_a_guaranteed_adapter(env: dict) -> None:
    guarantee = {"steady": TenantLimits(guaranteed_adapters=1)}
    e = _engine(env, room=3, host_bytes=0, limits=guarantee)
    _, kept = _flood(env, e)
    assert kept and e.tiers.stats()["evictions"] > 0
    # The same flood without the guarantee does evict it: the test above is not vacuous.
    unguarded = _engine(env, room=3, host_bytes=0, limits={})
    _, kept = _flood(env, unguarded)
    assert not kept
    # A guarantee in bytes protects the same way.
    by_bytes = _engine(env, room=3, host_bytes=0, limits={"steady": TenantLimits(guaranteed_bytes=1)})
    assert _flood(env, by_bytes)[1]


def test_limits_change_at_runtime(env: dict) -> None:
    """Limits set between steps apply to the next placement: the guarantee is lifted mid-service."""
    e = _engine(env, room=3, host_bytes=0, limits={"steady": TenantLimits(guaranteed_adapters=1)})
    assert _flood(env, e)[1]
    e.tiers.set_tenant_limits({})
    assert e.tiers.tenants().get("steady", {}).get("limits", {}).get("guaranteed_adapters", 0) == 0
    flood = [(f"g{i}", _prompt(i), f"a{1 + (i * 5) % (N - 1)}") for i in range(12)]
    _run(e, flood, per_step=2)
    assert not e.residency.is_resident(adapter_revision(env["imported"][0]))


def test_over_the_cold_load_rate_a_request_waits_and_others_run(env: dict) -> None:
    now = [0.0]
    per_minute = env["footprint"]  # one cold load per minute, the bucket full at the start
    e = _engine(
        env, room=3, host_bytes=0, limits={"flood": TenantLimits(cold_load_bytes_per_minute=per_minute)}
    )
    e.tiers.clock = lambda: now[0]
    e.add_request("x1", _prompt(1), GREEDY, "a1")  # pays the whole bucket
    e.add_request("x2", _prompt(2), GREEDY, "a2")  # must wait a minute
    e.add_request("s", _prompt(0), GREEDY, "a0")  # the steady tenant: no limit
    e.add_request("b", _prompt(3), GREEDY, None)  # the base model
    for _ in range(400):
        e.step()
        e.check_integrity()
        if all(e.output(r).finished for r in ("x1", "s", "b")):
            break
        time.sleep(0.001)
    assert all(e.output(r).finished for r in ("x1", "s", "b"))
    assert not e.output("x2").token_ids and e.tiers.where()["waiting_for_cold_load_rate"]
    assert e.tiers.stats()["cold_load_waits"] >= 1
    now[0] = 60.0  # a minute later the bucket has refilled
    _run(e, [], per_step=0)
    got = {r: e.output(r).token_ids for r in ("x1", "x2", "s", "b")}
    want = _reference(
        env,
        [
            ("x1", _prompt(1), "a1"),
            ("x2", _prompt(2), "a2"),
            ("s", _prompt(0), "a0"),
            ("b", _prompt(3), None),
        ],
        GREEDY,
    )
    assert got == want


def test_over_the_cold_load_rate_a_request_is_refused_when_limits_say_so(env: dict) -> None:
    limits = TenantLimits(cold_load_bytes_per_minute=env["footprint"], cold_load_over_rate="refuse")
    e = _engine(env, room=3, host_bytes=0, limits={"flood": limits})
    e.tiers.clock = lambda: 0.0
    e.add_request("x1", _prompt(1), GREEDY, "a1")
    with pytest.raises(ColdLoadLimited, match="over its cold-load rate") as err:
        e.add_request("x2", _prompt(2), GREEDY, "a2")
    assert err.value.retry_after_s == pytest.approx(60.0)
    e.add_request("x3", _prompt(3), GREEDY, "a1")  # already loading: nothing more to pay
    _run(e, [], per_step=0)
    e.check_integrity()  # the refused request holds nothing
    assert e.tiers.stats()["cold_load_refusals"] == 1


def test_residency_measurements_move_under_pressure(env: dict) -> None:
    e = _engine(env, room=2, host_bytes=3 * env["footprint"], limits={})
    requests = [(f"m{i}", _prompt(i), f"a{(i * 4) % N}") for i in range(30)]
    assert _run(e, requests, per_step=3) == _reference(env, requests, GREEDY)
    stats = e.tiers.stats()
    assert stats["evictions"] > 0 and stats["stalled_requests"] > 0
    assert stats["host_to_device_bytes"] > 0 and stats["stall_seconds"] > 0
    loads = stats["load_seconds"]
    assert loads["disk"]["count"] > 0 and loads["host"]["count"] > 0, loads
    ttft = stats["ttft_seconds_by_admission_tier"]
    assert ttft["disk"]["count"] > 0 and ttft["device"]["count"] > 0, ttft
    assert sum(h["count"] for h in ttft.values()) == 30
    assert stats["device"]["hits"] + stats["host_admissions"] + stats["disk"]["hits"] == 30

"""A server whose device pool holds one demo adapter: concurrent traffic over all four demo task
adapters is answered exactly as with every adapter resident (evicted adapters come back from the
host tier or the store), and the tiers show in `/metrics` and `GET /admin/v1/residency`."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from helpers.admin_server import ADMIN, MODEL, admin, auth, complete, demo_footprint, sources, text
from helpers.live_server import live_server

from loraplex import LLM, SamplingParams, cli
from loraplex.config import LoRAConfig
from loraplex.demo import DEMO_ADAPTERS
from loraplex.demo.tasks import held_out_inputs, make_prompt


@pytest.mark.parametrize("host_bytes", [None, 0], ids=["host-tier", "store-only"])
def test_room_for_one_demo_adapter(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, host_bytes: int | None
) -> None:
    monkeypatch.setenv("LORAPLEX_ADMIN_KEY", ADMIN)
    room = max(demo_footprint(p) for p in DEMO_ADAPTERS.values())
    lora = LoRAConfig(adapter_device_bytes=room, adapter_host_bytes=host_bytes)
    demo = {k: str(v) for k, v in DEMO_ADAPTERS.items()}
    prompts = [make_prompt(t) for t in held_out_inputs(3)]
    jobs = [(task, p) for p in prompts for task in demo]
    reference = LLM(MODEL)
    for name, path in demo.items():
        reference.register_adapter(name, path)
    params = SamplingParams(max_tokens=16, temperature=0.0)
    want = [o.text for o in reference.generate([p for _, p in jobs], params, [t for t, _ in jobs])]
    root = sources(tmp_path / "sources")
    with live_server(MODEL, demo, source_roots=(str(root),), lora=lora) as (base, _):
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda job: complete(base, ADMIN, job[0], job[1]), jobs))
        assert [r.json()["choices"][0]["text"] for r in got] == want
        report = admin("GET", base, "/residency")
        assert report.status_code == 200, report.text
        body = report.json()
        assert body["tiers"]["evictions"] > 0 and body["tiers"]["loads"] > 0
        # room for the largest demo adapter: one of it, or two smaller ones, never all four
        on_device = body["adapters"]["device"]
        assert 1 <= len(on_device) < len(demo) and all(a["names"] for a in on_device)
        metrics = httpx.get(f"{base}/metrics", headers=auth(ADMIN)).text
        assert 'loraplex_adapter_tier_budget_bytes{tier="device"}' in metrics
        evictions = re.search(r"^loraplex_adapter_evictions_total (\S+)$", metrics, re.M)
        assert evictions and float(evictions.group(1)) == body["tiers"]["evictions"]
        admitted = re.findall(r'^loraplex_adapter_admissions_total\{tier="(\w+)"\} (\S+)$', metrics, re.M)
        assert sum(float(n) for _, n in admitted) == len(jobs)
        loads = re.findall(r'^loraplex_adapter_load_seconds_count\{tier="\w+"\} (\S+)$', metrics, re.M)
        assert sum(float(n) for n in loads) == body["tiers"]["loads"]  # loads: the histogram's counts
        for gone in ("loraplex_adapter_tier_hits", "loraplex_adapter_residency_events"):
            assert gone not in metrics  # one series per number: the counters above


def test_an_adapter_larger_than_the_device_budget_gets_a_clear_400(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Room for the smallest demo adapter only: a request for the largest is refused with its size
    and the budget's flag, non-streaming and streaming, not answered with an empty aborted text;
    the other adapters keep answering right."""
    monkeypatch.setenv("LORAPLEX_ADMIN_KEY", ADMIN)
    sizes = {name: demo_footprint(path) for name, path in DEMO_ADAPTERS.items()}
    small, big = min(sizes, key=sizes.__getitem__), max(sizes, key=sizes.__getitem__)
    assert sizes[big] > sizes[small]
    lora = LoRAConfig(adapter_device_bytes=sizes[small])
    demo = {k: str(v) for k, v in DEMO_ADAPTERS.items()}
    prompt = make_prompt(held_out_inputs(1)[0])
    reference = LLM(MODEL)
    reference.register_adapter(small, demo[small])
    want = reference.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0), [small])[0].text
    root = sources(tmp_path / "sources")
    with live_server(MODEL, demo, source_roots=(str(root),), lora=lora) as (base, _):
        for stream in (False, True):
            body = {"model": big, "prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": stream}
            refused = httpx.post(f"{base}/v1/completions", json=body, headers=auth(ADMIN), timeout=60)
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["code"] == "adapter_exceeds_device_budget"
            assert (
                f"needs {sizes[big]} bytes" in error["message"]
                and "--adapter-device-bytes" in error["message"]
            )
        assert complete(base, ADMIN, small, prompt).json()["choices"][0]["text"] == want
        # registering one through the admin API says so in the reply, and keeps the revision
        for name, path, warned in (("big2", big, True), ("small2", small, False)):
            body = {"name": name, "source": str(root / path), "visibility": "shared"}
            reg = admin("POST", base, "/adapters", json=body)
            assert reg.status_code == 201, reg.text
            warnings = reg.json()["warnings"]
            if warned:
                assert len(warnings) == 1 and f"needs {sizes[big]} bytes" in warnings[0], warnings
                assert "--adapter-device-bytes" in warnings[0]
            else:
                assert warnings == []
        assert complete(base, ADMIN, "small2", prompt).json()["choices"][0]["text"] == want
        capsys.readouterr()
        argv = ["adapters", "register", "big3", str(root / big), "--url", base, "--key", ADMIN]
        assert cli.main(argv) == 0
        out, err = capsys.readouterr()
        assert json.loads(out)["warnings"] and "warning: adapter revision" in err
        assert f"needs {sizes[big]} bytes" in err


def test_an_adapter_the_store_lost_gets_an_error_not_an_empty_text(monkeypatch: pytest.MonkeyPatch) -> None:
    """Room for the largest demo adapter, no host tier: another adapter comes back from the store.
    With its store file gone, a request for it gets a 503 naming it (streaming: an error event),
    and the other adapters keep answering right."""
    monkeypatch.setenv("LORAPLEX_ADMIN_KEY", ADMIN)
    sizes = {name: demo_footprint(path) for name, path in DEMO_ADAPTERS.items()}
    lora = LoRAConfig(adapter_device_bytes=max(sizes.values()), adapter_host_bytes=0)
    demo = {k: str(v) for k, v in DEMO_ADAPTERS.items()}
    reference = LLM(MODEL)
    for name, path in demo.items():
        reference.register_adapter(name, path)
    outs = reference.generate(
        ["abc="] * len(demo), SamplingParams(max_tokens=16, temperature=0.0), list(demo)
    )
    want = {name: out.text for name, out in zip(demo, outs, strict=True)}
    with live_server(MODEL, demo, lora=lora) as (base, server):
        engine = server.async_engine.engine
        lost = next(
            name
            for name in demo
            if not engine.residency.is_resident(engine.adapters.latest(name).revision)
            and engine.adapters.latest(name).revision not in engine.tiers.host
        )
        server.control.store.path(engine.adapters.latest(lost).revision).unlink()
        refused = complete(base, ADMIN, lost)
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == "adapter_load_failed" and error["message"].startswith(f"adapter {lost}@")
        streamed = complete(base, ADMIN, lost, stream=True)
        assert streamed.status_code == 200  # the headers went out before the load failed
        events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert any('"adapter_load_failed"' in event for event in events), events
        assert events[-1] == "[DONE]"
        for name in demo:
            if name != lost:
                assert text(complete(base, ADMIN, name)) == want[name]

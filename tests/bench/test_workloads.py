from __future__ import annotations

from collections import Counter

import pytest

from loraplex.bench.popularity import POPULARITIES, adapter_choices, row_slots, spread


def test_popularities_shape_the_draws() -> None:
    n, k = 2000, 16
    assert set(adapter_choices(n, k, "identical")) == {0}
    assert adapter_choices(5, k, "distinct") == [0, 1, 2, 3, 4]
    assert len(set(adapter_choices(n, k, "uniform", seed=1))) == k
    zipf = Counter(adapter_choices(n, k, "zipf:1.5", seed=2))
    assert zipf[0] > zipf[1] > zipf[7]
    skew = Counter(adapter_choices(n, k, "skewed", seed=3))
    assert 0.4 < skew[0] / n < 0.6 and len(skew) == k
    for p in POPULARITIES:  # deterministic per seed
        assert adapter_choices(50, k, p, seed=9) == adapter_choices(50, k, p, seed=9)


def test_bad_popularity_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="popularity"):
        adapter_choices(3, 2, "pareto")


def test_spread_and_rows() -> None:
    s = spread(64, 32, seed=0)
    assert Counter(s) == Counter({i: 2 for i in range(32)})
    assert row_slots([1, 0], 3) == [1, 1, 1, 0, 0, 0]
    assert row_slots([1, 0, 2], [1, 2, 1], slots=[10, 11, 12], base_every=2) == [11, -1, -1, 12]


# --- serving workloads ---------------------------------------------------------------------------


def test_serving_workload_is_deterministic_and_shaped_by_its_spec() -> None:
    from loraplex.bench.workloads import WorkloadSpec, generate

    spec = WorkloadSpec(seed=3, num_requests=4000, num_adapters=32, popularity="zipf:1.0", base_share=0.2)
    w = generate(spec)
    assert w.to_dict() == generate(spec).to_dict()
    assert w.to_dict() != generate(WorkloadSpec(seed=4, num_requests=4000)).to_dict()
    base = sum(r.adapter is None for r in w.requests) / len(w.requests)
    assert 0.17 < base < 0.23
    counts = Counter(r.adapter for r in w.requests if r.adapter is not None)
    assert counts[0] > counts[1] > counts[10] and len(counts) == 32
    assert all(128 <= r.prompt_len <= 1024 and 64 <= r.output_len <= 256 for r in w.requests)
    lengths = [r.prompt_len for r in w.requests]
    assert min(lengths) < 140 and max(lengths) > 1010  # the whole range is drawn
    assert w.adapter_ranks == [16] * 32 and w.concurrency == 64
    assert all(r.arrival_s is None for r in w.requests)
    assert {w.popularity_class(a) for a in (None, 0, 2, 31)} == {"base", "hot", "cold"}


def test_rank_mix_tenants_and_open_loop_arrivals() -> None:
    import statistics

    from loraplex.bench.workloads import WorkloadSpec, generate

    spec = WorkloadSpec(
        seed=1,
        num_requests=6000,
        num_adapters=1000,
        popularity="uniform",
        ranks="8:0.5,16:0.3,64:0.2",
        arrivals="poisson:100",
        tenants="big:3,small:1",
        prompt_len="uniform:8:512",
        output_len="fixed:32",
    )
    w = generate(spec)
    ranks = Counter(w.adapter_ranks)
    assert set(ranks) == {8, 16, 64} and ranks[8] > ranks[16] > ranks[64]
    times = [r.arrival_s for r in w.requests]
    assert times == sorted(times) and all(t is not None and t > 0 for t in times)
    # two tenants' own Poisson processes at 75 and 25 requests/s: together about 100/s
    by_tenant = Counter(r.tenant for r in w.requests)
    assert 0.72 < by_tenant["big"] / 6000 < 0.78
    assert 85 < 6000 / times[-1] < 115
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert 0.8 < statistics.pstdev(gaps) / statistics.mean(gaps) < 1.2  # exponential: CV about 1
    bursty = generate(WorkloadSpec(num_requests=3000, arrivals="gamma:100:3"))
    g = [b.arrival_s - a.arrival_s for a, b in zip(bursty.requests, bursty.requests[1:], strict=False)]
    assert statistics.pstdev(g) / statistics.mean(g) > 2
    assert all(8 <= r.prompt_len <= 512 and r.output_len == 32 for r in w.requests)


def test_conversations_file_and_bad_specs(tmp_path) -> None:  # noqa: ANN001
    import json

    from loraplex.bench.workloads import WorkloadSpec, generate

    path = tmp_path / "conv.jsonl"
    lines = [
        {"prompt": "hello there", "output_tokens": 7},
        {"messages": [{"role": "user", "content": "what is 2+2?"}], "completion": "four"},
        {"prompt": "no output length"},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    w = generate(WorkloadSpec(num_requests=50, conversations=str(path), output_len="fixed:9"))
    prompts = {r.prompt for r in w.requests}
    assert prompts == {"hello there", "what is 2+2?", "no output length"}
    assert {(r.prompt, r.output_len) for r in w.requests} == {
        ("hello there", 7),
        ("what is 2+2?", 4),
        ("no output length", 9),
    }
    bad_file = tmp_path / "bad.jsonl"
    bad_file.write_text('{"prompt": ""}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        generate(WorkloadSpec(num_requests=2, conversations=str(bad_file)))
    for bad in (
        {"prompt_len": "uniform:9:3"},
        {"output_len": "normal:3"},
        {"ranks": "0"},
        {"arrivals": "poisson:-1"},
        {"arrivals": "closed:0"},
        {"tenants": "a:1,a:2"},
        {"popularity": "pareto"},
        {"base_share": 1.5},
        {"num_adapters": 0},
    ):
        with pytest.raises(ValueError):
            WorkloadSpec(**bad)
    assert WorkloadSpec(num_adapters=0, base_share=1.0).num_adapters == 0


def test_deadlines_per_tenant_and_burst_arrivals() -> None:
    from dataclasses import replace

    from loraplex.bench.workloads import WorkloadSpec, generate

    spec = WorkloadSpec(
        num_requests=3000, arrivals="burst:10:4:10:2", tenants="a:1,b:1", deadlines="b:250", base_share=0.5
    )
    w = generate(spec)
    assert {r.deadline_s for r in w.requests if r.tenant == "b"} == {0.25}
    assert {r.deadline_s for r in w.requests if r.tenant == "a"} == {None}
    assert {r.deadline_s for r in generate(replace(spec, deadlines="100")).requests} == {0.1}
    # per tenant at 5/s, 20/s for the first 2 s of every 10: ~ 4 x the arrivals per second in bursts
    times = [r.arrival_s or 0.0 for r in w.requests if r.tenant == "a"]
    in_burst = sum(1 for t in times if t % 10 < 2) / 2
    outside = sum(1 for t in times if t % 10 >= 2) / 8
    assert 2.5 < in_burst / outside < 5.5
    for bad in ("c:100", "a:-1", "x"):
        with pytest.raises(ValueError, match="deadlines"):
            replace(spec, deadlines=bad)
    with pytest.raises(ValueError, match="arrivals"):
        replace(spec, arrivals="burst:10:4:10:20")  # a burst longer than its period

"""`python -m loraplex.bench.eager_host`: a small run plans one prefill chunk per request and
times the runner's host work around a stubbed model."""

from __future__ import annotations

from loraplex.bench.eager_host import main, measure


def test_eager_host_measures_the_planned_rows(capsys) -> None:  # noqa: ANN001
    r = measure(requests=3, prompt=40, adapters=2, repeats=2)
    assert r["rows"] == 120 and 0 < r["min_ms"] <= r["median_ms"]
    main(["--requests", "2", "--prompt", "16", "--adapters", "0", "--repeats", "1"])
    assert "32 rows (2 x 16 tokens, 0 adapters)" in capsys.readouterr().out

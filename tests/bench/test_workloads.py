from __future__ import annotations

from collections import Counter

import pytest

from loraplex.bench.workloads import POPULARITIES, adapter_choices, row_slots, spread


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

"""Which adapter each request or token row uses: the popularity distributions of kernel tests
and benchmarks, and of the serving workloads (bench/workloads.py).

identical  every row uses one adapter
distinct   every row its own adapter (wrapping round when rows outnumber adapters)
uniform    adapters drawn uniformly at random
zipf:A     adapter k drawn with probability proportional to 1 / (k + 1)^A (default A = 1.0)
skewed     half the rows on one hot adapter, the rest uniform over the others
"""

from __future__ import annotations

import random
from collections.abc import Sequence

POPULARITIES: tuple[str, ...] = ("identical", "distinct", "uniform", "zipf:1.0", "skewed")


def _zipf_weights(n: int, a: float) -> list[float]:
    return [1.0 / (k + 1) ** a for k in range(n)]


def adapter_choices(n: int, num_adapters: int, popularity: str, seed: int = 0) -> list[int]:
    """n draws of an adapter index in [0, num_adapters) under the named popularity."""
    if num_adapters < 1:
        raise ValueError("num_adapters must be >= 1")
    rng = random.Random(seed)
    kind, _, arg = popularity.partition(":")
    if kind == "identical":
        return [0] * n
    if kind == "distinct":
        return [i % num_adapters for i in range(n)]
    if kind == "uniform":
        return [rng.randrange(num_adapters) for _ in range(n)]
    if kind == "zipf":
        a = float(arg) if arg else 1.0
        return rng.choices(range(num_adapters), weights=_zipf_weights(num_adapters, a), k=n)
    if kind == "skewed":
        if num_adapters == 1:
            return [0] * n
        return [0 if rng.random() < 0.5 else 1 + rng.randrange(num_adapters - 1) for _ in range(n)]
    raise ValueError(f"unknown popularity {popularity!r}; expected one of {POPULARITIES}")


def spread(n: int, num_adapters: int, seed: int = 0) -> list[int]:
    """Exactly min(n, num_adapters) distinct adapters, as evenly as possible, in shuffled order."""
    out = [i % num_adapters for i in range(n)]
    random.Random(seed).shuffle(out)
    return out


def row_slots(
    request_adapters: Sequence[int],
    rows_per_request: Sequence[int] | int,
    slots: Sequence[int] | None = None,
    base_every: int = 0,
) -> list[int]:
    """Token-row slot list: each request contributes its rows contiguously (1 for decode).

    slots maps an adapter index to its slot (identity by default); with base_every = k, every
    k-th request runs on the base model alone (slot -1).
    """
    n = len(request_adapters)
    lens = [rows_per_request] * n if isinstance(rows_per_request, int) else list(rows_per_request)
    out: list[int] = []
    for i, (adapter, n) in enumerate(zip(request_adapters, lens, strict=True)):
        base = base_every > 0 and i % base_every == base_every - 1
        out += [-1 if base else (slots[adapter] if slots is not None else adapter)] * n
    return out

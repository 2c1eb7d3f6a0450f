"""The parsers of a `WorkloadSpec`'s string fields (their syntax is listed in bench/workloads.py):
length distributions (`LengthDist`), rank distributions, arrival processes (`Arrivals`), tenants
and their time-to-first-token deadlines. A bad string raises ValueError naming the forms accepted.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class LengthDist:
    kind: str
    args: tuple[float, ...]

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        kind, _, rest = text.partition(":")
        try:
            args = tuple(float(a) for a in rest.split(":")) if rest else ()
        except ValueError:
            raise ValueError(f"bad length distribution {text!r}") from None
        wanted = {"fixed": 1, "uniform": 2, "lognormal": 3}
        if kind not in wanted or len(args) != wanted[kind]:
            raise ValueError(
                f"bad length distribution {text!r}: use fixed:N, uniform:LO:HI or lognormal:MEDIAN:SIGMA:MAX"
            )
        if (
            any(a < 0 for a in args)
            or (kind == "uniform" and args[0] > args[1])
            or (kind != "lognormal" and args[0] < 1)
        ):
            raise ValueError(f"bad length distribution {text!r}: lengths must be >= 1 and LO <= HI")
        return cls(kind, args)

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.args[0])
        if self.kind == "uniform":
            return rng.randint(int(self.args[0]), int(self.args[1]))
        median, sigma, most = self.args
        return max(1, min(int(most), round(rng.lognormvariate(math.log(median), sigma))))


def parse_ranks(text: str) -> tuple[list[int], list[float]]:
    """(ranks, weights) of a rank distribution."""
    ranks: list[int] = []
    weights: list[float] = []
    for item in text.split(","):
        rank, _, weight = item.partition(":")
        try:
            ranks.append(int(rank))
            weights.append(float(weight) if weight else 1.0)
        except ValueError:
            raise ValueError(f"bad rank distribution {text!r}: use 16, 8,16,32 or 8:0.5,16:0.5") from None
    if any(r < 1 for r in ranks) or any(w <= 0 for w in weights):
        raise ValueError(f"bad rank distribution {text!r}: ranks >= 1, weights > 0")
    return ranks, weights


@dataclass(frozen=True)
class Arrivals:
    kind: str  # closed | poisson | gamma | burst
    concurrency: int | None = None
    rate: float | None = None
    cv: float = 1.0
    burst: tuple[float, float, float] = (1.0, 1.0, 0.0)  # factor, every (s), length (s)

    @classmethod
    def parse(cls, text: str) -> Arrivals:
        kind, _, rest = text.partition(":")
        parts = rest.split(":") if rest else []
        try:
            if kind == "closed" and len(parts) == 1 and int(parts[0]) >= 1:
                return cls("closed", concurrency=int(parts[0]))
            if kind == "poisson" and len(parts) == 1 and float(parts[0]) > 0:
                return cls("poisson", rate=float(parts[0]))
            if kind == "gamma" and len(parts) == 2 and float(parts[0]) > 0 and float(parts[1]) > 0:
                return cls("gamma", rate=float(parts[0]), cv=float(parts[1]))
            if kind == "burst" and len(parts) == 4:
                rate, factor, every, length = (float(p) for p in parts)
                if rate > 0 and factor > 0 and every > 0 and 0 <= length <= every:
                    return cls("burst", rate=rate, burst=(factor, every, length))
        except ValueError:
            pass
        raise ValueError(
            f"bad arrivals {text!r}: use closed:CONCURRENCY, poisson:RATE, gamma:RATE:CV "
            "or burst:RATE:FACTOR:EVERY:LEN"
        )

    def gaps(self, rng: random.Random, rate: float, n: int) -> list[float]:
        """n inter-arrival gaps of a process at `rate` requests/s."""
        if self.kind == "poisson":
            return [rng.expovariate(rate) for _ in range(n)]
        if self.kind == "burst":
            return self._burst_gaps(rng, rate, n)
        shape = 1.0 / (self.cv * self.cv)  # gamma with mean 1/rate and this coefficient of variation
        return [rng.gammavariate(shape, 1.0 / (shape * rate)) for _ in range(n)]

    def _burst_gaps(self, rng: random.Random, rate: float, n: int) -> list[float]:
        # A Poisson process whose rate steps between `rate` and `factor x rate`: each gap is drawn
        # at the rate in force where it starts (exact enough when a burst spans many arrivals).
        factor, every, length = self.burst
        t, out = 0.0, []
        for _ in range(n):
            gap = rng.expovariate(rate * factor if t % every < length else rate)
            out.append(gap)
            t += gap
        return out


def parse_deadlines(text: str, tenants: list[tuple[str, float]]) -> dict[str, float]:
    """Tenant -> TTFT deadline in seconds (`deadlines` of a WorkloadSpec); absent: none."""
    if not text:
        return {}
    names = [n for n, _ in tenants]
    pairs = [("", text)] if ":" not in text else [tuple(i.split(":", 1)) for i in text.split(",")]
    out: dict[str, float] = {}
    for name, ms in pairs:
        try:
            value = float(ms) / 1000
        except ValueError:
            value = -1.0
        if value <= 0 or (name and name not in names):
            raise ValueError(f"bad deadlines {text!r}: use MS or TENANT:MS,... with known tenants")
        out.update({n: value for n in ([name] if name else names)})
    return out


def parse_tenants(text: str) -> list[tuple[str, float]]:
    if not text:
        return [("default", 1.0)]
    out = []
    for item in text.split(","):
        name, _, weight = item.partition(":")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            w = -1.0
        if not name or w <= 0:
            raise ValueError(f"bad tenants {text!r}: use NAME:WEIGHT,NAME:WEIGHT")
        out.append((name, w))
    if len({n for n, _ in out}) != len(out):
        raise ValueError(f"bad tenants {text!r}: a name appears twice")
    return out

"""Which adapter each request or token row uses: the popularity distributions of kernel tests
and benchmarks.

identical  every row uses one adapter
distinct   every row its own adapter (wrapping round when rows outnumber adapters)
uniform    adapters drawn uniformly at random
zipf:A     adapter k drawn with probability proportional to 1 / (k + 1)^A (default A = 1.0)
skewed     half the rows on one hot adapter, the rest uniform over the others

and the serving workloads of `loraplex bench serve` (`WorkloadSpec`, `generate`): adapters and
their ranks, tenants, arrivals, prompt and output lengths, deterministic from a seed.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

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


# --- serving workloads: who asks what, when ----------------------------------------------------
#
# A `WorkloadSpec` is the whole description of a run's traffic, written as short strings so that it
# is a command-line flag and a JSON field at once; `generate` turns it, deterministically from its
# seed, into the request list a benchmark replays. The spec is saved with every result.
#
#   lengths   "fixed:N" | "uniform:LO:HI" (inclusive; the S-LoRA setting is uniform:8:512) |
#             "lognormal:MEDIAN:SIGMA:MAX"
#   ranks     "16" | "8,16,32,64" (uniform over the list) | "8:0.5,16:0.3,64:0.2" (weighted)
#   arrivals  "closed:C" (C requests in flight; a finished one is replaced at once) |
#             "poisson:RATE" (requests/s) | "gamma:RATE:CV" (burstier for CV > 1) |
#             "burst:RATE:FACTOR:EVERY:LEN" (Poisson at RATE, at FACTOR x RATE during the first LEN
#             seconds of every EVERY seconds)
#   tenants   "" (one tenant) | "a:3,b:1" (names with rate weights; each tenant's requests arrive
#             as its own process at its share of the rate, or take its share of the concurrency)
#   deadlines "" (none) | "MS" (every request) | "a:MS,b:MS" (per tenant; others none): the time to
#             first token a request asks for, in milliseconds after its arrival


@dataclass(frozen=True)
class WorkloadSpec:
    seed: int = 0
    num_requests: int = 1000
    num_adapters: int = 32
    popularity: str = "zipf:1.0"
    base_share: float = 0.2  # requests on the base model alone
    ranks: str = "16"
    prompt_len: str = "uniform:128:1024"
    output_len: str = "uniform:64:256"
    arrivals: str = "closed:64"
    tenants: str = ""
    conversations: str | None = None  # a JSONL file of real prompts (see `load_conversations`)
    deadlines: str = ""

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.num_adapters < 0:
            raise ValueError("num_requests must be >= 1 and num_adapters >= 0")
        if not 0.0 <= self.base_share <= 1.0:
            raise ValueError(f"base_share must be in [0, 1], got {self.base_share}")
        if self.num_adapters == 0 and self.base_share < 1.0:
            raise ValueError("with no adapters every request is base-only: set base_share to 1")
        # Parse every field once here, so a bad spec fails before a run starts.
        LengthDist.parse(self.prompt_len)
        LengthDist.parse(self.output_len)
        parse_ranks(self.ranks)
        Arrivals.parse(self.arrivals)
        parse_deadlines(self.deadlines, parse_tenants(self.tenants))
        if self.num_adapters:
            adapter_choices(1, self.num_adapters, self.popularity)


@dataclass(frozen=True)
class WorkloadRequest:
    index: int
    tenant: str
    adapter: int | None  # adapter index, None for the base model
    prompt_len: int
    output_len: int
    arrival_s: float | None  # seconds after the start; None in a closed loop
    prompt: str | None = None  # a real conversation's prompt text, when the spec names a file
    deadline_s: float | None = None  # TTFT the request asks for (seconds after arrival), if any


@dataclass(frozen=True)
class Workload:
    spec: WorkloadSpec
    adapter_ranks: list[int]  # rank of each adapter index
    requests: list[WorkloadRequest]

    @property
    def concurrency(self) -> int | None:
        """In-flight requests of a closed loop; None for open-loop arrivals."""
        return Arrivals.parse(self.spec.arrivals).concurrency

    def popularity_class(self, adapter: int | None) -> str:
        """'base', 'hot' (the most popular tenth of the adapters, at least one) or 'cold'."""
        if adapter is None:
            return "base"
        return "hot" if adapter < max(1, self.spec.num_adapters // 10) else "cold"

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec": asdict(self.spec),
            "adapter_ranks": self.adapter_ranks,
            "requests": [asdict(r) for r in self.requests],
        }


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


def load_conversations(path: str | Path) -> list[tuple[str, int | None]]:
    """(prompt text, output length or None) per line of a JSONL file. A line is an object with
    `prompt` (a string) or `messages` (OpenAI chat messages; their text contents are joined), and
    optionally `output_tokens` (an int) or `completion` (a string; its length in characters stands
    in for its tokens)."""
    out: list[tuple[str, int | None]] = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if "prompt" in row:
                prompt = row["prompt"]
            else:
                prompt = "\n".join(str(m.get("content") or "") for m in row["messages"])
            if not isinstance(prompt, str) or not prompt:
                raise ValueError("empty prompt")
            output = row.get("output_tokens")
            if output is None and isinstance(row.get("completion"), str):
                output = max(1, len(row["completion"]))
            out.append((prompt, None if output is None else int(output)))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{path}:{number}: not a conversation ({err})") from None
    if not out:
        raise ValueError(f"{path}: no conversations")
    return out


def generate(spec: WorkloadSpec) -> Workload:
    """The requests of `spec`, the same for the same spec (every draw comes from its seed)."""
    rng = random.Random(spec.seed)
    rank_values, rank_weights = parse_ranks(spec.ranks)
    adapter_ranks = rng.choices(rank_values, weights=rank_weights, k=spec.num_adapters)
    n = spec.num_requests
    is_base = [rng.random() < spec.base_share for _ in range(n)]
    picks = (
        adapter_choices(n, spec.num_adapters, spec.popularity, seed=spec.seed + 1)
        if spec.num_adapters
        else []
    )
    prompt_dist, output_dist = LengthDist.parse(spec.prompt_len), LengthDist.parse(spec.output_len)
    conversations = load_conversations(spec.conversations) if spec.conversations else None
    tenants = parse_tenants(spec.tenants)
    tenant_of = rng.choices([t for t, _ in tenants], weights=[w for _, w in tenants], k=n)
    deadline_of = parse_deadlines(spec.deadlines, tenants)
    arrivals = Arrivals.parse(spec.arrivals)
    arrival_s: list[float | None] = [None] * n
    if arrivals.rate is not None:
        # Each tenant is its own arrival process at its share of the total rate.
        total = sum(w for _, w in tenants)
        for name, weight in tenants:
            mine = [i for i in range(n) if tenant_of[i] == name]
            t = 0.0
            for i, gap in zip(
                mine, arrivals.gaps(rng, arrivals.rate * weight / total, len(mine)), strict=True
            ):
                t += gap
                arrival_s[i] = t
    requests = []
    for i in range(n):
        prompt = None
        if conversations is not None:
            prompt, output = conversations[rng.randrange(len(conversations))]
            prompt_len = len(prompt)  # characters; the benchmark's tokenizer gives the real count
            output_len = output if output is not None else output_dist.draw(rng)
        else:
            prompt_len, output_len = prompt_dist.draw(rng), output_dist.draw(rng)
        adapter = None if is_base[i] else picks[i]
        requests.append(
            WorkloadRequest(
                i,
                tenant_of[i],
                adapter,
                prompt_len,
                output_len,
                arrival_s[i],
                prompt,
                deadline_of.get(tenant_of[i]),
            )
        )
    if arrivals.rate is not None:
        requests.sort(key=lambda r: (r.arrival_s, r.index))
    return Workload(spec, adapter_ranks, requests)


def add_workload_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per WorkloadSpec field (default None: the spec's own default)."""
    for name, kind, text in (
        ("seed", int, "workload seed"),
        ("num_requests", int, "requests"),
        ("num_adapters", int, "distinct adapters"),
        ("popularity", str, "identical | distinct | uniform | zipf:A | skewed"),
        ("base_share", float, "share of base-only requests"),
        ("ranks", str, "16 | 8,16,32 | 8:0.5,16:0.5"),
        ("prompt_len", str, "fixed:N | uniform:LO:HI | lognormal:MEDIAN:SIGMA:MAX"),
        ("output_len", str, "as --prompt-len"),
        ("arrivals", str, "closed:C | poisson:RATE | gamma:RATE:CV | burst:RATE:FACTOR:EVERY:LEN"),
        ("tenants", str, "NAME:WEIGHT,..."),
        ("conversations", str, "JSONL file of real prompts"),
        ("deadlines", str, "TTFT deadline: MS | TENANT:MS,..."),
    ):
        parser.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=None, help=text)

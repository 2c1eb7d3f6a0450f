"""The serving workloads of `loraplex bench serve` (replayed as well by the simulator, the prefix
and the capacity benches): adapters and their ranks, tenants, arrivals, prompt and output lengths,
deterministic from a seed.

A `WorkloadSpec` is the whole description of a run's traffic, written as short strings so that it
is a command-line flag and a JSON field at once; `generate` turns it, deterministically from its
seed, into the request list a benchmark replays. The spec is saved with every result.

  lengths   "fixed:N" | "uniform:LO:HI" (inclusive; the S-LoRA setting is uniform:8:512) |
            "lognormal:MEDIAN:SIGMA:MAX"
  ranks     "16" | "8,16,32,64" (uniform over the list) | "8:0.5,16:0.3,64:0.2" (weighted)
  arrivals  "closed:C" (C requests in flight; a finished one is replaced at once) |
            "poisson:RATE" (requests/s) | "gamma:RATE:CV" (burstier for CV > 1) |
            "burst:RATE:FACTOR:EVERY:LEN" (Poisson at RATE, at FACTOR x RATE during the first LEN
            seconds of every EVERY seconds)
  tenants   "" (one tenant) | "a:3,b:1" (names with rate weights; each tenant's requests arrive
            as its own process at its share of the rate, or take its share of the concurrency)
  deadlines "" (none) | "MS" (every request) | "a:MS,b:MS" (per tenant; others none): the time to
            first token a request asks for, in milliseconds after its arrival

These strings are parsed by bench/workload_fields.py; `popularity` is one of bench/popularity.py's.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loraplex.bench.popularity import adapter_choices
from loraplex.bench.workload_fields import (
    Arrivals,
    LengthDist,
    parse_deadlines,
    parse_ranks,
    parse_tenants,
)


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

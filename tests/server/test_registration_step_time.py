"""Issue 17: large adapters registering while the demo model generates nonstop, in process. The
engine keeps stepping, and the median step time while registrations run stays within 1.5x of the
median without them (registration's fetch, conversion, hashing and store write run in the worker
process, at the lowest CPU priority).

One torch thread in the server process: with two on this two-core machine, a step with the cores
otherwise idle is about four times slower than with one (the thread pool's wake-ups), which makes
the quiet phases, not the busy ones, the slow side and the comparison say nothing."""

from __future__ import annotations

import json
from pathlib import Path

from loraplex.bench.registration import RegistrationBenchArgs, run


def test_step_time_while_large_adapters_register(tmp_path: Path) -> None:
    args = RegistrationBenchArgs(
        rank=1024, pairs=5, adapters_per_phase=3, quiet_seconds=1.0, threads=1, out=tmp_path
    )
    report = run(args)
    busy = [p for p in report.phases if p.kind == "busy"]
    assert len(busy) == 5 and all(p.steps >= 10 for p in busy), report.phases  # it keeps stepping
    assert len(report.registrations) == 15
    summary = report.summary()
    # the median over five interleaved quiet/busy pairs, each busy phase against the quiet one
    # before it: one pair disturbed by other work on the machine does not decide it, and the
    # machine's own drifts in speed (this shared VM's quiet phases alone vary 2.3-4.6 ms) cancel
    assert summary["pair_ratio_median"] <= 1.5, (summary, report.phases)
    written = json.loads((tmp_path / "registration.json").read_text())
    assert written["summary"]["ratio"] == summary["ratio"]
    assert "ratio" in (tmp_path / "registration.md").read_text()

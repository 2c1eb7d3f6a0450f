"""Driving an `Engine` one request at a time, with the KV accounting checked after every step."""

from __future__ import annotations

from loraplex.engine.engine import Engine
from loraplex.types import AdapterRef, RequestOutput, SamplingParams


def run_to_end(
    e: Engine,
    rid: str,
    prompt: list[int],
    params: SamplingParams,
    adapter: str | AdapterRef | None = None,
    salt: str | None = None,
) -> tuple[RequestOutput, int]:
    """Run one request to its end, checking the accounting after every step: (its output, the
    rows computed for it)."""
    e.add_request(rid, prompt, params, adapter, salt)
    rows = 0
    while not e.output(rid).finished:
        e.step()
        assert e.last_stats is not None
        rows += e.last_stats.rows_per_request.get(rid, 0)
        e.check_integrity()
    out = e.output(rid)
    e.release(rid)
    return out, rows

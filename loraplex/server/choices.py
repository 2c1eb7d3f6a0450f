"""One HTTP request = one or more engine requests (n choices, several prompts): admit them
together, collect them, cancel them together."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from starlette.requests import Request

from loraplex.server.async_engine import AsyncEngine
from loraplex.server.deltas import Accumulator, OutputDelta
from loraplex.types import RequestOutput, SamplingParams


@dataclass(frozen=True)
class ChoiceRun:
    index: int  # the choice's index in the response
    prompt: list[int]  # token ids (tokenized off the engine thread); choices of one prompt share it
    params: SamplingParams
    echo_text: str | None = None  # the prompt's text when the response echoes it

    def request_id(self, base: str) -> str:
        return f"{base}-{self.index}"


async def run_choices(
    async_engine: AsyncEngine,
    request_id: str,
    runs: list[ChoiceRun],
    adapter: str | None,
    tenant: str | None = None,
    cache_salt: str | None = None,
    priority: int = 0,
    deadline_s: float | None = None,
) -> list[asyncio.Queue[OutputDelta]]:
    """Admit every choice in one engine command: all or none, and all on one adapter revision, so
    a registration in between cannot split one response across two revisions."""
    return await async_engine.add_many(
        [(run.request_id(request_id), run.prompt, run.params) for run in runs],
        adapter,
        tenant,
        cache_salt,
        priority,
        deadline_s,
    )


async def _final(request_id: str, q: asyncio.Queue[OutputDelta]) -> RequestOutput:
    """The whole output, assembled from the request's deltas."""
    delta = await q.get()
    whole = Accumulator(delta)
    while not delta.finished:
        delta = await q.get()
        whole.add(delta)
    return whole.output(request_id)


async def collect(
    async_engine: AsyncEngine,
    request: Request,
    request_id: str,
    runs: list[ChoiceRun],
    queues: list[asyncio.Queue[OutputDelta]],
) -> list[RequestOutput] | None:
    """Wait for every choice to finish; None (and every choice aborted) if the client disconnects."""
    gathered = asyncio.gather(
        *(_final(run.request_id(request_id), q) for run, q in zip(runs, queues, strict=True))
    )
    while True:
        done, _ = await asyncio.wait({gathered}, timeout=0.2)
        if done:
            return gathered.result()
        if await request.is_disconnected():
            gathered.cancel()
            for run in runs:
                async_engine.abort(run.request_id(request_id))
            return None

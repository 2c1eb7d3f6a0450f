"""Step-thread time of the server's hand-off (`AsyncEngine._step` with the engine stubbed): the
bookkeeping and wake-ups per engine step for N live streams with P-token prompts.

    python benchmarks/server_handoff.py [--streams 256] [--prompt 1024] [--steps 300]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from loraplex.engine.engine import RequestDelta
from loraplex.server import async_engine as ae
from loraplex.types import RequestOutput


class _StubEngine:
    """step() gives every request one token; output() as the engine builds it."""

    def __init__(self, streams: int, prompt: int) -> None:
        self.prompts = {f"r{i}": list(range(prompt)) for i in range(streams)}
        self.outputs: dict[str, list[int]] = {rid: [] for rid in self.prompts}

    def step(self) -> list[RequestDelta]:
        for out in self.outputs.values():
            out.append(5)
        return [RequestDelta(rid, [5], False, None) for rid in self.prompts]

    def output(self, rid: str, copy_prompt: bool = True) -> RequestOutput:
        prompt = self.prompts[rid]
        return RequestOutput(rid, list(prompt) if copy_prompt else prompt, None, list(self.outputs[rid]))

    def release(self, rid: str) -> None: ...


async def _measure(streams: int, prompt: int, steps: int) -> float:
    loop = asyncio.get_running_loop()
    runner: Any = ae.AsyncEngine.__new__(ae.AsyncEngine)
    runner.engine = _StubEngine(streams, prompt)
    runner.observer = ae.StepObserver()
    runner._streams = {rid: ae._Stream(loop, asyncio.Queue(), 0.0) for rid in runner.engine.prompts}
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        runner._step()
        times.append(time.perf_counter() - t0)
        await asyncio.sleep(0)  # let the loop take the deliveries
        for stream in runner._streams.values():
            while not stream.outputs.empty():
                stream.outputs.get_nowait()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    seconds = asyncio.run(_measure(args.streams, args.prompt, args.steps))
    print(f"{args.streams} streams, {args.prompt}-token prompts: {seconds * 1e3:.3f} ms per step (median)")


if __name__ == "__main__":
    main()

"""Runs the engine's step loop on one background thread and feeds each request's outputs to
asyncio consumers.

The engine is single-threaded by design: every call into it (add_request, abort, step) happens
on the loop thread. HTTP handlers talk to it through a command queue; each request gets an
asyncio queue of `OutputDelta`s (`deltas.py`), one per step that produced output for it: the new
tokens, text and logprobs, never a copy of what came before.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from loraplex.engine.engine import Engine
from loraplex.server.deltas import Cursor, OutputDelta
from loraplex.server.request_metrics import deadline_of
from loraplex.types import AdapterRef, RequestOutput, SamplingParams

# The step thread and the event loop share the GIL. Every torch op and every socket write releases
# it, and taking it back waits until the other thread gives it up, by default after holding it for
# 5 ms: with hundreds of streams the event loop always wants it, so a step of many short ops (a CPU
# step, an eager mixed step) waited up to 5 ms per op, and the loop as long per chunk written.
# Measured with 256 streams on a 2-core CPU (docs/bench.md): about 1.3-1.6x the output tokens/s.
SWITCH_INTERVAL_S = 0.0005


@dataclass
class RequestTimes:
    """One request's identity and clocks (monotonic seconds), as the observer hears of them."""

    arrival: float  # when the HTTP handler handed it to the engine thread
    tenant: str | None = None
    adapter: AdapterRef | None = None  # the revision it was admitted on
    scheduled: float | None = None  # the start of the first step that computed rows of it
    first_token: float | None = None
    deadline_s: float | None = None  # its time-to-first-token deadline (request_metrics.deadline_of)
    labels: Any = None  # the observer's own, set at admission (metrics pin label values there)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[OutputDelta]
    times: RequestTimes
    sent: Cursor = field(default_factory=Cursor)  # what `outputs` has been given so far


@dataclass
class _AddMany:
    """Admit several requests (the choices of one HTTP request) on one adapter revision, all or none."""

    requests: list[tuple[str, str | list[int], SamplingParams]]
    adapter: str | AdapterRef | None
    streams: list[_Stream]
    tenant: str | None = None  # resolve `adapter` among what this tenant may use (None: anything)
    cache_salt: str | None = None  # only requests with the same salt share prefix-cache blocks
    priority: int = 0  # among the tenant's own requests (engine/policies.py)
    deadline_s: float | None = None  # the first token's deadline, seconds after arrival
    done: Future[None] = field(default_factory=Future)


class StepObserver:
    """Hooks the loop calls on its own thread (metrics implement these)."""

    def on_admitted(self, out: RequestOutput, times: RequestTimes) -> None: ...
    def on_scheduled(self, times: RequestTimes) -> None:
        """A step computed rows of the request for the first time (it started at `times.scheduled`)."""

    def on_first_token(self, times: RequestTimes) -> None: ...
    def on_finished(
        self, out: RequestOutput, times: RequestTimes, seconds_per_output_token: float | None
    ) -> None:
        """The request finished or was aborted (`times.first_token` None: before its first token)."""

    def on_step(self, engine: Engine) -> None: ...
    def on_gauges(self, engine: Engine) -> None:
        """Queue and cache levels changed outside a step (admissions, aborts)."""


class AsyncEngine:
    def __init__(self, engine: Engine, observer: StepObserver | None = None) -> None:
        self.engine = engine
        self.observer = observer or StepObserver()
        self._commands: queue.Queue[Any] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._unscheduled: set[str] = set()  # admitted requests no step has computed rows of yet
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loraplex-engine", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        """Start the step thread; the process's GIL switch interval becomes SWITCH_INTERVAL_S."""
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    async def add_many(
        self,
        requests: list[tuple[str, str | list[int], SamplingParams]],
        adapter: str | AdapterRef | None,
        tenant: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        deadline_s: float | None = None,
    ) -> list[asyncio.Queue[OutputDelta]]:
        """Admit requests together in one engine command: every one on the same adapter revision,
        and none of them if one is refused (the engine's ValueError is raised here). The adapter
        (an alias, a name or name@revision) is resolved there, among what `tenant` may use."""
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        streams = [_Stream(loop, asyncio.Queue(), RequestTimes(now, tenant)) for _ in requests]
        cmd = _AddMany(requests, adapter, streams, tenant, cache_salt, priority, deadline_s)
        self._commands.put(cmd)
        await asyncio.wrap_future(cmd.done)
        return [s.outputs for s in streams]

    def abort(self, request_id: str) -> None:
        """Cancel a request (client gone); safe to call for finished or unknown ids."""
        self._commands.put(("abort", request_id))

    def call(self, fn: Callable[[Engine], Any]) -> Future[Any]:
        """Run fn(engine) on the loop thread (admin operations such as registering adapters)."""
        fut: Future[Any] = Future()
        self._commands.put(("call", fn, fut))
        return fut

    # --- the loop thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                block = not self.engine.has_unfinished()
                self._drain(block)
                if self.engine.has_unfinished():
                    self._step()
        except BaseException as err:  # surface a crashed loop through /health instead of hanging
            self.error = err
            for rid, stream in list(self._streams.items()):
                self._push(stream, stream.sent.of_output(_aborted(self.engine, rid)))
            raise

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
        self.observer.on_gauges(self.engine)

    def _apply(self, cmd: Any) -> None:
        if cmd is None:
            return
        if isinstance(cmd, _AddMany):
            self._admit(cmd)
        elif cmd[0] == "abort":
            rid = cmd[1]
            if self.engine.abort(rid):
                stream = self._streams.pop(rid, None)
                self._unscheduled.discard(rid)
                out = self.engine.output(rid)
                self.engine.release(rid)
                if stream is not None:
                    self.observer.on_finished(out, stream.times, None)
                    self._push(stream, stream.sent.of_output(out))
        elif cmd[0] == "call":
            _, fn, fut = cmd
            try:
                fut.set_result(fn(self.engine))
            except Exception as err:
                fut.set_exception(err)

    def _admit(self, cmd: _AddMany) -> None:
        engine = self.engine
        added: list[str] = []
        pinned = cmd.adapter
        try:
            if isinstance(pinned, str):  # once, at admission: a repointed alias changes no running request
                pinned = engine.adapters.resolve(pinned, cmd.tenant).ref
            for request_id, prompt, params in cmd.requests:
                engine.add_request(
                    request_id,
                    prompt,
                    params,
                    pinned,
                    cmd.cache_salt,
                    tenant=cmd.tenant,
                    priority=cmd.priority,
                    deadline_s=cmd.deadline_s,
                )
                added.append(request_id)
                pinned = engine.output(request_id).adapter  # the first admission pins the revision
        except Exception as err:  # reported to the handler, which maps it to an HTTP error
            for request_id in added:
                engine.abort(request_id)
                engine.release(request_id)
            cmd.done.set_exception(err)
            return
        for request_id, stream in zip(added, cmd.streams, strict=True):
            out = engine.output(request_id)
            stream.times.adapter = out.adapter
            stream.times.deadline_s = deadline_of(engine.sequence(request_id))
            self._streams[request_id] = stream
            self._unscheduled.add(request_id)
            self.observer.on_admitted(out, stream.times)
        cmd.done.set_result(None)

    def _step(self) -> None:
        engine = self.engine
        start = time.monotonic()
        # the deltas of the step before; the one just launched runs while they are handed over
        deltas = engine.step_overlapped()
        now = time.monotonic()
        if self._unscheduled and engine.last_stats is not None:
            self._note_scheduled(engine.last_stats.rows_per_request, start)
        # One wake-up of each consumer loop per step, carrying every delta for it (a wake-up per
        # request costs the step thread a few microseconds each, at hundreds of streams per step).
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[OutputDelta], OutputDelta]]] = {}
        for step_delta in deltas:
            rid = step_delta.request_id
            stream = self._streams.get(rid)
            if stream is None:
                continue
            delta = stream.sent.of_sequence(engine.sequence(rid))
            times = stream.times
            if times.first_token is None:
                times.first_token = now
                self.observer.on_first_token(times)
            if step_delta.finished:
                del self._streams[rid]
                self._unscheduled.discard(rid)
                out = engine.output(rid, copy_prompt=False)  # once per request, for the observer
                engine.release(rid)
                num_tokens = stream.sent.num_tokens
                tpot = (now - times.first_token) / (num_tokens - 1) if num_tokens > 1 else None
                self.observer.on_finished(out, times, tpot)
            batches.setdefault(stream.loop, []).append((stream.outputs, delta))
        for loop, items in batches.items():
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody listens any more
                loop.call_soon_threadsafe(_deliver, items)
        self.observer.on_step(engine)

    def _note_scheduled(self, rows_per_request: dict[str, int], start: float) -> None:
        """End the queueing time of the requests this step computed rows of for the first time.
        Walks the smaller of the step's rows and the unscheduled set: a deep queue under overload
        costs no more per step than the batch does."""
        unscheduled = self._unscheduled
        if len(unscheduled) <= len(rows_per_request):
            started = [rid for rid in unscheduled if rid in rows_per_request]
        else:
            started = [rid for rid in rows_per_request if rid in unscheduled]
        for rid in started:
            unscheduled.discard(rid)
            stream = self._streams.get(rid)
            if stream is not None:
                stream.times.scheduled = start
                self.observer.on_scheduled(stream.times)

    @staticmethod
    def _push(stream: _Stream, delta: OutputDelta) -> None:
        # RuntimeError: the consumer's event loop is closed, so nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, delta)


def _deliver(items: list[tuple[asyncio.Queue[OutputDelta], OutputDelta]]) -> None:
    for outputs, delta in items:
        outputs.put_nowait(delta)


def _aborted(engine: Engine, request_id: str) -> RequestOutput:
    try:
        out = engine.output(request_id)
    except KeyError:  # the engine lost it while crashing: report an empty aborted output
        out = RequestOutput(request_id=request_id, prompt_token_ids=[], adapter=None)
    out.finished = True
    out.finish_reason = out.finish_reason or "abort"
    return out

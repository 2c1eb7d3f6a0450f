"""The engine's step in two halves, and the serving loops' step one ahead (a mixin of `Engine`).

    launch:   schedule (ids) -> run the model (tensors, on the device) -> queue the sampling
    complete: the sampled tokens to the host -> logprobs, stop checks -> deltas

`step()` runs a launch and its completion. `step_overlapped()` launches step N+1 while step N is
still on the device and then completes N: a sequence N samples for has `Sequence.pending` set
from N's launch to its completion, its rows count as computed from the launch, and N+1's row at
the pending position reads its input id on the device (`engine/pending_tokens.py`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from loraplex.engine.gc_pacing import GcPacer
from loraplex.engine.model_runner import ForwardResult
from loraplex.engine.pending_tokens import PendingTokens
from loraplex.engine.sampler import PendingSample
from loraplex.engine.scheduler import StepPlan
from loraplex.engine.scoring import record_prompt_logprobs, split_scoring
from loraplex.engine.sequence import Sequence, SequenceStatus
from loraplex.engine.stats import StepStats

if TYPE_CHECKING:
    from loraplex.adapters.residency import AdapterResidency, StepSlots
    from loraplex.adapters.tiers import AdapterTiers
    from loraplex.engine.adapter_admission import AdapterAdmission
    from loraplex.engine.model_runner import ModelRunner
    from loraplex.engine.sampler import Sampler
    from loraplex.engine.scheduler import Scheduler
    from loraplex.engine.stop import StopChecker
    from loraplex.kv.block_pool import BlockPool
    from loraplex.lora.backend import LoRABackend


class RequestDelta(NamedTuple):
    """What one step produced for one request. (A NamedTuple: a step makes one per row, and
    building one costs half of what a frozen dataclass's __init__ does.)"""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None


@dataclass
class InFlightStep:
    """A launched step: its plan and forward, and its sampling queued on the device."""

    plan: StepPlan
    result: ForwardResult
    scored: list[Sequence]  # max_tokens=0 sequences whose prompts this step completes
    sampled: list[Sequence]  # the sequences of the sampled rows, in row order
    sample: PendingSample | None
    lora_calls: int


class StepPipeline:
    """The step methods of `Engine`, over the parts `Engine.__init__` sets (declared below)."""

    scheduler: Scheduler
    runner: ModelRunner
    sampler: Sampler
    stop: StopChecker
    admission: AdapterAdmission
    residency: AdapterResidency
    tiers: AdapterTiers
    pool: BlockPool
    lora_backend: LoRABackend
    slot_map: Callable[[StepPlan], StepSlots]
    max_model_len: int
    last_stats: StepStats | None
    _in_flight: deque[InFlightStep]
    _num_scoring: int
    gc_pacer: GcPacer

    def step(self) -> list[RequestDelta]:
        """Run one step to its end: schedule, run the model, sample, stop checks. Returns what
        each request gained in it."""
        self.last_stats = None
        done = self._complete()  # a step an overlapped caller left in flight
        failed = self._launch()
        return done + failed + self._complete()

    def step_overlapped(self) -> list[RequestDelta]:
        """A serving loop's step, one ahead: launch the next step while the one in flight still
        runs (its tokens stay on the device, where the next step's inputs read them), then
        complete the one in flight (its tokens to the host, stop checks) and return its deltas,
        so the host work of a step and the caller's handling of its deltas overlap the device's
        work on the next. Between two calls one step is in flight. A request that the completed
        step ends by EOS or a stop has one more row in the next step, whose token is dropped (as
        is the in-flight token of a request `abort` ends); one its tokens end by length is left
        out of the next step's plan."""
        self.last_stats = None
        in_flight = bool(self._in_flight)
        failed = self._launch()
        if self._in_flight:  # device work queued: a collection now overlaps it (engine/gc_pacing.py)
            self.gc_pacer.after_launch()
        return failed + (self._complete() if in_flight else [])

    def _launch(self) -> list[RequestDelta]:
        """Schedule a step and queue its device work (forward and sampling); sets it in flight.
        With a step already in flight, its sampled tokens are the pending inputs of this one."""
        assert len(self._in_flight) < 2, "two steps in flight: complete one first"
        failed: list[RequestDelta] = []
        if self.tiers.busy:  # place finished adapter loads, between steps (no slot is pinned)
            failed = self._abort_all(self.admission.failed_loads(self.scheduler.waiting))
        plan = self.scheduler.schedule()
        if not plan.chunks:
            if self.tiers.busy:
                self.tiers.wait(0.002)  # only loads to wait for: let the loader thread run
            return failed
        calls_before = self.lora_backend.total_calls
        # The step's slot map, its slots pinned while it runs (only scheduled sequences pin).
        slots = self.slot_map(plan)
        pending = self._pending_tokens()
        try:
            self.residency.check(slots)
            result = self.runner.run(plan, slots, pending=pending)
        finally:
            self.residency.end_step()
        self._begin(plan, result, self.lora_backend.total_calls - calls_before)
        return failed

    def _pending_tokens(self) -> PendingTokens | None:
        """The in-flight step's sampled tokens, still on the device, by sequence."""
        if not self._in_flight or self._in_flight[-1].sample is None:
            return None
        f = self._in_flight[-1]
        assert f.sample is not None
        return PendingTokens(f.sample.tokens, {seq: i for i, seq in enumerate(f.sampled)})

    def _postprocess(self, plan: StepPlan, result: ForwardResult) -> list[RequestDelta]:
        """Sample and complete a step whose forward ran outside `step()` (tests and benches)."""
        assert not self._in_flight, "a step is in flight"
        self._begin(plan, result, 0)
        return self._complete()

    def _begin(self, plan: StepPlan, result: ForwardResult, lora_calls: int) -> None:
        """Queue the sampling of a step whose forward was launched; sets it in flight. Its rows
        count as computed from now on (the device writes them before anything that reads them)."""
        for chunk in plan.chunks:
            chunk.seq.num_computed += chunk.num_tokens
        seqs = [plan.chunks[i].seq for i in result.sample_chunks]
        logits = result.sample_logits
        scored: list[Sequence] = []
        if self._num_scoring and seqs:  # the max_tokens=0 requests end here, before the sampler
            scored, seqs, logits = split_scoring(seqs, logits)
        sample = None
        if seqs:
            sample = self.sampler.launch(logits, [s.params for s in seqs], [s.generator for s in seqs])
            for seq in seqs:
                seq.pending += 1
        self._in_flight.append(InFlightStep(plan, result, scored, seqs, sample, lora_calls))

    def _complete(self) -> list[RequestDelta]:
        """The oldest step in flight's results: logprobs, tokens, stop checks, deltas (one host
        sync)."""
        if not self._in_flight:
            return []
        f = self._in_flight.popleft()
        plan, result = f.plan, f.result
        if result.prompt_rows:
            record_prompt_logprobs(plan, result)
        deltas: list[RequestDelta] = []
        add = deltas.append
        finished = SequenceStatus.FINISHED
        for seq in f.scored:
            if seq.status is not finished:  # (aborted while in flight otherwise)
                seq.finish_reason = "length"
                self._finish(seq)
                add(RequestDelta(seq.request_id, [], True, "length"))
        if f.sample is not None:
            sampled = f.sample.result()
            seqs = f.sampled
            if self.admission.awaiting_first:  # only while some adapter request has no token yet
                self.admission.first_tokens(seqs)
            # Per row: the token, its logprobs, the stop checks, the delta; nothing else.
            check = self.stop.check
            max_len = self.max_model_len
            for seq, token, lp in zip(seqs, sampled.token_ids, sampled.logprobs, strict=True):
                seq.pending -= 1
                if seq.status is finished:
                    continue  # ended while its step was in flight (abort; EOS or a stop before)
                seq.output_token_ids.append(token)
                if lp is not None:
                    seq.logprobs.append(lp)
                reason = check(seq, max_len)
                if reason is not None:
                    seq.finish_reason = reason
                    self._finish(seq)
                add(RequestDelta(seq.request_id, [token], seq.status is finished, seq.finish_reason))
        self.last_stats = StepStats.of(
            plan, result.num_adapters, f.lora_calls, self.scheduler, self.pool, result.static_replay
        )
        return deltas

    def _abort_all(self, doomed: list[Sequence]) -> list[RequestDelta]:
        """End the requests whose adapter could not be loaded as aborted (the reason went to stderr)."""
        for seq in doomed:
            seq.finish_reason = "abort"
            self._finish(seq)
        return [RequestDelta(s.request_id, [], True, "abort") for s in doomed]

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.admission.release(seq)  # its hold, its clocks; drains a retired revision's last request
        if not seq.params.max_tokens:
            self._num_scoring -= 1

"""Continuous-batching scheduler with chunked prefill and preemption by recomputation.

Works on sequences and block ids only; the model runner turns its plan into tensors. Each step:
running sequences first (in admission order; a decoding sequence asks for one row, a sequence
still prefilling for its next chunk), then waiting sequences in the admission policy's order
(engine/policies.py; FCFS: arrival order) while the token budget, the sequence limit and the KV
pool allow. A waiting sequence that does not fit blocks the ones behind it; one whose adapter is
still loading is passed over, unless the policy says it is starved: then one running adapter is
drained to make room for its load, and admissions that would take that room wait
(engine/slot_drain.py). When a running sequence needs a block and none is free, the decode
policy's victim (engine/decode_policies.py; FCFS: the latest admitted) is preempted: its blocks
are freed and it goes back to the waiting queue, to be recomputed from its prompt and generated
tokens. When every slot is taken, the decode policy may name a running sequence that an
admission displaces (preempted the same way; FCFS never does, the adaptive policy for a tenant
under its share).

With a prefix cache (`kv/prefix_cache.py`), a waiting sequence is admitted from the longest run of
cached blocks that starts its tokens: those are held, not allocated, and not computed again.
Blocks are committed to the cache (hashed) once full and computed: when the sequence's next block
or prefill chunk is planned, at its first decode row, and before its blocks are freed.

Admission batching (`admission_batch_tokens`): a step whose running sequences all decode admits
new prompts only once enough prompt tokens wait, or the oldest has waited long enough; a step
that carries prefill work anyway admits at once.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from collections.abc import Sequence as SeqView
from dataclasses import dataclass

from loraplex.config import SchedulerConfig
from loraplex.engine.decode_policies import DecodePolicy, make_decode_policy
from loraplex.engine.policies import AdmissionPolicy, make_policy
from loraplex.engine.sequence import Sequence, SequenceStatus
from loraplex.engine.slot_drain import SlotDrain
from loraplex.kv.block_pool import BlockPool
from loraplex.kv.prefix_cache import PrefixCache


@dataclass(frozen=True)
class ScheduledChunk:
    """Immutable. A decode chunk is always `(seq, 1, True)`, so the scheduler makes one per
    sequence and plans that same object every step the sequence decodes."""

    seq: Sequence
    num_tokens: int  # rows this step: positions num_computed .. num_computed + num_tokens - 1
    is_decode: bool  # one new row of a sequence that has generated tokens (not a (re)computed prefix)

    @property
    def completes(self) -> bool:
        """True if after this chunk every token (known or pending) is computed, so a new token is
        sampled."""
        seq = self.seq
        return seq.num_computed + self.num_tokens == seq.num_tokens + seq.pending


@dataclass(frozen=True)
class StepPlan:
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[str, ...]  # request ids preempted while planning this step
    cached_tokens: int = 0  # tokens the sequences admitted this step took from the prefix cache
    # Every chunk is one decoding sequence's next row (it completes: a token is sampled). Set by
    # the scheduler when it knows so without another pass; False says nothing.
    pure_decode: bool = False

    @property
    def num_rows(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        pool: BlockPool,
        block_size: int,
        ready: Callable[[Sequence], bool] | None = None,
        admission_batch_tokens: int = 0,
        clock: Callable[[], float] = time.monotonic,
        prefix: PrefixCache | None = None,
        policy: AdmissionPolicy | None = None,
        decode: DecodePolicy | None = None,
    ) -> None:
        self.config = config
        # Seconds from any monotonic origin; the simulator (bench/simulate.py) passes a virtual one.
        self.clock = clock
        self.admission_batch_tokens = admission_batch_tokens  # the config's, or the simulator's policy's
        self.token_budget = config.step_token_budget  # rows a step may plan (`set_step_budget`)
        self._admission_max_wait = config.admission_max_wait_ms / 1000
        # The adapter gate: a waiting sequence is admitted only once `ready(seq)` (its adapter is
        # device-resident); one that is not is passed over, not waited for, so it blocks nobody.
        self.ready = ready
        self.pool = pool
        self.block_size = block_size
        self.prefix = prefix  # None: no prefix cache
        # The waiting queue and its order (engine/policies.py); FCFS keeps it sorted by arrival.
        self.policy = policy if policy is not None else make_policy(config, clock)
        # Among the running: who is preempted for KV space, whom an admission may displace
        # (engine/decode_policies.py).
        self.decode = decode if decode is not None else make_decode_policy(config)
        self.running: list[Sequence] = []  # in admission order
        # Set by the engine: a sequence whose pending tokens reach it finishes there.
        self.max_model_len: int | None = None
        # Each decoding sequence's `ScheduledChunk(seq, 1, True)`, made once and planned every step
        # it decodes (dropped when the sequence finishes).
        self._decode_chunks: dict[Sequence, ScheduledChunk] = {}
        self._drain = SlotDrain()  # room being made for a starved sequence's adapter
        # Whether a sequence's adapter is on the device, asking nothing (unlike `ready`, which
        # starts its load); set by the engine. None: only the running set's adapters count.
        self.resident: Callable[[Sequence], bool] | None = None

    @property
    def waiting(self) -> SeqView[Sequence]:
        return self.policy.waiting

    def drain_reservation(self) -> tuple[str | None, str | None]:
        """(the starved sequence's adapter revision, the revision drained for it), or (None, None):
        the residency gives the drained slot to that load only (engine/slot_drain.py)."""
        starved = self._drain.starved
        if starved is None or starved.adapter is None or self._drain.target is None:
            return None, None
        return starved.adapter.revision, self._drain.target

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.waiting_since = self.clock()
        self.policy.push(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def schedule(self) -> StepPlan:
        budget = self.token_budget
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []

        # The running pass is the whole step in steady decoding: per sequence, a few integer ops,
        # the pool only when a block boundary is crossed, and the sequence's cached decode chunk.
        # It walks a copy of `running`: a victim may be one already planned (it gives its rows
        # back) or one not reached yet (skipped). FCFS victims come off the end, so there the pass
        # plans nothing after a preemption, as the index-based loop of the design would stop.
        running = self.running
        pool = self.pool
        bs = self.block_size
        decode_chunks = self._decode_chunks
        prefix = self.prefix
        decode = self.decode
        all_decode = True
        for seq in running[:]:
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this pass, as a victim ahead of its turn
            output = seq.output_token_ids
            computed = seq.num_computed
            pending = seq.pending
            uncomputed = len(seq.prompt_token_ids) + len(output) + pending - computed
            if uncomputed <= 0 or (pending and self._ends_with_pending(seq)):
                continue  # finishes once the step in flight completes: nothing to plan
            n = uncomputed if uncomputed < budget else budget
            need = -(-(computed + n) // bs) - len(seq.block_ids)
            if need > 0:
                if prefix is not None:  # its blocks so far are full: cache them
                    prefix.commit(seq)
                while need > pool.num_free:
                    victim = decode.victim(running)
                    budget += _unplan(victim, chunks)
                    self._preempt(victim)
                    preempted.append(victim.request_id)
                    if victim is seq:
                        break
                if seq.status is not SequenceStatus.RUNNING:
                    continue  # it preempted itself (under FCFS everything after it is gone too)
                seq.block_ids.extend(pool.allocate(need))
            if n == 1 and uncomputed == 1 and (output or pending):  # _is_decode(seq, n)
                chunk = decode_chunks.get(seq)
                if chunk is None:
                    chunk = decode_chunks[seq] = ScheduledChunk(seq, 1, True)
                    if prefix is not None:  # its prompt is computed: cache its full blocks
                        prefix.commit(seq)
            else:
                if prefix is not None:  # the chunks computed so far
                    prefix.commit(seq)
                chunk = ScheduledChunk(seq, n, False)
                all_decode = False
            chunks.append(chunk)
            budget -= n

        # No admissions in a step that preempted: the pool is short, and the sequence just
        # preempted would otherwise be re-admitted at once to recompute a prefix it loses again.
        ready, policy = self.ready, self.policy
        max_seqs = self.config.max_num_seqs
        if preempted or not policy.waiting or (all_decode and running and self._hold_admissions(budget)):
            return self._planned(chunks, preempted, 0, all_decode)
        # Passing over sequences whose adapter is not resident is bounded, so a long backlog of
        # them does not make every step O(waiting); those behind wait for the loads ahead.
        pass_over, skipped, cached_tokens = 4 * max_seqs, 0, 0
        displaced = False  # at most one displacement a step: the slots move over one at a time
        now = self.clock()
        drain = self._drain
        # A drain from an earlier step holds from the pass's start: its starved sequence asks for
        # its adapter first, and nothing before it in the order takes the room it waits for.
        draining = ready is not None and drain.begin(policy.waiting, running)
        if draining:
            assert ready is not None and drain.starved is not None
            draining = not ready(drain.starved)
        candidates = policy.candidates(now, pass_over + max_seqs)
        for seq in candidates:
            if budget <= 0:
                break
            if (
                draining
                and seq is not drain.starved
                and not drain.admits(seq, self.resident)
                and not policy.urgent(seq, now)  # a deadline goes before a drain: it may take it over
            ):
                skipped += 1
                if skipped >= pass_over:
                    break
                continue
            slot_of: Sequence | None = None
            if len(running) >= max_seqs:  # every slot taken: admitted only in a displaced one's place
                slot_of = None if displaced else decode.displace(seq, running, now)
                if slot_of is None:
                    break
            if ready is not None and not ready(seq):
                skipped += 1
                if skipped >= pass_over:
                    break
                if policy.blocks(seq, now):  # room for it: starved, or urgent (then it goes first)
                    current = drain.starved if draining else None
                    if current is None or (policy.urgent(seq, now) and not policy.urgent(current, now)):
                        drain.start(seq, running)
                        draining = True
                continue
            # A waiting sequence holds no blocks and has nothing computed (new, or preempted).
            hits = prefix.lookup(seq) if prefix is not None else []
            start = len(hits) * self.block_size
            n = min(seq.num_tokens - start, budget)
            need = self.blocks_for(start + n) - len(hits)
            # Holding a cached hit block takes it off the free count as allocating would.
            if need + (prefix.num_unheld(hits) if prefix is not None and hits else 0) > pool.num_free:
                break
            if slot_of is not None:
                budget += _unplan(slot_of, chunks)
                self._preempt(slot_of)
                preempted.append(slot_of.request_id)
                displaced = True
            policy.take(seq)
            if prefix is not None:  # the hits are held before allocating, which could evict them
                prefix.admit(seq, hits)
                cached_tokens += start
            seq.block_ids.extend(pool.allocate(need))
            seq.status = SequenceStatus.RUNNING
            running.append(seq)
            policy.started(seq)
            decode.started(seq)
            chunks.append(ScheduledChunk(seq, n, _is_decode(seq, n)))
            budget -= n
        if hasattr(candidates, "close"):
            candidates.close()  # a generator policy puts back what it looked at
        return self._planned(chunks, preempted, cached_tokens)

    def _planned(
        self, chunks: list[ScheduledChunk], preempted: list[str], cached_tokens: int, all_decode: bool = False
    ) -> StepPlan:
        if self.policy.charges:  # service counted when planned: what fairness is measured in
            for c in chunks:
                self.policy.charge(c.seq, c.num_tokens)
        # all_decode: the running pass planned only decode chunks (one row, uncomputed == 1)
        return StepPlan(tuple(chunks), tuple(preempted), cached_tokens, all_decode and bool(chunks))

    def set_step_budget(self, tokens: int, admission_batch_tokens: int) -> None:
        """Plan at most `tokens` rows a step from now on, and batch admissions up to
        `admission_batch_tokens` (0: admit at once). At most the configured budget, which the
        engine's buffers and CUDA graphs are sized for; `bench serve --budget-sweep` compares
        budgets on one engine this way."""
        most = self.config.step_token_budget
        if not 0 < tokens <= most:
            raise ValueError(f"a step budget must be 1..{most} (max_num_batched_tokens), got {tokens}")
        if admission_batch_tokens < 0:
            raise ValueError(f"admission_batch_tokens must be >= 0, got {admission_batch_tokens}")
        self.token_budget, self.admission_batch_tokens = tokens, admission_batch_tokens

    def _hold_admissions(self, budget: int) -> bool:
        """Whether a pure decode step keeps its waiting prompts back: while fewer than
        `admission_batch_tokens` prompt tokens (capped by the step's room) wait and the oldest
        waiting sequence has waited less than `admission_max_wait_ms`. Counting stops at the
        threshold, so a long queue costs no more than a short one."""
        want = min(self.admission_batch_tokens, budget)
        if want <= 0 or len(self.running) >= self.config.max_num_seqs:
            return False
        waiting = self.waiting
        if (
            self.clock() - min(s.waiting_since for s in itertools.islice(waiting, 4))
            >= self._admission_max_wait
        ):
            return False  # (preempted sequences keep their arrival order, so look past the first)
        tokens = 0
        for seq in waiting:
            tokens += seq.num_uncomputed
            if tokens >= want:
                return False
        return True

    def _ends_with_pending(self, seq: Sequence) -> bool:
        """Whether the tokens a launched step samples for `seq` end it by length (so the step
        planned before they arrive leaves it out; an end by EOS or a stop is only known then)."""
        if len(seq.output_token_ids) + seq.pending >= seq.params.max_tokens:
            return True
        return self.max_model_len is not None and seq.num_tokens + seq.pending >= self.max_model_len

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks."""
        was_running = seq in self.running  # at most max_num_seqs long
        if was_running:
            self.running.remove(seq)
        # Only a waiting sequence can be in the waiting queue: a finishing (running) one skips
        # the scan, which would otherwise cost O(waiting) per finish under a long backlog.
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.policy.remove(seq)
        self._free_blocks(seq)
        seq.status = SequenceStatus.FINISHED
        if was_running:
            self.policy.stopped(seq)
            self.decode.stopped(seq)
        self._decode_chunks.pop(seq, None)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.policy.stopped(seq)
        self.decode.stopped(seq)
        self._free_blocks(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        seq.waiting_since = self.clock()
        self.policy.push(seq)

    def _free_blocks(self, seq: Sequence) -> None:
        if self.prefix is not None:  # its computed full blocks stay cached after it lets go
            self.prefix.commit(seq)
        # last block first: a sequence's tail is evicted before its (likelier shared) prefix
        self.pool.free(reversed(seq.block_ids))
        seq.block_ids = []
        seq.num_committed_blocks = 0


def _unplan(seq: Sequence, chunks: list[ScheduledChunk]) -> int:
    """Take a sequence about to be preempted out of this step's plan; the rows it gives back."""
    for i in range(len(chunks) - 1, -1, -1):
        if chunks[i].seq is seq:
            return chunks.pop(i).num_tokens
    return 0


def _is_decode(seq: Sequence, n: int) -> bool:
    return n == 1 and seq.num_uncomputed == 1 and bool(seq.output_token_ids or seq.pending)

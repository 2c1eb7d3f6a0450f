"""The host-side fast paths of a decode step give what the general paths give.

Sampler: one argmax for an all-greedy batch, logprobs without a gather when every row asks,
in-place top-k / top-p when every row takes them, row views from one unbind for per-request
generators. Scheduler: the running pass with cached decode chunks, against the plain algorithm.
StopChecker: the tokenizer-less checks against `_reason`. StepStats: one pass over the chunks.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from loraplex.config import SchedulerConfig
from loraplex.engine.sampler import Sampler, filtered_logits, logprob_dicts
from loraplex.engine.scheduler import ScheduledChunk, Scheduler, StepPlan
from loraplex.engine.sequence import Sequence, SequenceStatus
from loraplex.engine.stats import StepStats
from loraplex.engine.stop import StopChecker
from loraplex.kv.block_pool import BlockPool
from loraplex.lora.metadata import BASE_SLOT
from loraplex.types import AdapterRef, SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def _tied_logits(n: int, vocab: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rounded logits: many ties, including ties for the maximum."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.round(torch.randn(n, vocab, generator=gen) * 2)
    logits[0] = 0.0  # every token tied
    logits[1, 3] = logits[1, 9] = logits[1].max() + 1  # a tie for the maximum
    return logits.to(dtype)


def _reference_dict(lp: torch.Tensor, chosen: int, k: int, kmax: int) -> dict[int, float]:
    """The documented dict, built the slow way: chosen first, then the top-k, each token once.
    (The top-k are the first k of the batch's top-kmax: which of tied tokens those are is topk's
    choice, as it always was.)"""
    row = {chosen: lp[chosen].item()}
    vals, ids = torch.topk(lp, min(kmax, lp.shape[-1]))
    for tok, v in zip(ids.tolist()[:k], vals.tolist()[:k], strict=True):
        row.setdefault(tok, v)
    return row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_greedy_batch_equals_greedy_rows_of_a_mixed_batch(dtype: torch.dtype) -> None:
    logits = _tied_logits(9, 40, seed=1, dtype=dtype)
    fast = Sampler()(logits, [GREEDY] * 9, [None] * 9).token_ids
    assert fast == logits.float().argmax(-1).tolist()
    assert fast[0] == 0 and fast[1] == 3  # ties go to the lowest index
    # The same rows with a sampled row among them take the general (gathered) path.
    mixed_logits = torch.cat([logits[:4], logits[:1], logits[4:]])
    params = [GREEDY] * 4 + [SamplingParams(temperature=0.7, top_p=0.5)] + [GREEDY] * 5
    mixed = Sampler(torch.Generator().manual_seed(0))(mixed_logits, params, [None] * 10).token_ids
    assert mixed[:4] + mixed[5:] == fast
    # and the point masses of filtered_logits put all their mass on the same tokens
    point = filtered_logits(logits, [GREEDY] * 9)
    assert point.argmax(-1).tolist() == fast


@pytest.mark.parametrize("top_n", [[1] * 6, [0] * 6, [3, 0, 1, 50, 5, 2]])
def test_logprobs_of_every_row_equal_those_of_some_rows(top_n: list[int]) -> None:
    vocab = 30
    logits = _tied_logits(6, vocab, seed=2, dtype=torch.bfloat16)
    raw = torch.log_softmax(logits.float(), dim=-1)
    params = [SamplingParams(temperature=0.0, logprobs=k) for k in top_n]
    every = Sampler()(logits, params, [None] * 6)  # all rows ask: no gather
    for i, d in enumerate(every.logprobs):
        assert d is not None
        ref = _reference_dict(raw[i], every.token_ids[i], top_n[i], max(top_n))
        assert d == ref and list(d) == list(ref)  # values and order (chosen token first)
    # Rows that do not ask in between: the gathered path.
    some_params = [p for pair in zip(params, [GREEDY] * 6, strict=True) for p in pair]
    some_logits = logits.repeat_interleave(2, dim=0)
    some = Sampler()(some_logits, some_params, [None] * 12)
    assert some.token_ids[::2] == every.token_ids
    assert some.logprobs[1::2] == [None] * 6
    for d, e in zip(some.logprobs[::2], every.logprobs, strict=True):
        assert d == e and list(d) == list(e)  # type: ignore[arg-type]
    # The public logprob_dicts (prompt logprobs) agrees too.
    assert logprob_dicts(raw, every.token_ids, top_n) == every.logprobs


def test_chosen_token_outside_the_top_n_comes_first() -> None:
    logits = torch.tensor([[0.5, 1.0, 0.9, 0.0]])
    params = [SamplingParams(temperature=1.0, logprobs=2, seed=0)]
    sampler = Sampler()
    for seed in range(40):
        res = sampler(logits, params, [torch.Generator().manual_seed(seed)])
        d = res.logprobs[0]
        assert d is not None and list(d)[0] == res.token_ids[0]
        assert set(d) == {res.token_ids[0], 1, 2}
        if res.token_ids[0] not in (1, 2):
            return
    pytest.fail("never sampled a token outside the top 2")


def test_rows_with_own_generators_draw_the_same_in_any_batch() -> None:
    vocab, n = 50, 8
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(3)) * 2
    params = [SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=i) for i in range(n)]

    def gens() -> list[torch.Generator]:
        return [torch.Generator().manual_seed(100 + i) for i in range(n)]

    sampler = Sampler(torch.Generator().manual_seed(1))
    g_all, g_alone = gens(), gens()
    for _ in range(5):
        together = sampler(logits, params, g_all).token_ids  # every row private: one unbind
        alone = [sampler(logits[i : i + 1], params[i : i + 1], [g_alone[i]]).token_ids[0] for i in range(n)]
        assert together == alone
    # Among shared-generator and greedy rows (indexed row views) they still draw the same.
    g_mixed, g_ref = gens(), gens()
    shared = SamplingParams(temperature=1.0)
    mixed_params = [p for pair in zip(params, [shared, GREEDY] * 4, strict=True) for p in pair]
    mixed_logits = logits.repeat_interleave(2, dim=0)
    mixed_gens = [g for pair in zip(g_mixed, [None] * n, strict=True) for g in pair]
    for _ in range(3):
        mixed = sampler(mixed_logits, mixed_params, mixed_gens).token_ids[::2]
        assert mixed == sampler(logits, params, g_ref).token_ids


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    list(itertools.product((0.5, 1.0, 1.7), (0, 1, 3, 31, 40), (0.3, 0.9, 1.0))),
)
def test_filtered_logits_in_place_equals_gathered(temperature: float, top_k: int, top_p: float) -> None:
    logits = _tied_logits(5, 32, seed=4)
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    together = filtered_logits(logits, [p] * 5)  # every row takes top-k / top-p: in place
    # The same rows between rows that take neither (and a greedy one): gathered and scattered.
    plain = SamplingParams(temperature=temperature)
    params = [q for pair in zip([p] * 5, [plain, GREEDY, plain, plain, GREEDY], strict=True) for q in pair]
    gathered = filtered_logits(logits.repeat_interleave(2, dim=0), params)[::2]
    assert torch.equal(together, gathered)


# --- stop checks ----------------------------------------------------------------------------------


def test_tokenizer_less_stop_checks_equal_the_general_checks() -> None:
    rnd = random.Random(5)
    eos = frozenset({2, 7})
    checker = StopChecker(None, eos)
    for trial in range(400):
        params = SamplingParams(
            max_tokens=rnd.randint(1, 8),
            ignore_eos=rnd.random() < 0.5,
            stop_token_ids=tuple(rnd.sample(range(10), rnd.randint(0, 2))),
            stop=("ab",) if rnd.random() < 0.3 else (),
        )
        seq = Sequence(f"r{trial}", [1] * rnd.randint(1, 6), params, None, trial)
        seq.output_token_ids = [rnd.randrange(10) for _ in range(rnd.randint(1, 9))]
        max_len = rnd.randint(3, 14)
        want = checker._reason(seq, max_len)
        assert checker.check(seq, max_len) == want, (params, seq.output_token_ids, max_len)
        assert seq.text == "" and seq.detokenizer is None


# --- scheduler and StepStats ----------------------------------------------------------------------


def _reference_schedule(self: Scheduler) -> StepPlan:
    """The scheduler's algorithm as first written (index loop, a new chunk for every row)."""
    budget = self.config.max_num_batched_tokens
    chunks: list[ScheduledChunk] = []
    preempted: list[str] = []
    i = 0
    while i < len(self.running) and budget > 0:
        seq = self.running[i]
        n = min(seq.num_uncomputed, budget)
        need = self.blocks_for(seq.num_computed + n) - len(seq.block_ids)
        while need > self.pool.num_free:
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is seq:
                break
        if seq.status is not SequenceStatus.RUNNING:
            break
        seq.block_ids.extend(self.pool.allocate(need))
        decode = n == 1 and seq.num_uncomputed == 1 and bool(seq.output_token_ids)
        chunks.append(ScheduledChunk(seq, n, decode))
        budget -= n
        i += 1
    while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
        seq = self.waiting[0]
        n = min(seq.num_uncomputed, budget)
        need = self.blocks_for(seq.num_computed + n) - len(seq.block_ids)
        if need > self.pool.num_free:
            break
        self.waiting.pop(0)
        seq.block_ids.extend(self.pool.allocate(need))
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        decode = n == 1 and seq.num_uncomputed == 1 and bool(seq.output_token_ids)
        chunks.append(ScheduledChunk(seq, n, decode))
        budget -= n
    return StepPlan(tuple(chunks), tuple(preempted))


_REFS = [AdapterRef("a", "0" * 64), AdapterRef("b", "1" * 64)]  # slots 0 and 1


def _simulate(reference: bool, seed: int, num_blocks: int) -> list[tuple]:
    """Drive a scheduler with model-free steps; one signature per step (plan and stats)."""
    rnd = random.Random(seed)
    block_size = 4
    pool = BlockPool(num_blocks)
    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24), pool, block_size)
    if reference:
        sched.schedule = _reference_schedule.__get__(sched)  # type: ignore[method-assign]
    arrivals = itertools.count()
    log: list[tuple] = []
    live: list[Sequence] = []
    for step in range(120):
        if step < 60 and rnd.random() < 0.4:
            params = SamplingParams(max_tokens=rnd.randint(1, 12))
            adapter = rnd.choice([None, *_REFS])
            seq = Sequence(f"s{step}", [5] * rnd.randint(1, 20), params, adapter, next(arrivals))
            live.append(seq)
            sched.add(seq)
        plan = sched.schedule()
        for c in plan.chunks:
            c.seq.num_computed += c.num_tokens
        stats = StepStats.of(plan, 0, 0, sched, pool)
        decode = sum(c.num_tokens for c in plan.chunks if c.is_decode)
        rows = sum(c.num_tokens for c in plan.chunks)
        assert stats.num_rows == rows and stats.num_decode_rows == decode
        assert stats.num_prefill_rows == rows - decode
        assert stats.num_base_rows == sum(c.num_tokens for c in plan.chunks if c.seq.adapter is None)
        assert stats.rows_per_request == {c.seq.request_id: c.num_tokens for c in plan.chunks}
        log.append(
            (
                tuple((c.seq.request_id, c.num_tokens, c.is_decode) for c in plan.chunks),
                plan.preempted,
                stats.kv_blocks_used,
                stats.num_running,
                stats.num_waiting,
            )
        )
        for c in plan.chunks:
            if c.seq.num_computed == c.seq.num_tokens:
                c.seq.output_token_ids.append(1)
                if len(c.seq.output_token_ids) >= c.seq.params.max_tokens:
                    sched.finish(c.seq)
                    assert c.seq not in sched._decode_chunks
        pool.check_integrity()
    assert any(p for _, p, *_ in log), "the workload should preempt"
    assert any(d for chunks, *_ in log for *_, d in chunks), "and decode"
    return log


@pytest.mark.parametrize("seed", range(6))
def test_scheduler_plans_equal_the_reference_algorithm(seed: int) -> None:
    assert _simulate(False, seed, num_blocks=10) == _simulate(True, seed, num_blocks=10)


def test_decode_chunks_are_made_once_per_sequence() -> None:
    pool = BlockPool(8)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16), pool, 4)
    seq = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=9), None, 0)
    sched.add(seq)
    first = sched.schedule().chunks[0]
    assert not first.is_decode and first.num_tokens == 3
    seen = []
    for _ in range(4):
        seq.num_computed = seq.num_tokens
        seq.output_token_ids.append(7)
        (chunk,) = sched.schedule().chunks
        assert chunk == ScheduledChunk(seq, 1, True) and chunk.completes
        seen.append(chunk)
    assert all(c is seen[0] for c in seen)
    sched.finish(seq)
    assert not sched._decode_chunks and seq.status is SequenceStatus.FINISHED


# --- eager-step host paths: per chunk, not per token -----------------------------------------


def test_tokens_between_matches_token_at() -> None:
    seq = Sequence("r", list(range(100, 107)), SamplingParams(), None, 0)
    seq.output_token_ids = [7, 8, 9]
    for start, end in itertools.combinations(range(seq.num_tokens + 1), 2):
        assert seq.tokens_between(start, end) == [seq.token_at(p) for p in range(start, end)]


def test_lora_metadata_from_runs_equals_per_row_grouping() -> None:
    # runs of one slot per chunk, slots repeating in later chunks and base rows between: the
    # run-based builder gives the per-row grouping (rows by slot in order of first appearance)
    from lora.lora_cases import make_table

    from loraplex.lora.metadata import LoRABatchMetadata

    table = make_table([8, 16, 4], torch.float32, "cpu", seed=3)
    rng = random.Random(5)
    for _ in range(20):
        runs, row = [], 0
        for _ in range(rng.randint(1, 8)):
            n = rng.choice([0, 1, 1, 2, 5, 17])
            runs.append((rng.choice([BASE_SLOT, 0, 1, 2]), row, n))
            row += n
        row_slots = [slot for slot, _, n in runs for _ in range(n)]
        per_row = {}
        for r, slot in enumerate(row_slots):
            if slot != BASE_SLOT:
                per_row.setdefault(slot, []).append(r)
        want_perm = [r for rows in per_row.values() for r in rows]
        for meta in (
            LoRABatchMetadata.build_runs(runs, row, table),
            LoRABatchMetadata.build(row_slots, table),
        ):
            assert meta.num_rows == row
            assert meta.row_perm.tolist() == want_perm
            assert list(meta.seg_slots_host) == list(per_row)
            sizes = [len(rows) for rows in per_row.values()]
            assert list(meta.seg_offsets_host) == list(itertools.accumulate([0, *sizes]))
            assert meta.seg_offsets.tolist() == list(meta.seg_offsets_host)

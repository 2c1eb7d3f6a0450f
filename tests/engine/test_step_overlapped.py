"""`Engine.step_overlapped` (the serving loops' step, one ahead: launch the next step while the one
in flight still runs, its tokens read on the device, then complete the one in flight and return
its deltas) against `Engine.step`: the same outputs and deltas per request; a stop found at the
step in flight costs the next step one dropped row, an end by length none; an abort while a
request's step is in flight drops that token and frees everything; preemption of a sequence with a
token in flight; the two kinds of call mix."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import build_hf_model, make_peft_adapter, save_hf_model

from loraplex import LLM, SamplingParams
from loraplex.engine.engine import Engine

PARAMS = [
    SamplingParams(max_tokens=7, temperature=0.0, logprobs=2, ignore_eos=True),
    SamplingParams(max_tokens=9, temperature=1.0, seed=3, ignore_eos=True),
    SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, stop_token_ids=[17]),
    SamplingParams(max_tokens=0, prompt_logprobs=1),  # scoring only: ends after its prefill
    SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, ignore_eos=True),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    tmp = tmp_path_factory.mktemp("overlapped")
    hf = build_hf_model("llama", seed=6)
    adapter = make_peft_adapter(hf, tmp / "a", r=8, target_modules=["q_proj", "v_proj", "down_proj"], seed=60)
    return save_hf_model(hf, tmp / "base"), adapter


def _engine(model_dir: tuple) -> Engine:
    llm = LLM(model_dir[0], max_num_batched_tokens=48, seed=1)
    llm.register_adapter("a", model_dir[1])
    return llm.engine


def _requests() -> list[tuple[str, list[int], SamplingParams, str | None]]:
    g = torch.Generator().manual_seed(2)
    out = []
    for i in range(10):
        prompt = torch.randint(3, 97, (int(torch.randint(2, 40, (1,), generator=g)),), generator=g).tolist()
        out.append((f"r{i}", prompt, PARAMS[i % len(PARAMS)], "a" if i % 2 else None))
    return out


def _drive(e: Engine, overlapped: bool, abort_at: dict[int, str] | None = None) -> tuple[dict, list]:
    """Two arrivals per call; returns each request's output and every delta in call order."""
    pending = _requests()
    deltas = []
    calls = 0
    while pending or e.has_unfinished():
        for rid, prompt, params, adapter in pending[:2]:
            e.add_request(rid, prompt, params, adapter)
        pending = pending[2:]
        deltas += e.step_overlapped() if overlapped else e.step()
        calls += 1
        if abort_at and calls in abort_at:
            assert e.abort(abort_at[calls])
    deltas += e.step()  # completes a step left in flight (none here: nothing was running)
    e.check_integrity()
    return {rid: e.output(rid) for rid, *_ in _requests()}, deltas


def test_overlapped_outputs_equal_step_outputs(model_dir: tuple) -> None:
    ref, ref_deltas = _drive(_engine(model_dir), overlapped=False)
    got, got_deltas = _drive(_engine(model_dir), overlapped=True)
    for rid, out in ref.items():
        assert got[rid].token_ids == out.token_ids, rid
        assert got[rid].logprobs == out.logprobs and got[rid].prompt_logprobs == out.prompt_logprobs, rid
        assert got[rid].finish_reason == out.finish_reason, rid
    # the same deltas per request, in the same order
    per = lambda ds, rid: [(d.new_token_ids, d.finished) for d in ds if d.request_id == rid]  # noqa: E731
    for rid in ref:
        assert per(got_deltas, rid) == per(ref_deltas, rid), rid


def test_abort_while_in_flight_drops_the_token_and_frees_everything(model_dir: tuple) -> None:
    e = _engine(model_dir)
    e.add_request("keep", list(range(5, 30)), PARAMS[0], "a")
    e.add_request("gone", list(range(6, 31)), PARAMS[1], None)
    for _ in range(3):
        e.step_overlapped()
    assert len(e._in_flight) == 1 and any(c.seq.request_id == "gone" for c in e._in_flight[0].plan.chunks)
    before = list(e.output("gone").token_ids)
    assert e.abort("gone")
    free = e.pool.num_free
    while e.has_unfinished():
        for d in e.step_overlapped():
            assert d.request_id != "gone"  # its in-flight token was dropped, no delta
    e.step()
    out = e.output("gone")
    assert out.finished and out.finish_reason == "abort" and out.token_ids == before
    assert e.pool.num_free >= free
    kept = e.output("keep").token_ids
    e.release("gone")
    e.release("keep")
    e.check_integrity()
    # the other request is untouched: equal to a run without the aborted one
    ref = _engine(model_dir)
    ref.add_request("keep", list(range(5, 30)), PARAMS[0], "a")
    while ref.has_unfinished():
        ref.step()
    assert len(kept) == PARAMS[0].max_tokens and kept == ref.output("keep").token_ids


def test_step_after_overlapped_calls_completes_the_step_in_flight(model_dir: tuple) -> None:
    e = _engine(model_dir)
    e.add_request("x", list(range(5, 20)), PARAMS[0], "a")
    first = e.step_overlapped()
    assert first == [] and len(e._in_flight) == 1  # launched, not completed
    second = e.step()  # completes it, then runs a whole step
    assert [len(d.new_token_ids) for d in second] == [1, 1] and not e._in_flight
    assert e.last_stats is not None


def _run(e: Engine, requests: list[tuple[str, list[int], SamplingParams]], overlapped: bool) -> dict:
    for rid, prompt, params in requests:
        e.add_request(rid, prompt, params, None)
    while e.has_unfinished():
        e.step_overlapped() if overlapped else e.step()
        e.check_integrity()
    e.step()
    return {rid: e.output(rid) for rid, _, _ in requests}


def _plans_of(e: Engine) -> list[list[str]]:
    """The request ids of every plan the engine's scheduler makes from now on."""
    plans: list[list[str]] = []
    schedule = e.scheduler.schedule

    def spy():  # noqa: ANN202
        plan = schedule()
        plans.append([c.seq.request_id for c in plan.chunks])
        return plan

    e.scheduler.schedule = spy  # type: ignore[method-assign]
    return plans


def test_the_next_step_is_planned_while_the_last_ones_tokens_are_on_the_device(model_dir: tuple) -> None:
    e = _engine(model_dir)
    e.add_request("x", list(range(5, 20)), PARAMS[0], "a")
    e.step_overlapped()  # the prefill, in flight
    e.step_overlapped()  # the first decode step launched before the prefill's token arrived
    (f,) = e._in_flight
    (chunk,) = f.plan.chunks
    assert chunk.is_decode and chunk.seq.pending == 1 and len(chunk.seq.output_token_ids) == 1
    ref = _engine(model_dir)
    ref.add_request("x", list(range(5, 20)), PARAMS[0], "a")
    while ref.has_unfinished():
        ref.step()
    while e.has_unfinished():
        e.step_overlapped()
    assert e.output("x").token_ids == ref.output("x").token_ids


def test_a_stop_at_the_step_in_flight_drops_the_next_steps_row(model_dir: tuple) -> None:
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    both = [("s", list(range(9, 30)), greedy), ("o", list(range(3, 12)), greedy)]
    ref = _run(_engine(model_dir), both, False)
    stop = ref["s"].token_ids[2]
    first = ref["s"].token_ids.index(stop)
    stopping = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=[stop])
    e = _engine(model_dir)
    free = e.pool.num_free
    plans = _plans_of(e)
    got = _run(e, [("s", list(range(9, 30)), stopping), ("o", list(range(3, 12)), greedy)], True)
    assert got["s"].token_ids == ref["s"].token_ids[: first + 1] and got["s"].finish_reason == "stop"
    assert got["o"].token_ids == ref["o"].token_ids
    # it was planned once more than it sampled tokens: the step after its stop, launched before
    # the stop token reached the host (that row's token was dropped)
    assert sum("s" in p for p in plans) == len(got["s"].token_ids) + 1
    e.release("s")
    e.release("o")
    e.check_integrity()
    assert e.pool.num_used == 0 and e.pool.num_free == free  # every block back (cached or free)


def test_an_end_by_length_is_left_out_of_the_next_plan(model_dir: tuple) -> None:
    e = _engine(model_dir)
    plans = _plans_of(e)
    three = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    got = _run(e, [("l", list(range(9, 30)), three)], True)
    assert len(got["l"].token_ids) == 3 and got["l"].finish_reason == "length"
    assert sum("l" in p for p in plans) == 3  # the prefill and two decode steps, no wasted row


def test_preemption_of_a_sequence_with_a_token_in_flight(model_dir: tuple) -> None:
    # 14 blocks of 16 tokens for 6 requests growing to ~50 tokens: preemptions while tokens are
    # pending; outputs as with step()
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    reqs = [(f"p{i}", list(range(4 + i, 30 + i)), greedy) for i in range(6)]

    def engine() -> Engine:
        llm = LLM(model_dir[0], max_num_batched_tokens=48, seed=1, num_kv_blocks=14)
        return llm.engine

    ref = _run(engine(), reqs, False)
    e = engine()
    got = _run(e, reqs, True)
    assert sum(s.num_preemptions for s in e._seqs.values()) > 0
    for rid in ref:
        assert got[rid].token_ids == ref[rid].token_ids, rid

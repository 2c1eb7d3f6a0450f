"""`Engine.step_overlapped` (the serving loops' step: complete the step in flight, launch the next,
return the completed one's deltas) against `Engine.step`: the same outputs, deltas one call later;
an abort while a request's step is in flight drops that token and frees everything; the two
kinds of call mix."""

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
    assert e._in_flight is not None and any(c.seq.request_id == "gone" for c in e._in_flight.plan.chunks)
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
    assert first == [] and e._in_flight is not None  # launched, not completed
    second = e.step()  # completes it, then runs a whole step
    assert [len(d.new_token_ids) for d in second] == [1, 1] and e._in_flight is None
    assert e.last_stats is not None

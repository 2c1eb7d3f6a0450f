"""Prompt scoring with `max_tokens=0`: the prompt is prefilled (prompt logprobs against transformers +
PEFT in float32) and the request finishes with reason "length" and no token, without a sampler row,
beside normal requests whose outputs it must not change."""

from __future__ import annotations

import pytest
import torch
from helpers.reference import assert_logprob_dicts_match, load_peft_mixture, mixed_batch_greedy
from helpers.tiny_models import build_hf_model, make_peft_adapter, save_hf_model

from loraplex import LLM, SamplingParams
from loraplex.engine.engine import Engine

ATOL = 1e-4
TOP_N = 5
ADAPTERS = {
    "r8": (8, ["q_proj", "v_proj"], {}),
    "r16": (
        16,
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        {"use_rslora": True},
    ),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("scoring")
    hf = build_hf_model("llama", seed=5)
    model_dir = save_hf_model(hf, root / "base")
    paths = {
        name: make_peft_adapter(hf, root / name, r=r, target_modules=targets, seed=200 + i, **kw)
        for i, (name, (r, targets, kw)) in enumerate(ADAPTERS.items())
    }
    return {"hf": hf, "model_dir": model_dir, "paths": paths}


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(setup: dict, **kw) -> Engine:  # noqa: ANN003
    engine = LLM(setup["model_dir"], dtype="float32", seed=1, **kw).engine
    for name, path in setup["paths"].items():
        engine.register_adapter(name, path)
    return engine


class _SamplerSpy:
    """Records the params of every row the engine hands to its sampler."""

    def __init__(self, sampler) -> None:  # noqa: ANN001
        self.sampler = sampler
        self.rows: list[SamplingParams] = []

    def launch(self, logits, params, generators):  # noqa: ANN001, ANN202
        assert logits.shape[0] == len(params)
        self.rows.extend(params)
        return self.sampler.launch(logits, params, generators)


# The generating requests: greedy, unseeded sampling (the engine's shared generator) and seeded sampling.
GENERATING = [
    ("g0", 12, None, SamplingParams(max_tokens=7, temperature=0.0, logprobs=3, ignore_eos=True)),
    ("g1", 30, "r8", SamplingParams(max_tokens=9, temperature=1.0, logprobs=2, ignore_eos=True)),
    ("g2", 5, "r16", SamplingParams(max_tokens=6, temperature=0.9, top_k=20, ignore_eos=True)),
    ("g3", 21, "r16", SamplingParams(max_tokens=8, temperature=1.0, seed=4, ignore_eos=True)),
    ("g4", 9, None, SamplingParams(max_tokens=5, temperature=1.0, top_p=0.9, ignore_eos=True)),
]
# Scoring requests (default temperature 1.0 and no seed: a sampler row would draw from the shared
# generator), arriving between the generating ones.
SCORING = [
    ("s0", 37, "r16", SamplingParams(max_tokens=0, prompt_logprobs=TOP_N)),
    ("s1", 16, None, SamplingParams(max_tokens=0, prompt_logprobs=2)),
    ("s2", 11, "r8", SamplingParams(max_tokens=0)),
]


def _run(engine: Engine, requests: list[tuple]) -> dict[str, list]:
    """Add the requests in order, step to the end checking the bookkeeping; deltas by request id."""
    for rid, n, adapter, params in requests:
        engine.add_request(rid, _prompt(n, seed=n), params, adapter)
    deltas: dict[str, list] = {rid: [] for rid, *_ in requests}
    while engine.has_unfinished():
        for d in engine.step():
            deltas[d.request_id].append(d)
        engine.check_integrity()
    return deltas


def test_scoring_in_mixed_batch_matches_peft_and_changes_no_neighbour(setup: dict) -> None:
    interleaved = [GENERATING[0], SCORING[0], GENERATING[1], SCORING[1], GENERATING[2], SCORING[2]]
    interleaved += GENERATING[3:]
    engine = _engine(setup, max_num_batched_tokens=4096)
    spy = engine.sampler = _SamplerSpy(engine.sampler)
    deltas = _run(engine, interleaved)

    assert not any(p.max_tokens == 0 for p in spy.rows), "a scoring request reached the sampler"
    for rid, _n, adapter, params in SCORING:
        out = engine.output(rid)
        assert out.finished and out.finish_reason == "length", rid
        assert out.token_ids == [] and out.text == "" and out.logprobs is None, rid
        assert [(d.new_token_ids, d.finished, d.finish_reason) for d in deltas[rid]] == [([], True, "length")]
        assert (out.adapter is None) == (adapter is None), rid
        if params.prompt_logprobs is None:
            assert out.prompt_logprobs is None
    assert engine.pool.num_used == 0
    assert all(engine.adapters.holds(e.ref) == 0 for e in engine.adapters.list())

    scored = [s for s in SCORING if s[3].prompt_logprobs is not None]
    ref_model = load_peft_mixture(setup["hf"], setup["paths"])
    refs = mixed_batch_greedy(
        ref_model, [_prompt(n, seed=n) for _, n, _, _ in scored], [a for _, _, a, _ in scored], 0
    )
    for (rid, n, adapter, params), ref in zip(scored, refs, strict=True):
        out = engine.output(rid)
        assert len(out.prompt_logprobs) == n and out.prompt_logprobs[0] is None
        what = f"{rid} ({adapter or 'base'})"
        assert_logprob_dicts_match(
            out.prompt_logprobs[1:], ref.prompt_logprobs, params.prompt_logprobs, ATOL, what
        )

    # The same generating requests on an identical engine without the scoring ones.
    alone = _engine(setup, max_num_batched_tokens=4096)
    _run(alone, GENERATING)
    for rid, *_ in GENERATING:
        got, want = engine.output(rid), alone.output(rid)
        assert got.token_ids == want.token_ids, rid
        assert got.finish_reason == want.finish_reason == "length"
        for x, y in zip(got.logprobs or [], want.logprobs or [], strict=True):
            assert x.keys() == y.keys() and all(abs(x[k] - y[k]) <= 1e-5 for k in x), rid


def test_prompt_of_the_whole_context_scores_in_chunks(setup: dict) -> None:
    # 48 tokens fill the context and exactly the 3 blocks of the pool, prefilled 16 rows a step.
    llm = LLM(
        setup["model_dir"], dtype="float32", max_model_len=48, block_size=16, num_kv_blocks=3,
        max_num_batched_tokens=16,
    )  # fmt: skip
    llm.register_adapter("r8", setup["paths"]["r8"])
    engine = llm.engine
    prompt = _prompt(48, seed=48)
    with pytest.raises(ValueError, match="context length is 48 and leaves no room"):
        llm.generate([prompt], SamplingParams(max_tokens=1), adapters="r8")
    with pytest.raises(ValueError, match="context length"):
        llm.generate([prompt + [5]], SamplingParams(max_tokens=0), adapters="r8")
    assert not engine.has_unfinished()

    engine.add_request("full", prompt, SamplingParams(max_tokens=0, prompt_logprobs=3), "r8")
    steps = []
    while engine.has_unfinished():
        steps.append(engine.step())
        engine.check_integrity()
    assert [[(d.new_token_ids, d.finish_reason) for d in s] for s in steps] == [[], [], [([], "length")]]
    out = engine.output("full")
    assert out.token_ids == [] and out.finish_reason == "length"
    ref = mixed_batch_greedy(
        load_peft_mixture(setup["hf"], {"r8": setup["paths"]["r8"]}), [prompt], ["r8"], 0
    )
    assert_logprob_dicts_match(out.prompt_logprobs[1:], ref[0].prompt_logprobs, 3, ATOL, "full context")
    assert engine.pool.num_used == 0
    assert engine.adapters.holds(out.adapter) == 0

    # The offline API returns the same scores.
    again = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=3), adapters="r8")[0]
    assert again.token_ids == [] and again.finish_reason == "length"
    assert again.prompt_logprobs == out.prompt_logprobs


def test_abort_of_a_scoring_request_mid_prefill_frees_everything(setup: dict) -> None:
    engine = _engine(setup, max_num_batched_tokens=8, block_size=4)
    engine.add_request("s", _prompt(30, seed=1), SamplingParams(max_tokens=0, prompt_logprobs=1), "r16")
    assert engine.step() == []
    assert engine.pool.num_used == 2
    assert engine.abort("s")
    engine.check_integrity()
    assert engine.pool.num_used == 0 and not engine.has_unfinished()
    assert engine.output("s").finish_reason == "abort"
    engine.release("s")
    # Still counted right afterwards: a normal request goes through the sampler alone.
    engine.add_request("g", _prompt(6, seed=2), SamplingParams(max_tokens=3, temperature=0.0), None)
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    assert len(engine.output("g").token_ids) == 3


@pytest.mark.parametrize("bad", [-1, None])
def test_max_tokens_below_zero_is_refused(bad: int | None) -> None:
    with pytest.raises(ValueError, match="max_tokens must be >= 0"):
        SamplingParams(max_tokens=bad)
    assert SamplingParams(max_tokens=0).max_tokens == 0

"""Steps with prefill chunks on the static (CUDA-graph) buffers of a token bucket, run eagerly on
the CPU: against transformers + PEFT (greedy tokens) and the plain eager engine (logprobs within
1e-5): staggered arrivals so prefill chunks meet decode rows, chunked prompts continuing their own
KV (and a prefix-cache hit), adapters of several ranks and target sets, a segment longer than one
row tile, base rows, several token buckets; prompt-logprob steps stay eager."""

from __future__ import annotations

import pytest
import torch
from helpers.reference import load_peft_mixture, mixed_batch_greedy
from helpers.tiny_models import build_hf_model, make_peft_adapter, save_hf_model

from loraplex import LLM, SamplingParams
from loraplex.engine.engine import Engine
from loraplex.engine.static_inputs import token_bucket, token_buckets

ADAPTERS = {
    "r8": (8, ["q_proj", "v_proj"]),
    "r16": (16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "r4": (4, ["gate_proj", "down_proj"]),
}
BUDGET = 160  # token buckets 64, 128, 160
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("static_mixed")
    hf = build_hf_model("llama", seed=4)
    paths = {
        name: make_peft_adapter(hf, tmp / name, r=r, target_modules=t, seed=50 + i)
        for i, (name, (r, t)) in enumerate(ADAPTERS.items())
    }
    return {"hf": hf, "dir": save_hf_model(hf, tmp / "base"), "adapters": paths}


def _llm(models: dict, static: bool) -> LLM:
    llm = LLM(models["dir"], max_num_batched_tokens=BUDGET, max_num_seqs=16)
    for name, path in models["adapters"].items():
        llm.register_adapter(name, path)
    if static:
        e = llm.engine
        e.runner.static_steps = e.static_step_runner(16, capture=False, max_tokens=BUDGET)
    return llm


def _drive(e: Engine, requests: list[tuple[str, list[int], str | None, SamplingParams]]) -> dict:
    """Two arrivals before each step, step to the end; outputs by request id."""
    pending = list(requests)
    while pending or e.has_unfinished():
        for rid, prompt, adapter, params in pending[:2]:
            e.add_request(rid, prompt, params, adapter)
        pending = pending[2:]
        e.step()
        e.check_integrity()
    outs = {rid: e.output(rid) for rid, *_ in requests}
    for rid, *_ in requests:
        e.release(rid)
    return outs


def _requests(seed: int) -> list[tuple[str, list[int], str | None, SamplingParams]]:
    g = torch.Generator().manual_seed(seed)
    names = [None, "r8", "r16", "r4", "r16", "r16"]
    out = []
    for i in range(18):
        n = int(torch.randint(1, 110, (1,), generator=g))
        prompt = torch.randint(3, 97, (n,), generator=g).tolist()
        out.append((f"q{i}", prompt, names[i % len(names)], GREEDY))
    out.append(("repeat", list(out[2][1]), out[2][2], GREEDY))  # a prefix-cache hit on q2's blocks
    return out


def test_token_buckets() -> None:
    ns = (1, 64, 65, 384, 385, 448, 512, 513, 1025, 2000)
    assert [token_bucket(n, 2048) for n in ns] == [64, 64, 128, 384, 512, 512, 512, 640, 1280, 2048]
    assert token_bucket(0, 64) is None and token_bucket(161, 160) is None
    assert token_buckets(160) == [64, 128, 160]  # the configured maximum caps the last bucket


def test_mixed_steps_match_peft_and_eager(models: dict) -> None:
    requests = _requests(seed=8)
    eager = _drive(_llm(models, static=False).engine, requests)
    static_llm = _llm(models, static=True)
    e = static_llm.engine
    static = _drive(e, requests)
    runner = e.runner.static_steps
    assert runner is not None
    assert runner.mixed_replays >= 8  # steps with prefill chunks ran on the static buffers
    assert {k.shape.rows for k in runner._graphs if k.shape.mixed} >= {64, 128, 160}
    assert any(k.lora and k.lora.segments >= 16 for k in runner._graphs if k.shape.mixed)
    assert static["repeat"].num_cached_tokens > 0
    for rid, *_ in requests:
        a, b = eager[rid], static[rid]
        assert a.token_ids == b.token_ids, rid
        for lpa, lpb in zip(a.logprobs, b.logprobs, strict=True):
            assert lpa.keys() == lpb.keys()
            for t in lpa:
                assert lpa[t] == pytest.approx(lpb[t], abs=1e-5), (rid, t)
    peft = load_peft_mixture(models["hf"], models["adapters"])
    prompts, adapters = [p for _, p, _, _ in requests], [a for _, _, a, _ in requests]
    ref = mixed_batch_greedy(peft, prompts, adapters, GREEDY.max_tokens)
    for (rid, *_), r in zip(requests, ref, strict=True):
        assert static[rid].token_ids == r.tokens, rid


def test_prompt_logprob_steps_stay_eager(models: dict) -> None:
    e = _llm(models, static=True).engine
    runner = e.runner.static_steps
    assert runner is not None
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1, ignore_eos=True)
    e.add_request("p", list(range(5, 40)), params, "r16")
    e.step()
    assert runner.mixed_replays == 0 and e.last_stats is not None and not e.last_stats.static_replay
    e.add_request("plain", list(range(5, 40)), GREEDY, "r8")
    while e.has_unfinished():
        e.step()
    assert runner.mixed_replays >= 1
    assert len(e.output("p").prompt_logprobs) == 35


def test_warm_up_records_every_mixed_graph(models: dict) -> None:
    # After warm-up (CUDA: capture at startup; here the bookkeeping without capture), staggered
    # traffic of every adapter and prompt length meets no graph key it does not have.
    e = _llm(models, static=True).engine
    runner = e.runner.static_steps
    assert runner is not None
    added = runner.warm_up(max_rank=16)
    keys = set(runner._graphs)
    assert added == len(keys) and {k.shape.rows for k in keys if k.shape.mixed} == {64, 128, 160}
    assert runner.warm_up(max_rank=16) == 0
    more = [(f"b{rid}", *rest) for rid, *rest in _requests(seed=10)[:8]]
    _drive(e, _requests(seed=9) + more)
    assert set(runner._graphs) == keys and runner.mixed_replays > 0


def test_padding_rows_reach_no_real_row(models: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    # A captured mixed step's attention leaves its padding rows unwritten (on CUDA, whatever the
    # memory held). NaN there must stay there: every later op (norms, GEMMs, LoRA, the gather
    # before the head) keeps rows apart.
    from loraplex.layers import attention

    poisoned = 0

    def nan_padding(q, k, v, k_cache, v_cache, meta, scale, window):  # noqa: ANN001, ANN202
        nonlocal poisoned
        out = attention.paged_attention_torch(q, k, v, k_cache, v_cache, meta, scale, window)
        if meta.prefill_tiles is not None:  # a mixed shape: rows past the last sequence's are padding
            real = int(meta.query_start_t[-1])
            out[real:] = float("nan")
            poisoned += out.shape[0] - real
        return out

    backend = attention.AttentionBackend("torch, padding rows NaN", nan_padding)
    monkeypatch.setattr(attention, "make_attention_backend", lambda device_type: backend)
    requests = _requests(seed=11)
    eager = _drive(_llm(models, static=False).engine, requests)
    static = _drive(_llm(models, static=True).engine, requests)
    assert poisoned > 0
    for rid, *_ in requests:
        a, b = eager[rid], static[rid]
        assert a.token_ids == b.token_ids, rid
        for lpa, lpb in zip(a.logprobs, b.logprobs, strict=True):
            assert all(lpa[t] == pytest.approx(lpb[t], abs=1e-5) for t in lpa), rid

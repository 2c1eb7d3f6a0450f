"""Mixed batches (base rows + adapters of ranks 8/16/64 on different targets) against PEFT's
`adapter_names` mixed batch: prompt logprobs and 16 greedy decode steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.reference import assert_logprob_dicts_match, load_peft_mixture, mixed_batch_greedy
from helpers.tiny_models import build_hf_model, make_peft_adapter, save_hf_model

from loraplex import LLM, SamplingParams
from loraplex.engine.engine import Engine

STEPS = 16
TOP_N = 5
ATOL = 1e-4

ADAPTERS = {
    # name: (rank, targets, extra LoraConfig kwargs)
    "r8": (8, ["q_proj", "v_proj"], {}),
    "r16": (
        16,
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        {"use_rslora": True},
    ),
    "r64": (64, ["gate_proj", "down_proj", "k_proj"], {"rank_pattern": {"down_proj": 32}}),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("mixed")
    hf = build_hf_model("llama", seed=1)
    model_dir = save_hf_model(hf, root / "base")
    paths = {}
    for i, (name, (r, targets, kw)) in enumerate(ADAPTERS.items()):
        paths[name] = make_peft_adapter(hf, root / name, r=r, target_modules=targets, seed=100 + i, **kw)
    return {"hf": hf, "model_dir": model_dir, "paths": paths}


def _prompts() -> tuple[list[list[int]], list[str | None]]:
    g = torch.Generator().manual_seed(7)
    lengths = [1, 130, 9, 1, 40, 17, 5]
    adapters: list[str | None] = [None, "r8", "r16", "r64", None, "r8", "r16"]
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in lengths]
    return prompts, adapters


def test_mixed_batch_matches_peft(setup: dict) -> None:
    prompts, adapters = _prompts()
    ref_model = load_peft_mixture(setup["hf"], setup["paths"])
    ref = mixed_batch_greedy(ref_model, prompts, adapters, STEPS)

    llm = LLM(setup["model_dir"], dtype="float32", max_num_batched_tokens=4096)
    for name, path in setup["paths"].items():
        llm.register_adapter(name, path)
    params = SamplingParams(
        max_tokens=STEPS, temperature=0.0, logprobs=TOP_N, prompt_logprobs=TOP_N, ignore_eos=True
    )
    outs = llm.generate(prompts, params, adapters=adapters)
    for i, (out, r) in enumerate(zip(outs, ref, strict=True)):
        what = f"prompt {i} ({adapters[i] or 'base'})"
        assert out.token_ids == r.tokens, f"{what}: greedy tokens differ"
        assert out.prompt_logprobs[0] is None
        assert_logprob_dicts_match(out.prompt_logprobs[1:], r.prompt_logprobs, TOP_N, ATOL, what + " prompt")
        assert_logprob_dicts_match(out.logprobs, r.step_logprobs, TOP_N, ATOL, what + " decode")
        assert (out.adapter is None) == (adapters[i] is None)
        if adapters[i] is not None:
            assert out.adapter.name == adapters[i]


def test_each_adapter_alone_matches_peft(setup: dict) -> None:
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 97, (23,), generator=g).tolist()
    llm = LLM(setup["model_dir"], dtype="float32")
    params = SamplingParams(
        max_tokens=STEPS, temperature=0.0, logprobs=TOP_N, prompt_logprobs=TOP_N, ignore_eos=True
    )
    for name, path in setup["paths"].items():
        llm.register_adapter(name, path)
        ref = mixed_batch_greedy(load_peft_mixture(setup["hf"], {name: path}), [prompt], [name], STEPS)[0]
        out = llm.generate([prompt], params, adapters=[name])[0]
        assert out.token_ids == ref.tokens, name
        assert_logprob_dicts_match(out.prompt_logprobs[1:], ref.prompt_logprobs, TOP_N, ATOL, name)
        assert_logprob_dicts_match(out.logprobs, ref.step_logprobs, TOP_N, ATOL, name)


def test_step_statistics_show_real_mixed_batching(setup: dict) -> None:
    prompts, adapters = _prompts()
    engine = LLM(setup["model_dir"], dtype="float32", max_num_batched_tokens=4096, block_size=8).engine
    for name, path in setup["paths"].items():
        engine.register_adapter(name, path)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i, (p, a) in enumerate(zip(prompts, adapters, strict=True)):
        engine.add_request(f"r{i}", p, params, a)
    stats = []
    while engine.has_unfinished():
        engine.step()
        stats.append(engine.last_stats)
        running = engine.scheduler.running
        expected_blocks = sum(-(-s.num_computed // 8) for s in running)
        assert engine.pool.num_used == expected_blocks
        engine.check_integrity()
    first = stats[0]
    assert first.num_base_rows > 0 and first.num_lora_segments >= 3
    assert first.lora_op_calls > 0
    for s in stats[1:]:
        # every decode step passes exactly one new row per running sequence
        assert s.num_prefill_rows == 0
        assert all(n == 1 for n in s.rows_per_request.values())
    assert engine.pool.num_used == 0


def _run_engine(
    engine: Engine, prompts: list[list[int]], adapters: list[str | None], params: SamplingParams
) -> dict:
    for i, (p, a) in enumerate(zip(prompts, adapters, strict=True)):
        engine.add_request(f"q{i}", p, params, a)
    preempted = 0
    while engine.has_unfinished():
        engine.step()
        preempted += len(engine.last_stats.preempted) if engine.last_stats else 0
        engine.check_integrity()
    outs = {f"q{i}": engine.output(f"q{i}") for i in range(len(prompts))}
    return {"outs": outs, "preempted": preempted}


def test_small_pool_preempts_without_changing_outputs(setup: dict, tmp_path: Path) -> None:
    prompts, adapters = _prompts()
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, prompt_logprobs=2, ignore_eos=True)

    def engine(num_blocks: int | None) -> Engine:
        e = LLM(
            setup["model_dir"], block_size=4, num_kv_blocks=num_blocks, max_num_batched_tokens=4096
        ).engine
        for name, path in setup["paths"].items():
            e.register_adapter(name, path)
        return e

    roomy = _run_engine(engine(None), prompts, adapters, params)
    tight = _run_engine(engine(40), prompts, adapters, params)  # 160 slots for ~260 tokens of demand
    assert roomy["preempted"] == 0
    assert tight["preempted"] > 0
    for rid, out in roomy["outs"].items():
        other = tight["outs"][rid]
        assert other.token_ids == out.token_ids, rid
        for a, b in zip(out.logprobs, other.logprobs, strict=True):
            assert a.keys() == b.keys() and all(abs(a[k] - b[k]) <= 1e-5 for k in a), rid
        assert len(other.prompt_logprobs) == len(out.prompt_logprobs)


def test_chunked_prefill_equals_unchunked(setup: dict) -> None:
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(3, 97, (130,), generator=g).tolist()
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, prompt_logprobs=3, ignore_eos=True)
    whole = LLM(setup["model_dir"], max_num_batched_tokens=4096)
    chunked = LLM(setup["model_dir"], max_num_batched_tokens=16)
    for llm in (whole, chunked):
        llm.register_adapter("r16", setup["paths"]["r16"])
    a = whole.generate([prompt], params, adapters=["r16"])[0]
    b = chunked.generate([prompt], params, adapters=["r16"])[0]
    assert a.token_ids == b.token_ids
    for x, y in zip(a.prompt_logprobs[1:] + a.logprobs, b.prompt_logprobs[1:] + b.logprobs, strict=True):
        assert x.keys() == y.keys() and all(abs(x[k] - y[k]) <= 1e-5 for k in x)


def test_request_output_independent_of_batch(setup: dict) -> None:
    prompts, adapters = _prompts()
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=4, ignore_eos=True)
    llm = LLM(setup["model_dir"], max_num_batched_tokens=4096)
    for name, path in setup["paths"].items():
        llm.register_adapter(name, path)
    together = llm.generate(prompts, params, adapters=adapters)
    for i in (1, 3, 4):
        alone = llm.generate([prompts[i]], params, adapters=[adapters[i]])[0]
        assert alone.token_ids == together[i].token_ids
        for x, y in zip(alone.logprobs, together[i].logprobs, strict=True):
            assert x.keys() == y.keys() and all(abs(x[k] - y[k]) <= 1e-5 for k in x)

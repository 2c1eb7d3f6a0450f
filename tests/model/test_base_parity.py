"""Base-model parity with transformers for every supported architecture: hidden states after each
layer, prompt logprobs and greedy decoding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.reference import assert_logprob_dicts_match, mixed_batch_greedy
from helpers.tiny_models import ARCHS, build_hf_model, save_hf_model

from loraplex import LLM, SamplingParams
from loraplex.engine.sequence import Sequence

TOP_N = 5


@pytest.fixture(scope="module", params=ARCHS)
def arch_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    arch = request.param
    hf = build_hf_model(arch, seed=5)
    # Qwen2 goes through a sharded checkpoint with an index file.
    path = save_hf_model(hf, tmp_path_factory.mktemp(arch) / "model", shards=3 if arch == "qwen2" else 1)
    return arch, hf, path


def test_hidden_states_match_transformers(arch_model: tuple) -> None:
    arch, hf, path = arch_model
    llm = LLM(path)
    engine = llm.engine
    prompt = torch.randint(3, 97, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    engine.add_request("h", prompt, SamplingParams(max_tokens=1))
    plan = engine.scheduler.schedule()
    capture: dict[int, torch.Tensor] = {}
    engine.runner.run(plan, engine.slot_map(plan), hidden_capture=capture)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    assert len(capture) == len(ref)
    for i, ref_h in enumerate(ref):
        err = (capture[i] - ref_h[0]).abs().max().item()
        assert err < 1e-4, f"{arch}: hidden state {i} differs by {err}"


def test_logprobs_and_greedy_match_transformers(arch_model: tuple) -> None:
    arch, hf, path = arch_model
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (1, 70, 13)]
    ref = mixed_batch_greedy(hf, prompts, None, steps=16)
    llm = LLM(path)
    params = SamplingParams(
        max_tokens=16, temperature=0.0, logprobs=TOP_N, prompt_logprobs=TOP_N, ignore_eos=True
    )
    for out, r in zip(llm.generate(prompts, params), ref, strict=True):
        assert out.token_ids == r.tokens, arch
        assert_logprob_dicts_match(out.prompt_logprobs[1:], r.prompt_logprobs, TOP_N, 1e-4, f"{arch} prompt")
        assert_logprob_dicts_match(out.logprobs, r.step_logprobs, TOP_N, 1e-4, f"{arch} decode")


def test_prefill_then_decode_equals_token_by_token(arch_model: tuple) -> None:
    _, _, path = arch_model
    prompt = torch.randint(3, 97, (37,), generator=torch.Generator().manual_seed(4)).tolist()
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, prompt_logprobs=3, ignore_eos=True)
    whole = LLM(path).generate([prompt], params)[0]
    one_by_one = LLM(path, max_num_batched_tokens=1).generate([prompt], params)[0]
    assert whole.token_ids == one_by_one.token_ids
    pairs = zip(
        whole.prompt_logprobs[1:] + whole.logprobs,
        one_by_one.prompt_logprobs[1:] + one_by_one.logprobs,
        strict=True,
    )
    for a, b in pairs:
        assert a.keys() == b.keys() and all(abs(a[k] - b[k]) <= 1e-5 for k in a)


def test_rope_scaling_key_of_transformers_4(tmp_path: Path) -> None:
    """Old checkpoints carry `rope_scaling` + top-level `rope_theta` instead of `rope_parameters`."""
    hf = build_hf_model("llama", seed=9)
    path = save_hf_model(hf, tmp_path / "m")
    raw = json.loads((path / "config.json").read_text())
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params.pop("rope_theta")
    raw["rope_scaling"] = params
    (path / "config.json").write_text(json.dumps(raw))
    prompt = torch.randint(3, 97, (90,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = mixed_batch_greedy(hf, [prompt], None, steps=4)[0]
    out = LLM(path).generate(
        [prompt], SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2, ignore_eos=True)
    )[0]
    assert out.token_ids == ref.tokens
    assert_logprob_dicts_match(out.prompt_logprobs[1:], ref.prompt_logprobs, 2, 1e-4, "rope_scaling")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_float32(arch_model: tuple, dtype: str) -> None:
    arch, hf, path = arch_model
    prompt = torch.randint(3, 97, (20,), generator=torch.Generator().manual_seed(6)).tolist()
    ref = mixed_batch_greedy(hf, [prompt], None, steps=1)[0]
    out = LLM(path, dtype=dtype).generate(
        [prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    )[0]
    errs = [
        abs(d[k] - float(row[k]))
        for d, row in zip(out.prompt_logprobs[1:], ref.prompt_logprobs, strict=True)
        for k in d
    ]
    assert max(errs) < 0.15, f"{arch} {dtype}: max |dlogprob| {max(errs)}"


def test_unused_sequence_fields_default() -> None:
    seq = Sequence("x", [1, 2, 3], SamplingParams(), None, 0)
    assert seq.num_tokens == 3 and seq.token_at(2) == 3 and seq.num_uncomputed == 3

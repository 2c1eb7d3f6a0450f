"""Issue 19: on the GPU in bf16, a prefix-cache hit gives the greedy tokens of a miss wherever the
float32 reference's top-2 margin is at least 0.1 (and both give the reference's token there).

One engine (block size 16, a step budget of 24 tokens, so prefills run in chunks), a prompt of a
96-token system part (6 blocks) and a tail, under an adapter on all seven targets and on the base
model. Each miss runs under a cache salt nothing used before (no block is cached for it); its hit
runs under the salt whose blocks it should find:

- q = system + 40 tokens: miss, then hit on every full block but the last (8 tokens computed);
- r = system + 56 tokens: miss under its own salt, then a hit on q's salt, which finds only the
  system part cached and computes its 56-token tail in chunks of 24 (a chunked prefill continuing
  a cached prefix).

Decode steps replay CUDA graphs. The reference is transformers + PEFT in float32 on the CPU,
teacher-forced along the miss's tokens, so its margin at a step is the one of the context the
miss and the hit share there. Where the margin is under 0.1 bf16 may pick either token; if hit
and miss part there, they continue from different contexts and the comparison stops.

`LORAPLEX_GPU_TESTS_ON_CPU=1` also runs it on the CPU with a float32 engine (the test's own logic,
where hit and miss must agree everywhere).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers.engine_runs import run_to_end
from helpers.reference import BASE, load_peft_mixture, teacher_forced_logprobs
from helpers.tiny_models import build_hf_model, make_peft_adapter, save_hf_model

from loraplex import LLM, SamplingParams
from loraplex.types import RequestOutput

BS = 16
BUDGET = 24  # max_num_batched_tokens: chunks of at most 24 prefill rows
STEPS = 24
MARGIN = 0.1
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)

DEVICES = [
    pytest.param("cuda", marks=pytest.mark.gpu, id="cuda-bf16"),
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            os.environ.get("LORAPLEX_GPU_TESTS_ON_CPU") != "1",
            reason="GPU test; LORAPLEX_GPU_TESTS_ON_CPU=1 runs its logic on the CPU in float32",
        ),
        id="cpu-fp32",
    ),
]


def _tokens(n: int, g: torch.Generator) -> list[int]:
    return torch.randint(3, 97, (n,), generator=g).tolist()


def _agree(prompt: list[int], miss: RequestOutput, hit: RequestOutput, ref: torch.Tensor, what: str) -> int:
    """Assert hit == miss == the reference's argmax at every step whose reference margin is at
    least MARGIN, while hit and miss share their context; returns the steps checked."""
    checked = 0
    for step, (a, b) in enumerate(zip(miss.token_ids, hit.token_ids, strict=True)):
        top = torch.topk(ref[len(prompt) - 1 + step], 2)
        margin = float(top.values[0] - top.values[1])
        if margin >= MARGIN:
            want = int(top.indices[0])
            assert a == b == want, f"{what} step {step}: miss {a}, hit {b}, fp32 {want} (margin {margin:.3f})"
            checked += 1
        if a != b:
            break  # a near-tie: the two runs now continue from different contexts
    return checked


@pytest.mark.parametrize("device", DEVICES)
def test_prefix_hit_gives_the_greedy_tokens_of_a_miss(device: str, tmp_path: Path) -> None:
    hf = build_hf_model("llama", seed=31)
    model_dir = save_hf_model(hf, tmp_path / "base")
    adapter_dir = make_peft_adapter(hf, tmp_path / "a", r=16, target_modules=TARGETS, seed=77)
    dtype = "bfloat16" if device == "cuda" else "float32"
    llm = LLM(
        model_dir, dtype=dtype, device=device, block_size=BS, max_num_batched_tokens=BUDGET, max_num_seqs=8
    )
    e = llm.engine
    e.register_adapter("a", adapter_dir)
    g = torch.Generator().manual_seed(8)
    system = _tokens(96, g)
    q, r = system + _tokens(40, g), system + _tokens(56, g)

    runs: list[tuple[str, list[int], RequestOutput, RequestOutput, str]] = []
    for adapter in ("a", None):
        tag = adapter or "base"
        replays = e.graph_replays
        miss_q, miss_q_rows = run_to_end(e, f"{tag}-miss-q", q, GREEDY, adapter, salt=f"{tag}-q")
        hit_q, hit_q_rows = run_to_end(e, f"{tag}-hit-q", q, GREEDY, adapter, salt=f"{tag}-q")
        miss_r, miss_r_rows = run_to_end(e, f"{tag}-miss-r", r, GREEDY, adapter, salt=f"{tag}-r")
        hit_r, hit_r_rows = run_to_end(e, f"{tag}-hit-r", r, GREEDY, adapter, salt=f"{tag}-q")
        assert miss_q.num_cached_tokens == miss_r.num_cached_tokens == 0
        assert hit_q.num_cached_tokens == (len(q) - 1) // BS * BS > 0
        assert hit_r.num_cached_tokens == len(system)  # the system part only
        for miss_rows, hit, hit_rows in ((miss_q_rows, hit_q, hit_q_rows), (miss_r_rows, hit_r, hit_r_rows)):
            assert hit_rows == miss_rows - hit.num_cached_tokens  # the cached rows were not computed
        assert len(r) - hit_r.num_cached_tokens > BUDGET  # its tail took more than one chunk
        if device == "cuda":  # every decode step of the four runs replayed a graph, and so did
            # their prefill chunks (mixed-shape graphs, continuing a cached prefix or not)
            assert e.graph_replays - replays > 4 * (STEPS - 1)
            assert e.runner.static_steps.mixed_replays > 0
        runs += [(f"{tag} q", q, miss_q, hit_q, tag), (f"{tag} r", r, miss_r, hit_r, tag)]

    ref32 = load_peft_mixture(hf, {"a": adapter_dir})
    full = [prompt + miss.token_ids for _, prompt, miss, _, _ in runs]
    names = [BASE if tag == "base" else "a" for *_, tag in runs]
    refs = teacher_forced_logprobs(ref32, full, names, "cpu")
    checked = sum(
        _agree(prompt, miss, hit, ref, what)
        for (what, prompt, miss, hit, _), ref in zip(runs, refs, strict=True)
    )
    # not vacuous: a good share of the steps were compared (on this model about half the steps
    # along a path have a margin of 0.1 or more), not all skipped as near-ties
    assert checked >= len(runs) * STEPS // 4

"""The whole engine on CUDA in bf16 (Triton LoRA backend) against the same engine on the CPU in
float32: a mixed batch of base rows and three adapters, prefill and decode steps."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import build_hf_model, make_peft_adapter, save_hf_model

from loraplex import LLM, SamplingParams

pytestmark = pytest.mark.gpu

STEPS = 12
TOP_N = 2
MARGIN = 0.1  # float32 top-2 logprob gap above which bf16 must pick the same greedy token
LOGPROB_TOL = 0.1

# ranks up to 16, so decode steps take the split launch; prefill steps take the two-launch pair
ADAPTERS = {
    "r8": (8, ["q_proj", "v_proj", "down_proj"]),
    "r16": (16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "r16b": (16, ["k_proj", "o_proj", "gate_proj", "up_proj"]),
}


def _engines(tmp_path) -> tuple[LLM, LLM]:  # noqa: ANN001
    hf = build_hf_model("llama", seed=1)
    model_dir = save_hf_model(hf, tmp_path / "base")
    paths = {
        name: make_peft_adapter(hf, tmp_path / name, r=r, target_modules=targets, seed=200 + i)
        for i, (name, (r, targets)) in enumerate(ADAPTERS.items())
    }
    gpu = LLM(model_dir, dtype="bfloat16", device="cuda", max_num_batched_tokens=4096)
    cpu = LLM(model_dir, dtype="float32", device="cpu", max_num_batched_tokens=4096)
    for llm in (gpu, cpu):
        for name, path in paths.items():
            llm.register_adapter(name, path)
    return gpu, cpu


def _top2_margin(lp: dict[int, float]) -> float:
    vals = sorted(lp.values(), reverse=True)
    return vals[0] - vals[1] if len(vals) > 1 else float("inf")


def test_mixed_batch_bf16_cuda_matches_cpu_float32(tmp_path) -> None:  # noqa: ANN001
    gpu, cpu = _engines(tmp_path)
    g = torch.Generator().manual_seed(5)
    lengths = [1, 70, 9, 3, 33, 17, 5, 2]
    adapters = [None, "r8", "r16", "r16b", None, "r16", "r8", "r16b"]
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in lengths]
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, logprobs=TOP_N, ignore_eos=True)

    be = gpu.engine.lora_backend
    assert be.name == "triton"
    outs_gpu = gpu.generate(prompts, params, adapters=adapters)
    outs_cpu = cpu.generate(prompts, params, adapters=adapters)
    # every group of both layers ran through the kernels; every step replayed a CUDA graph (the
    # prefill step a mixed-shape one), whose capture recorded the split launch (calls are counted
    # when launched from Python, not replayed)
    assert set(be.calls) == {"qkv", "o", "gate_up", "down"}
    assert gpu.engine.graph_replays == STEPS and gpu.engine.runner.static_steps.mixed_replays == 1
    assert any(p is not None for p in be._plans.values())

    compared = 0
    for i, (a, b) in enumerate(zip(outs_gpu, outs_cpu, strict=True)):
        what = f"prompt {i} ({adapters[i] or 'base'})"
        assert len(a.token_ids) == len(b.token_ids) == STEPS, what
        for step, (ta, tb, lpa, lpb) in enumerate(
            zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs, strict=True)
        ):
            if _top2_margin(lpb) >= MARGIN:
                assert ta == tb, f"{what} step {step}: greedy token differs at a clear margin"
            if ta != tb:
                break  # the two runs now continue from different contexts
            assert abs(lpa[ta] - lpb[tb]) <= LOGPROB_TOL, (what, step, lpa[ta], lpb[tb])
            compared += 1
    assert compared >= len(prompts) * STEPS // 2  # most of the run was checked, not skipped

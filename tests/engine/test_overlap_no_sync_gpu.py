"""On CUDA, `Engine.step_overlapped` never waits for the whole stream: with the next step already
queued, a plain device-to-host copy (`.tolist()`, `.item()`) of the step in flight would wait for
that next step too, and the device would idle through every host-side part of a step. PyTorch's
sync debug mode turns each such wait into an error; the only wait left is the event that ends the
completed step's own copies to the host (`PendingSample`), which the mode does not count."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.tiny_models import build_hf_model, make_peft_adapter, save_hf_model

from loraplex import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def test_serving_steps_never_synchronize_the_stream(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    hf = build_hf_model("llama", seed=8)
    llm = LLM(
        save_hf_model(hf, tmp_path / "base"),
        dtype="bfloat16",
        device="cuda",
        max_num_batched_tokens=256,
        cuda_graph_max_batch=16,
        cuda_graph_max_tokens=128,  # a longer step with prefill runs eagerly: that path too
    )
    adapter = make_peft_adapter(
        hf, tmp_path / "a", r=8, target_modules=["q_proj", "v_proj", "down_proj"], seed=81
    )
    llm.register_adapter("a", adapter)
    e = llm.engine
    g = torch.Generator().manual_seed(3)
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.7, ignore_eos=True, stop_token_ids=[11]),
    ]
    for i in range(12):
        n = 200 if i == 5 else int(torch.randint(3, 60, (1,), generator=g))  # one eager prefill
        prompt = torch.randint(3, 97, (n,), generator=g).tolist()
        e.add_request(f"r{i}", prompt, params[i % len(params)], "a" if i % 3 else None)
    finished = set()
    calls = 0
    torch.cuda.set_sync_debug_mode("error")
    try:
        while e.has_unfinished() and calls < 500:
            finished |= {d.request_id for d in e.step_overlapped() if d.finished}
            calls += 1
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert finished == {f"r{i}" for i in range(12)}
    assert e.runner.static_steps is not None and e.runner.static_steps.mixed_replays > 0

"""An adapter load in flight never stops the step loop, and its slot is used only once the copy is done.

On the CPU the copy is completed by hand (tests/adapters/test_h2d_copy.py's copier writes NaN into
the reserved room until then); on CUDA a real side-stream copy is held back by a GPU sleep queued
before it. Either way a decoding request keeps stepping while the load is in flight, the cold
request runs only after the load has been committed, and every output equals the output of an
engine with every adapter resident.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers.tiny_models import build_hf_model, make_peft_adapter, save_hf_model

from loraplex import LLM, SamplingParams
from loraplex.adapters.h2d_copy import AsyncLoads, StreamCopier
from loraplex.engine.engine import Engine

SHORT = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
HOT, COLD = [5, 9, 14, 3, 22], [7, 8, 31, 2]


def _setup(tmp: Path, device: str, dtype: str) -> tuple[list[list[int]], LLM]:
    """The all-resident outputs of hot (alone) and cold (alone), and an engine whose device pool
    has room for two adapters of three: a0 and a1 resident, a2 in the host tier only."""
    hf = build_hf_model("llama", seed=3)
    model_dir = save_hf_model(hf, tmp / "base")
    paths = [make_peft_adapter(hf, tmp / f"a{i}", r=8, target_modules=TARGETS, seed=50 + i) for i in range(3)]
    ref = LLM(model_dir, device=device, dtype=dtype, adapter_device_bytes=1 << 26)
    for i, p in enumerate(paths):
        ref.register_adapter(f"a{i}", p)
    want = [ref.generate([HOT], LONG, ["a0"])[0].token_ids, ref.generate([COLD], SHORT, ["a2"])[0].token_ids]
    footprint = max(ref.engine.tiers.pool.allocated_of(r) for r in ref.engine.residency.resident_revisions())
    tiered = LLM(model_dir, device=device, dtype=dtype, adapter_device_bytes=2 * footprint)
    for i, p in enumerate(paths):
        tiered.register_adapter(f"a{i}", p)
    assert tiered.engine.residency.num_resident == 2
    return want, tiered


def _hot_while_cold_loads(e: Engine, release: Callable[[], None]) -> int:
    """Hot (a0, resident) decodes; "cold" (a2) arrives and its load evicts a1 and starts. Hot
    must decode to its end while the copy is in flight, and cold must not run before `release`
    lets the copy complete. Returns the steps taken while the copy was in flight."""
    copies = e.tiers.copies
    assert copies is not None
    e.add_request("hot", HOT, LONG, "a0")
    e.step()
    e.add_request("cold", COLD, SHORT, "a2")
    e.step()  # the step's poll places a2: a1 evicted, a2's room reserved, its copy queued
    assert len(copies) == 1, "a2's load did not start"
    steps = 0
    while not e.output("hot").finished:
        assert len(copies) == 1, "the copy completed before hot finished"
        assert not e.output("cold").token_ids, "cold ran before its copy completed"
        e.step()
        steps += 1
    release()
    while e.has_unfinished():
        e.step()
    return steps


def test_async_load_on_cpu_with_a_manual_copier(tmp_path: Path) -> None:
    from adapters.test_h2d_copy import ManualCopier

    want, tiered = _setup(tmp_path, "cpu", "float32")
    e = tiered.engine
    copier = ManualCopier()
    e.tiers.copies = AsyncLoads(e.residency, copier)
    steps = _hot_while_cold_loads(e, lambda: copier.events[0].complete())
    assert steps >= LONG.max_tokens - 2
    assert [e.output("hot").token_ids, e.output("cold").token_ids] == want
    assert e.tiers.stats()["loads"] == 1 and e.tiers.stats()["evictions"] == 1


def _calibrated_sleep(seconds: float) -> int:
    """GPU clock cycles that `torch.cuda._sleep` needs to last about `seconds`."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    torch.cuda._sleep(cycles)  # the first call pays one-time costs that would shorten the estimate
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles * seconds / (start.elapsed_time(end) / 1e3))


@pytest.mark.gpu
def test_async_load_on_cuda_keeps_decode_stepping(tmp_path: Path) -> None:
    """A real side-stream copy, held back 3 s by a GPU sleep queued before it on the side stream:
    the step stream (which syncs every step to read its tokens) is never blocked by it."""
    want, tiered = _setup(tmp_path, "cuda", "bfloat16")
    e = tiered.engine
    copies = e.tiers.copies
    assert isinstance(copies, AsyncLoads) and isinstance(copies.copier, StreamCopier)
    # warm up on the resident adapters: kernels compiled, decode graphs captured
    tiered.generate([HOT, COLD], LONG, ["a0", "a1"])
    tiered.generate([HOT], LONG, ["a0"])
    cycles = _calibrated_sleep(3.0)
    copies.copier.before_copy = lambda: torch.cuda._sleep(cycles)
    t0 = time.perf_counter()
    steps = _hot_while_cold_loads(e, lambda: None)
    assert steps >= LONG.max_tokens - 2
    # each request ran alone in its batch, as in the reference run: bf16 outputs match exactly
    assert [e.output("hot").token_ids, e.output("cold").token_ids] == want
    # the slot became usable only after the copy (behind the sleep) completed
    elapsed, latency = time.perf_counter() - t0, copies.latencies[-1][1]
    assert elapsed >= 1.5 and latency >= 1.5, f"run {elapsed:.2f} s, load latency {latency:.2f} s"
    rev = e.residency.resident_revisions()
    assert len(rev) == 2 and e.tiers.stats()["loads"] == 1

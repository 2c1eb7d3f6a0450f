"""A captured step (decode, or mixed: a prefill chunk beside decode rows) replays with the live
token -> adapter mapping and the live weights behind each slot: capture, then change the mapping
and the weights behind a slot, replay, and compare with the eager forward of the same step.

On CUDA this captures real graphs (bf16, Triton kernels); on the CPU the same test runs the
static-buffer path eagerly (`capture=False`), which checks the test's own logic and the buffers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.tiny_models import build_hf_model, make_peft_adapter, save_hf_model

from loraplex import LLM, SamplingParams
from loraplex.adapters.residency import StepSlots
from loraplex.lora.weights import AdapterWeights, LoRAPair

ADAPTERS = {
    "a": (16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "b": (8, ["q_proj", "v_proj", "down_proj"]),
    "c": (16, ["o_proj", "gate_proj", "up_proj"]),
}
DEVICES = [pytest.param("cpu", id="cpu-static-eager"), pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]


def _engine(tmp_path: Path, device: str):  # noqa: ANN202
    hf = build_hf_model("llama", seed=5)
    model_dir = save_hf_model(hf, tmp_path / "base")
    dtype = "bfloat16" if device == "cuda" else "float32"
    llm = LLM(model_dir, dtype=dtype, device=device, max_num_batched_tokens=4096)
    for i, (name, (r, targets)) in enumerate(ADAPTERS.items()):
        llm.register_adapter(
            name, make_peft_adapter(hf, tmp_path / name, r=r, target_modules=targets, seed=90 + i)
        )
    e = llm.engine
    if device == "cpu":
        e.runner.static_steps = e.static_step_runner(16, capture=False, max_tokens=4096)
    return e


def _both(engine, plan, slots) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """Logits of the same step, replayed and eager (each rewrites the same KV entries)."""
    static = engine.runner.static_steps
    assert static.shape_for(plan) is not None
    replayed = static.run(plan, slots).logits.clone()
    eager = engine.runner._run_eager(plan, slots, None).sample_logits
    return replayed, eager


def _close(a: torch.Tensor, b: torch.Tensor, device: str) -> bool:
    tol = 2e-2 if device == "cuda" else 1e-5
    return bool(((a - b).abs().max() / b.abs().max()) <= tol)


def _scaled(weights: AdapterWeights, factor: float) -> AdapterWeights:
    return AdapterWeights({k: LoRAPair(p.a, p.b * factor, p.scale) for k, p in weights.pairs.items()})


@pytest.mark.parametrize("device", DEVICES)
def test_replay_reads_live_mapping_and_weights(tmp_path: Path, device: str) -> None:
    e = _engine(tmp_path, device)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    names = ["a", "b", None, "c", "a", "b"]
    for i, name in enumerate(names):
        e.add_request(f"r{i}", [3 + i, 9, 27, 4 + i, 11], params, name)
    e.step()  # the prefill (eager)
    static = e.runner.static_steps

    plan = e.scheduler.schedule()
    slots = e.slot_map(plan)
    replayed, eager = _both(e, plan, slots)
    assert _close(replayed, eager, device)
    captures = static.captures
    e._postprocess(plan, e.runner._run_eager(plan, slots, None))

    # 1. a new token -> adapter mapping under the same graph key (same bucket, same number of
    #    segments, same rank tile): swap the adapters of rows 0 and 1, base row 2 takes row 3's
    plan = e.scheduler.schedule()
    live = e.slot_map(plan)
    s = list(live.slots)
    swapped = [s[1], s[0], s[3], s[2], *s[4:]]
    slots = StepSlots(swapped, live.generations)
    replayed, eager = _both(e, plan, slots)
    assert _close(replayed, eager, device)
    before = replayed

    # 2. other weights behind a slot (the device tables are updated in place, no recapture)
    slot_a = slots.slots[1]
    e.lora_table.set(slot_a, _scaled(e.lora_table.weights(slot_a), 40.0))
    replayed, eager = _both(e, plan, slots)
    assert _close(replayed, eager, device)
    row = 1  # now on adapter a's slot: its logits must have moved with the weights
    assert not _close(replayed[row : row + 1], before[row : row + 1], device)
    assert static.captures == captures  # every replay above reused the first step's graph
    if device == "cuda":
        assert captures >= 1 and static.replays >= 3


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_replay_reads_live_mapping(tmp_path: Path, device: str) -> None:
    e = _engine(tmp_path, device)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for i, name in enumerate(["a", "b", None, "c"]):
        e.add_request(f"r{i}", [3 + i, 9, 27, 4 + i, 11], params, name)
    e.step()  # their prefill
    # two prompts arrive: a step of their chunks (one of 40 rows on adapter a: three segments)
    # beside four decode rows
    e.add_request("long", list(range(5, 45)), params, "a")
    e.add_request("short", [7, 8, 9], params, "c")
    plan = e.scheduler.schedule()
    assert sorted(c.num_tokens for c in plan.chunks) == [1, 1, 1, 1, 3, 40]
    static = e.runner.static_steps
    assert static.shape_for(plan).mixed
    slots = e.slot_map(plan)
    replayed, eager = _both(e, plan, slots)
    assert replayed.shape[0] == 6 and _close(replayed, eager, device)
    captures = static.captures
    # other weights behind adapter a's slot (x2000: strong enough to move bf16 logits well past
    # the tolerance; x40 moved them 1%), then the same step with the two prompts' adapters
    # swapped: the same graph, the live values
    slot_a = slots.slots[0]
    e.lora_table.set(slot_a, _scaled(e.lora_table.weights(slot_a), 2000.0))
    replayed2, eager2 = _both(e, plan, slots)
    assert _close(replayed2, eager2, device) and not _close(replayed2[:1], replayed[:1], device)
    s = list(slots.slots)
    swapped = StepSlots([*s[:4], s[5], s[4]], slots.generations)
    replayed3, eager3 = _both(e, plan, swapped)
    assert _close(replayed3, eager3, device) and not _close(replayed3[4:], replayed2[4:], device)
    assert static.captures == captures

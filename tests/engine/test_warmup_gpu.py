"""After the engine's startup warm-up (`engine/warmup.py`), a randomized workload compiles no
Triton kernel and captures no CUDA graph: adapters of ranks up to max_rank (odd ones too) and
several target sets registered after startup, prompts of many lengths (prefill chunks of various
sizes, mixed steps), batches of varying size. The CPU twin of this check counts Triton's keys
(`tests/lora/test_warmup_keys.py`)."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.tiny_models import build_hf_model, make_peft_adapter, save_hf_model

from loraplex import LLM, SamplingParams, kernel_compiles

pytestmark = pytest.mark.gpu

TARGET_SETS = [
    ["q_proj", "v_proj"],
    ["o_proj"],
    ["gate_proj", "up_proj", "down_proj"],
    ["k_proj", "down_proj"],
    ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
]
RANKS = [4, 8, 12, 16, 24, 32, 40, 64]


def _room_for_two(hf: torch.nn.Module) -> int:
    """Device pool bytes for the two largest of the eight adapters (rank and targets as
    registered below), in bf16."""
    from loraplex.bench.capacity import adapter_bytes
    from loraplex.config import ModelConfig

    mc = ModelConfig.from_hf_dict(hf.config.to_dict())
    sizes = [
        adapter_bytes(mc, rank, [t.removesuffix("_proj") for t in TARGET_SETS[i % 5]], torch.bfloat16)[1]
        for i, rank in enumerate(RANKS)
    ]
    return sum(sorted(sizes)[-2:])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tiered", [False, True], ids=["all-resident", "room-for-two"])
def test_no_compile_or_capture_after_warmup(tmp_path, tiered: bool) -> None:  # noqa: ANN001
    """Tiered: the device pool holds the two largest of the eight adapters, so rounds load and evict
    adapters (side-stream copies, compaction, slot reuse) while others decode."""
    hf = build_hf_model("llama", seed=3)
    model_dir = save_hf_model(hf, tmp_path / "base")
    room = {"adapter_device_bytes": _room_for_two(hf)} if tiered else {}
    llm = LLM(
        model_dir, dtype="bfloat16", device="cuda", max_lora_rank=64, max_num_seqs=16,
        max_num_batched_tokens=512, cuda_graph_max_batch=16, max_model_len=1024, **room,
    )  # fmt: skip
    engine = llm.engine
    assert engine.warmup_s > 0
    compiles, captures = engine.kernel_compiles, engine.graph_captures
    assert captures > 0
    rng = random.Random(0)
    names = []
    for i, rank in enumerate(RANKS):  # registered after startup, as at runtime
        path = make_peft_adapter(hf, tmp_path / f"a{i}", r=rank, target_modules=TARGET_SETS[i % 5], seed=i)
        llm.register_adapter(f"a{i}", path)
        names.append(f"a{i}")
    for round_ in range(4):
        n = rng.randint(1, 16)
        prompts = [
            [rng.randint(3, 96) for _ in range(rng.choice([1, 3, 17, 40, 130, 300, 700]))] for _ in range(n)
        ]
        adapters = [rng.choice([None, *names]) for _ in range(n)]
        params = SamplingParams(max_tokens=rng.randint(2, 12), temperature=0.0, ignore_eos=True)
        llm.generate(prompts, params, adapters=adapters)
        assert engine.kernel_compiles == compiles, (round_, kernel_compiles.recent()[-8:])
        assert engine.graph_captures == captures, round_
    if tiered:
        stats = engine.tiers.stats()
        assert stats["evictions"] > 0 and stats["loads"] > 0, stats

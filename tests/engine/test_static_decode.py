"""Decode steps on the static (CUDA-graph) buffers, run eagerly on the CPU, against the plain
eager engine: padding up to a bucket, LoRA segments cut to one row tile and padded, the batch
shrinking as requests finish (other buckets, other mappings), steps too large for the graphs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.tiny_models import build_hf_model, make_peft_adapter, save_hf_model

from loraplex import LLM, SamplingParams
from loraplex.engine.cuda_graphs import batch_bucket
from loraplex.lora.graph_inputs import SEGMENT_ROWS

ADAPTERS = {
    "r8": (8, ["q_proj", "v_proj"]),
    "r16": (16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "r4": (4, ["gate_proj", "down_proj"]),
}


def _llms(tmp_path: Path, max_batch: int) -> tuple[LLM, LLM]:
    hf = build_hf_model("llama", seed=3)
    model_dir = save_hf_model(hf, tmp_path / "base")
    paths = {
        name: make_peft_adapter(hf, tmp_path / name, r=r, target_modules=t, seed=70 + i)
        for i, (name, (r, t)) in enumerate(ADAPTERS.items())
    }
    llms = (LLM(model_dir, max_num_batched_tokens=4096), LLM(model_dir, max_num_batched_tokens=4096))
    for llm in llms:
        for name, path in paths.items():
            llm.register_adapter(name, path)
    e = llms[1].engine
    e.runner.static_steps = e.static_step_runner(max_batch, capture=False)
    return llms


def _assert_same_outputs(eager: list, static: list, adapters: list[str | None]) -> None:
    """The same tokens, and logprobs within 1e-5, request by request."""
    for i, (a, b) in enumerate(zip(eager, static, strict=True)):
        assert a.token_ids == b.token_ids, f"request {i} ({adapters[i]})"
        for lpa, lpb in zip(a.logprobs, b.logprobs, strict=True):
            assert lpa.keys() == lpb.keys()
            for t in lpa:
                assert lpa[t] == pytest.approx(lpb[t], abs=1e-5), (i, t)


def test_batch_buckets() -> None:
    assert [batch_bucket(n, 256) for n in (1, 3, 5, 17, 33, 64, 65, 200, 256)] == [
        1, 4, 8, 24, 48, 64, 96, 224, 256,
    ]  # fmt: skip
    assert batch_bucket(0, 64) is None and batch_bucket(65, 64) is None
    assert batch_bucket(40, 40) == 40  # the configured maximum caps a bucket


def test_static_decode_matches_eager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from loraplex.lora.step import LoRAContext

    beside: list[bool] = []  # per LoRA op run beside its GEMM: whether the step was static
    original = LoRAContext._beside

    def spy(self, x, base, lora_op):  # noqa: ANN001, ANN202
        beside.append(self.meta.static is not None)
        return original(self, x, base, lora_op)

    monkeypatch.setattr(LoRAContext, "_beside", spy)
    eager, static = _llms(tmp_path, max_batch=24)
    g = torch.Generator().manual_seed(11)
    # 26 requests (more than the graphs' 24, so the first decode steps run eagerly), 18 rows of
    # one adapter (cut into two segments), every request a different length so the batch shrinks
    # one request at a time through several buckets and mappings.
    adapters = ["r16"] * (SEGMENT_ROWS + 2) + [None, "r8", "r4", None, "r8", "r4", None, "r8"]
    prompts = [torch.randint(3, 97, (int(n),), generator=g).tolist() for n in torch.randint(1, 40, (26,))]
    params = [
        SamplingParams(max_tokens=4 + i, temperature=0.0, logprobs=2, ignore_eos=True)
        for i in range(len(prompts))
    ]
    out_eager = eager.generate(prompts, params, adapters=adapters)
    out_static = static.generate(prompts, params, adapters=adapters)
    runner = static.engine.runner.static_steps
    assert runner is not None and runner.replays >= 20
    assert {k.shape.rows for k in runner._graphs} >= {24, 16, 8}  # several buckets were used
    assert any(k.lora and k.lora.segments >= 4 for k in runner._graphs)  # 4+ segments: the cut r16 rows
    _assert_same_outputs(out_eager, out_static, adapters)
    static.engine.check_integrity()
    # static steps ran o, gate_up and down beside their GEMMs (qkv in place); eager steps never
    assert beside and all(beside)


def test_static_steps_are_reported(tmp_path: Path) -> None:
    _, static = _llms(tmp_path, max_batch=8)
    e = static.engine
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for i, name in enumerate(["r8", None, "r16"]):
        e.add_request(f"q{i}", [5, 6, 7], params, name)
    kinds = []
    while e.has_unfinished():
        e.step()
        assert e.last_stats is not None
        kinds.append((e.last_stats.num_decode_rows, e.last_stats.static_replay))
    assert kinds[0] == (0, False)  # the prefill step runs eagerly
    assert all(replay for _, replay in kinds[1:]) and len(kinds) == 3
    assert e.last_stats.num_lora_segments == 2  # distinct adapters, not the cut/padded segments
    assert e.graph_replays == 0  # no CUDA graphs on the CPU: the metric counts only real replays


def test_graphs_of_a_bucket_share_one_logits_buffer(tmp_path: Path) -> None:
    # base-only and LoRA steps of one bucket (two graph keys) return views of one [B, V] buffer,
    # so graph memory does not grow by B * V * 4 bytes with every LoRA shape a bucket meets
    _, static = _llms(tmp_path, max_batch=8)
    e = static.engine
    runner = e.runner.static_steps
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    outputs = []  # all kept alive, so separate buffers could not share an address by reuse
    for i, name in enumerate([None, "r16", "r8"]):
        e.add_request(f"q{i}", [5, 6, 7 + i], params, name)
        e.step()  # the prefill
        plan = e.scheduler.schedule()
        slots = e.slot_map(plan)
        outputs.append(runner.run(plan, slots).logits)
        e._postprocess(plan, e.runner._run_eager(plan, slots, None))
    assert len(runner._graphs) >= 2 and len({k.shape.rows for k in runner._graphs}) == 1
    assert len({t.data_ptr() for t in outputs}) == 1


def test_warm_up_records_every_graph_a_decode_step_can_need(tmp_path: Path) -> None:
    # After warm-up (CUDA: capture at startup; here the same bookkeeping without capture), a
    # randomized decode workload - batch sizes through every bucket, adapters of every rank, one
    # to many segments - meets no graph key it does not have: no capture on the serving path.
    _, static = _llms(tmp_path, max_batch=24)
    e = static.engine
    runner = e.runner.static_steps
    assert runner is not None
    added = runner.warm_up(max_rank=16)
    keys = set(runner._graphs)
    assert added == len(keys) and {k.shape.rows for k in keys} == {1, 2, 4, 8, 16, 24}
    assert runner.warm_up(max_rank=16) == 0  # nothing left to add
    g = torch.Generator().manual_seed(5)
    names = [None, "r8", "r16", "r4"]
    for round_ in range(4):
        n = int(torch.randint(1, 25, (1,), generator=g))
        for i in range(n):
            name = names[int(torch.randint(0, 4, (1,), generator=g))]
            e.add_request(
                f"w{round_}-{i}", [3 + i, 8, 13], SamplingParams(max_tokens=3 + i % 5, temperature=0.0), name
            )
        while e.has_unfinished():
            e.step()
    assert runner.replays > 10 and set(runner._graphs) == keys


def test_static_block_tables_follow_preemption_and_prefix_hits(tmp_path: Path) -> None:
    """The static buffers write a block-table row only where it changed (`StaticInputs._rows`):
    a sequence that is preempted and readmitted, or admitted onto cached prefix blocks, gets a new
    block list, possibly as long as its old one, in a row that may be its own again. A KV pool
    too small for the batch forces preemptions; prompts sharing 32 tokens give prefix hits. Every
    output must equal the plain eager engine's, which writes no static table."""
    hf = build_hf_model("llama", seed=5)
    model_dir = save_hf_model(hf, tmp_path / "base")
    kw = dict(max_num_batched_tokens=64, block_size=4, num_kv_blocks=40, max_num_seqs=8)
    eager, static = LLM(model_dir, **kw), LLM(model_dir, **kw)
    e = static.engine
    e.runner.static_steps = e.static_step_runner(8, capture=False)
    preempt = e.scheduler._preempt
    preempted: list[str] = []

    def counting(seq):  # noqa: ANN001, ANN202
        preempted.append(seq.request_id)
        return preempt(seq)

    e.scheduler._preempt = counting
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 97, (32,), generator=g).tolist()
    prompts = [
        (shared if i % 2 else []) + torch.randint(3, 97, (int(n),), generator=g).tolist()
        for i, n in enumerate(torch.randint(2, 12, (14,)))
    ]
    params = [
        SamplingParams(max_tokens=18 + i % 5, temperature=0.0, logprobs=1, ignore_eos=True) for i in range(14)
    ]
    out_eager = eager.generate(prompts, params)
    out_static = static.generate(prompts, params)
    assert e.runner.static_steps is not None and e.runner.static_steps.replays >= 10
    assert preempted, "the pool was meant to force preemptions"
    assert e.prefix_cache is not None and e.prefix_cache.stats.hit_blocks > 0
    _assert_same_outputs(out_eager, out_static, [None] * len(prompts))
    e.check_integrity()

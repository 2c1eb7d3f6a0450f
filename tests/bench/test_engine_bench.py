from __future__ import annotations

import json

import pytest
import torch

from loraplex.bench.cli import main
from loraplex.bench.engine import EngineBenchArgs, run
from loraplex.bench.random_weights import random_adapter, random_model, tiny_hf_dict
from loraplex.config import EngineConfig, ModelConfig
from loraplex.engine.engine import Engine
from loraplex.types import SamplingParams


def test_engine_from_in_memory_model() -> None:
    mc = ModelConfig.from_hf_dict(tiny_hf_dict())
    model = random_model(mc, torch.bfloat16, torch.device("cpu"), seed=0)
    engine = Engine(EngineConfig(model_dir="<none>", dtype="bfloat16"), model=model)
    assert engine.model is model and engine.model_config is mc and engine.tokenizer is None
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("text", "hello", SamplingParams())
    engine.register_imported("a", random_adapter(mc, 4, 1, torch.bfloat16, torch.device("cpu")))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request("base", [5, 6, 7], params)
    engine.add_request("lora", [5, 6, 7], params, adapter="a")
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    for rid in ("base", "lora"):
        out = engine.output(rid)
        assert len(out.token_ids) == 3 and out.finish_reason == "length" and out.text == ""
    assert engine.lora_backend.total_calls > 0


def test_tiny_engine_bench_runs_both_modes(tmp_path) -> None:
    args = EngineBenchArgs.preset(True, device="cpu", batch=4, context=20, adapters=2, rank=4, steps=3)
    report = run(args, tmp_path, plot_png=False)
    assert report["base"]["lora_calls"] == 0
    assert report["lora"]["lora_calls"] > 0
    for mode in ("base", "lora"):
        assert len(report[mode]["step_ms_all"]) == 3 and report[mode]["step_ms"] > 0
        assert report[mode]["loop_step_ms"] > 0
    assert report["base_loop_step_ms"] == report["base"]["loop_step_ms"]  # one pair: its own value
    assert set(report["bytes"]) == {"weights", "kv_read", "lora"}
    assert report["bytes"]["lora"] > 0 and report["floor_ms"] > 0
    assert report["floor_meaningful"] is False
    assert report["lora_over_base"] == pytest.approx(report["lora_step_ms"] / report["base_step_ms"])
    saved = json.loads((tmp_path / "engine.json").read_text())
    for key in (
        "copy_bw_GBps",
        "floor_ms",
        "base_step_ms",
        "lora_step_ms",
        "base_over_floor",
        "lora_over_base",
    ):
        assert key in saved
    md = (tmp_path / "engine.md").read_text()
    assert "base-only step (ms)" in md and "LoRA / base" in md and "not meaningful on CPU" in md
    assert "base-only step, one ahead (ms)" in md


def test_engine_bench_cli_tiny(tmp_path, capsys) -> None:
    out = tmp_path / "engine"
    argv = ["bench", "engine", "--device", "cpu", "--tiny", "--batch", "2", "--context", "8"]
    assert main([*argv, "--adapters", "1", "--steps", "2", "--out", str(out)]) == 0
    assert "LoRA step (ms)" in capsys.readouterr().out
    assert {p.name for p in out.iterdir()} >= {"engine.json", "engine.md"}


def test_engine_bench_alternates_repeated_pairs() -> None:
    args = EngineBenchArgs.preset(True, layers=1, batch=2, context=8, adapters=2, steps=2, repeats=3)
    report = run(args, None, plot_png=False)
    pairs = report["pairs"]
    assert len(pairs) == 3 and all(p["base_ms"] > 0 and p["lora_ms"] > 0 for p in pairs)
    ratios = sorted(p["lora_ms"] / p["base_ms"] for p in pairs)
    assert report["lora_over_base"] == pytest.approx(ratios[1])  # the median pair's ratio
    assert report["lora_over_base_range"] == pytest.approx([ratios[0], ratios[2]])
    assert report["base_step_ms"] == pytest.approx(sorted(p["base_ms"] for p in pairs)[1])

"""The garbage-collection pacer (engine/gc_pacing.py): it collects the generation the interpreter's
next automatic pass would take, once the youngest generation's count reaches its share of the
threshold, and never when collection is off; `Engine.step_overlapped` runs it after each launch,
so a serving loop's collections happen there and not on an allocation before a launch."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.tiny_models import build_hf_model, save_hf_model

from loraplex import LLM, SamplingParams
from loraplex.engine.gc_pacing import GcPacer


@pytest.fixture
def collector() -> Iterator[None]:
    """The collector's settings restored after the test, whatever it set."""
    enabled, threshold = gc.isenabled(), gc.get_threshold()
    gc.collect()
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        (gc.enable if enabled else gc.disable)()


def _tracked(n: int) -> list[dict[int, int]]:
    return [{i: i} for i in range(n)]  # dicts are tracked: each counts toward generation 0


def test_collects_from_share_of_the_threshold_and_escalates_as_the_interpreter_does(collector: None) -> None:
    gc.set_threshold(1000, 2, 2)
    gc.collect()
    pacer = GcPacer(share=0.5)
    keep = _tracked(300)  # under half of 1000: nothing due
    assert pacer.due() is None
    pacer.after_launch()
    assert pacer.passes == [0, 0, 0]
    order = []
    for _ in range(16):
        keep += _tracked(600)  # kept alive, so the count does not fall back
        gen = pacer.due()
        order.append(gen)
        pacer.after_launch()
        assert gc.get_count()[0] < 50  # the pass reset the youngest count
    # generation 1 once 3 young passes (> threshold 2) piled up, generation 2 once 3 of those did
    assert order == [0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 2, 0, 0, 0]
    assert pacer.passes == [12, 3, 1] and pacer.seconds > 0
    assert len(keep) == 300 + 16 * 600


def test_does_nothing_while_collection_is_off(collector: None) -> None:
    pacer = GcPacer(share=0.01)
    gc.set_threshold(100)
    keep = _tracked(500)
    gc.disable()
    assert pacer.due() is None
    gc.enable()
    gc.set_threshold(0)  # the other way to turn automatic collection off
    assert pacer.due() is None
    pacer.after_launch()
    assert pacer.passes == [0, 0, 0] and len(keep) == 500
    with pytest.raises(ValueError, match="share"):
        GcPacer(share=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_hf_model(build_hf_model("llama", seed=4), tmp_path_factory.mktemp("gc") / "base")


def test_step_overlapped_paces_the_collections_of_a_serving_loop(model_dir: str, collector: None) -> None:
    """With the pacer collecting at every launch, the loop's collections are all the pacer's: none
    starts on an allocation elsewhere in the loop."""
    e = LLM(model_dir, max_num_batched_tokens=32, seed=1).engine
    e.gc_pacer = GcPacer(share=1e-9)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    in_pacer = [False]
    stray: list[int] = []
    pacer_collect = e.gc_pacer.after_launch

    def paced() -> None:
        assert e._in_flight, "the pacer ran with no step in flight"
        in_pacer[0] = True
        try:
            pacer_collect()
        finally:
            in_pacer[0] = False

    def watch(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and not in_pacer[0]:
            stray.append(info["generation"])

    e.gc_pacer.after_launch = paced  # type: ignore[method-assign]
    gc.collect()
    gc.callbacks.append(watch)
    try:
        for i in range(8):
            e.add_request(f"r{i}", torch.randint(3, 97, (20,), generator=g).tolist(), params, None)
        calls = 0
        while e.has_unfinished():
            e.step_overlapped()
            calls += 1
        e.step()
    finally:
        gc.callbacks.remove(watch)
    assert sum(e.gc_pacer.passes) >= calls - 2  # every launch with a step in flight collected
    assert stray == []
    assert all(len(e.output(f"r{i}").token_ids) == 12 for i in range(8))


def test_the_bench_watch_counts_passes_and_which_the_pacer_ran(collector: None) -> None:
    from loraplex.bench.gc_watch import GcWatch

    gc.set_threshold(100000)  # no automatic pass inside the watch
    pacer = GcPacer(share=1e-9)
    pacer.after_launch()  # before the watch: not counted
    with GcWatch(pacer) as watch:
        keep = _tracked(10)
        pacer.after_launch()
        gc.collect(1)  # a pass of the application's own
    after = GcWatch(pacer)
    gc.collect()  # after the watch: not counted
    summary = watch.summary()
    assert summary["passes"] == [1, 1, 0] and summary["paced"] == [1, 0, 0]
    assert summary["longest_s"] > 0 and after.summary()["passes"] == [0, 0, 0] and len(keep) == 10


def test_a_registered_adapters_weights_are_out_of_the_collectors_reach(tmp_path: Path) -> None:
    """After a registration no full pass walks the adapter's weights (their pair records, with
    their tensors, are frozen), and the adapter serves."""
    from helpers.tiny_models import make_peft_adapter

    from loraplex.lora.weights import LoRAPair

    hf = build_hf_model("llama", seed=5)
    base = save_hf_model(hf, tmp_path / "base")
    adapter = make_peft_adapter(hf, tmp_path / "a", r=4, target_modules=["q_proj", "down_proj"], seed=50)
    llm = LLM(base, seed=1)
    llm.register_adapter("a", adapter)
    assert not [o for o in gc.get_objects() if isinstance(o, LoRAPair)]
    out = llm.generate(
        [[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), adapters="a"
    )
    assert len(out[0].token_ids) == 3

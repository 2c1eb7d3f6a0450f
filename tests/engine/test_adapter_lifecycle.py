"""Adapters inside the engine: revisions, refusals that change nothing, zero adapters, absent work
costing nothing, and aborts releasing what a request held."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.tiny_models import build_hf_model, make_peft_adapter, save_hf_model
from safetensors.torch import load_file, save_file

from loraplex import LLM, AdapterRef, SamplingParams
from loraplex.adapters.registry import UnknownAdapterError

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("lifecycle")
    hf = build_hf_model("qwen2", seed=3)
    model_dir = save_hf_model(hf, root / "base")
    good = make_peft_adapter(hf, root / "good", r=8, target_modules=["q_proj", "v_proj"], seed=1)
    other = make_peft_adapter(hf, root / "other", r=8, target_modules=["q_proj", "v_proj"], seed=2)
    late = make_peft_adapter(
        hf, root / "late", r=4, target_modules=["down_proj"], seed=3, layers_to_transform=[1]
    )
    big = make_peft_adapter(hf, root / "big", r=32, target_modules=["o_proj"], seed=4)
    return {
        "hf": hf,
        "root": root,
        "model_dir": model_dir,
        "good": good,
        "other": other,
        "late": late,
        "big": big,
    }


PROMPT = [5, 17, 33, 8, 41, 60, 2, 19, 77]


def _bad_adapters(env: dict, root: Path) -> dict[str, tuple[Path, str]]:
    """name -> (adapter dir, words the refusal must contain)."""
    out: dict[str, tuple[Path, str]] = {}

    def variant(name: str, edit_config=None, edit_files=None) -> Path:  # noqa: ANN001
        path = root / name
        shutil.copytree(env["good"], path)
        if edit_config is not None:
            cfg = json.loads((path / "adapter_config.json").read_text())
            edit_config(cfg)
            (path / "adapter_config.json").write_text(json.dumps(cfg))
        if edit_files is not None:
            edit_files(path)
        return path

    out["dora"] = (variant("dora", lambda c: c.update(use_dora=True)), "DoRA")
    out["saves"] = (variant("saves", lambda c: c.update(modules_to_save=["lm_head"])), "modules_to_save")
    out["bias"] = (variant("bias", lambda c: c.update(bias="all")), "bias")
    out["ia3"] = (variant("ia3", lambda c: c.update(peft_type="IA3")), "IA3")
    out["nomatch"] = (variant("nomatch", lambda c: c.update(target_modules=["c_attn"])), "c_attn")
    out["embed"] = (variant("embed", lambda c: c.update(target_modules=["embed_tokens"])), "embed_tokens")

    def to_pickle(path: Path) -> None:
        (path / "adapter_model.safetensors").unlink()
        (path / "adapter_model.bin").write_bytes(b"not really a pickle")

    out["pickle"] = (variant("pickle", edit_files=to_pickle), "pickle")

    def bad_shape(path: Path) -> None:
        tensors = load_file(str(path / "adapter_model.safetensors"))
        key = next(k for k in tensors if "lora_B" in k)
        tensors[key] = torch.randn(tensors[key].shape[0] + 1, tensors[key].shape[1])
        save_file(tensors, str(path / "adapter_model.safetensors"))

    out["shape"] = (variant("shape", edit_files=bad_shape), "shape")
    out["rank"] = (env["big"], "rank")
    return out


def test_refused_adapters_change_nothing(env: dict, tmp_path: Path) -> None:
    llm = LLM(env["model_dir"], max_lora_rank=16)
    ref = llm.register_adapter("good", env["good"])
    before = llm.generate([PROMPT], GREEDY, adapters=["good"])[0]
    for name, (path, words) in _bad_adapters(env, tmp_path).items():
        with pytest.raises(ValueError, match=words):
            llm.register_adapter(name, path)
        with pytest.raises(ValueError, match="unknown adapter"):
            llm.generate([PROMPT], GREEDY, adapters=[name])
        # A refused re-registration under an existing name keeps the old revision serving.
        with pytest.raises(ValueError):
            llm.register_adapter("good", path)
        assert llm.engine.adapters.latest("good") == ref
    after = llm.generate([PROMPT], GREEDY, adapters=["good"])[0]
    assert after.token_ids == before.token_ids and after.logprobs == before.logprobs
    assert len(llm.engine.adapters.list()) == 1


def test_revisions_are_immutable_and_addressable(env: dict, tmp_path: Path) -> None:
    llm = LLM(env["model_dir"])
    v1 = llm.register_adapter("tenant", env["good"])
    assert isinstance(v1, AdapterRef) and len(v1.revision) == 64
    copy = tmp_path / "copy"
    shutil.copytree(env["good"], copy)
    assert llm.register_adapter("tenant", copy) == v1  # identical content: same revision
    v2 = llm.register_adapter("tenant", env["other"])
    assert v2.revision != v1.revision and v2.name == "tenant"
    old = llm.generate([PROMPT], GREEDY, adapters=[f"tenant@{v1.revision}"])[0]
    new = llm.generate([PROMPT], GREEDY, adapters=["tenant"])[0]
    assert old.adapter == v1 and new.adapter == v2
    assert old.logprobs != new.logprobs
    direct_v1 = LLM(env["model_dir"])
    direct_v1.register_adapter("x", env["good"])
    assert direct_v1.generate([PROMPT], GREEDY, adapters=["x"])[0].logprobs == old.logprobs
    for bad in ("", "-lead", "a/b", "../etc", "a b", "name\n"):
        with pytest.raises(ValueError, match="invalid adapter name"):
            llm.register_adapter(bad, env["good"])


def test_zero_adapter_gives_exactly_base_output(env: dict, tmp_path: Path) -> None:
    zero = tmp_path / "zero"
    shutil.copytree(env["good"], zero)
    tensors = load_file(str(zero / "adapter_model.safetensors"))
    save_file({k: torch.zeros_like(v) for k, v in tensors.items()}, str(zero / "adapter_model.safetensors"))
    llm = LLM(env["model_dir"])
    llm.register_adapter("zero", zero)
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5, prompt_logprobs=5, ignore_eos=True)
    base, with_zero = llm.generate([PROMPT, PROMPT], params, adapters=[None, "zero"])
    assert with_zero.token_ids == base.token_ids
    assert with_zero.logprobs == base.logprobs and with_zero.prompt_logprobs == base.prompt_logprobs


def test_absent_lora_work_costs_nothing(env: dict) -> None:
    llm = LLM(env["model_dir"])
    llm.register_adapter("qv", env["good"])
    llm.register_adapter("late", env["late"])
    backend = llm.engine.lora_backend
    llm.generate([PROMPT, PROMPT[:3]], GREEDY)
    assert backend.total_calls == 0, "a base-only batch ran the LoRA op"

    steps = _count_steps(llm, [PROMPT], ["qv"])
    n_layers = llm.engine.model_config.num_hidden_layers
    assert dict(backend.calls) == {"qkv": steps * n_layers}, "slices no adapter targets ran the LoRA op"

    backend.calls.clear()
    steps = _count_steps(llm, [PROMPT], ["late"])
    assert dict(backend.calls) == {"down": steps}, "layers_to_transform=[1] must touch layer 1 only"


def _count_steps(llm: LLM, prompts: list, adapters: list) -> int:
    engine = llm.engine
    for i, (p, a) in enumerate(zip(prompts, adapters, strict=True)):
        engine.add_request(f"count-{a}-{i}", p, GREEDY, a)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return steps


def test_abort_frees_blocks_and_adapter_hold(env: dict) -> None:
    llm = LLM(env["model_dir"], block_size=4)
    ref = llm.register_adapter("good", env["good"])
    engine = llm.engine
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=50, ignore_eos=True), "good")
    engine.add_request("b", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True), None)
    engine.step()
    engine.step()
    engine.check_integrity()
    assert engine.adapters.holds(ref) == 1 and engine.pool.num_used > 0
    assert engine.abort("a")
    engine.check_integrity()
    assert engine.adapters.holds(ref) == 0
    assert engine.output("a").finish_reason == "abort"
    while engine.has_unfinished():
        engine.step()
    assert engine.output("b").finished and len(engine.output("b").token_ids) == 3
    assert engine.pool.num_used == 0
    engine.pool.check_integrity()
    assert not engine.abort("a")  # already finished


def test_bad_requests_queue_nothing(env: dict) -> None:
    llm = LLM(env["model_dir"], max_model_len=64)
    llm.register_adapter("good", env["good"])
    engine = llm.engine
    with pytest.raises(ValueError, match="unknown adapter"):
        llm.generate([PROMPT, PROMPT], GREEDY, adapters=["good", "missing"])
    with pytest.raises(ValueError, match="context length"):
        llm.generate([list(range(3, 70))], GREEDY)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[5, 1000]], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="revision"):
        llm.generate([PROMPT], GREEDY, adapters=["good@0123456789abcdef"])
    assert not engine.has_unfinished()
    assert engine.adapters.holds(engine.adapters.latest("good")) == 0
    assert llm.generate([PROMPT], GREEDY, adapters=["good"])[0].finished


def test_empty_revision_is_refused(env: dict) -> None:
    llm = LLM(env["model_dir"])
    ref = llm.register_adapter("good", env["good"])
    engine = llm.engine
    for spec in ("good@", AdapterRef("good", "")):
        with pytest.raises(UnknownAdapterError, match="the revision after '@' is empty"):
            engine.adapters.resolve(spec)
    with pytest.raises(ValueError, match="the revision after '@' is empty"):
        llm.generate([PROMPT], GREEDY, adapters=["good@"])
    assert not engine.has_unfinished()
    assert engine.adapters.holds(ref) == 0
    engine.check_integrity()
    assert engine.adapters.resolve("good").ref == ref
    assert engine.adapters.resolve(f"good@{ref.revision[:8]}").ref == ref


def test_two_revisions_of_one_name_in_one_batch(env: dict) -> None:
    llm = LLM(env["model_dir"])
    v1 = llm.register_adapter("tenant", env["good"])
    v2 = llm.register_adapter("tenant", env["other"])
    alone_v1 = llm.generate([PROMPT], GREEDY, adapters=[f"tenant@{v1.revision[:12]}"])[0]
    alone_v2 = llm.generate([PROMPT], GREEDY, adapters=["tenant"])[0]
    mixed = llm.generate([PROMPT, PROMPT, PROMPT], GREEDY, adapters=[f"tenant@{v1.revision}", "tenant", None])
    assert llm.engine.last_stats.num_lora_segments == 2
    assert mixed[0].adapter == v1 and mixed[1].adapter == v2 and mixed[2].adapter is None
    assert mixed[0].token_ids == alone_v1.token_ids and mixed[1].token_ids == alone_v2.token_ids
    for a, b in ((mixed[0], alone_v1), (mixed[1], alone_v2)):
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.keys() == y.keys() and all(abs(x[k] - y[k]) <= 1e-5 for k in x)


def test_new_revision_does_not_touch_requests_in_flight(env: dict) -> None:
    expected = LLM(env["model_dir"])
    expected.register_adapter("tenant", env["good"])
    want = expected.generate([PROMPT], GREEDY, adapters=["tenant"])[0]

    llm = LLM(env["model_dir"])
    v1 = llm.register_adapter("tenant", env["good"])
    engine = llm.engine
    engine.add_request("inflight", PROMPT, GREEDY, "tenant")
    engine.step()
    engine.step()
    v2 = llm.register_adapter("tenant", env["other"])  # the name now means v2
    engine.add_request("after", PROMPT, GREEDY, "tenant")
    while engine.has_unfinished():
        engine.step()
    got = engine.output("inflight")
    assert got.adapter == v1 and got.token_ids == want.token_ids
    for x, y in zip(got.logprobs, want.logprobs, strict=True):  # batch neighbours differ: 1e-5
        assert x.keys() == y.keys() and all(abs(x[k] - y[k]) <= 1e-5 for k in x)
    assert engine.output("after").adapter == v2


def test_identical_content_under_two_names_shares_one_slot(env: dict) -> None:
    llm = LLM(env["model_dir"])
    a = llm.register_adapter("alpha", env["good"])
    b = llm.register_adapter("beta", env["good"])
    assert a.revision == b.revision and a.name != b.name
    assert len(llm.engine.lora_table) == 1
    out_a, out_b = llm.generate([PROMPT, PROMPT], GREEDY, adapters=["alpha", "beta"])
    assert out_a.adapter == a and out_b.adapter == b
    assert out_a.token_ids == out_b.token_ids


def test_slot_map_is_kept_for_a_steady_batch_and_rebuilt_when_slots_change(env: dict) -> None:
    llm = LLM(env["model_dir"])
    llm.register_adapter("good", env["good"])
    engine = llm.engine
    for i, name in enumerate(["good", None, "good"]):
        engine.add_request(f"s{i}", PROMPT, GREEDY, name)
    engine.step()  # prefill: a new plan
    plan = engine.scheduler.schedule()  # a steady decode plan, twice
    first = engine.slot_map(plan)
    engine.residency.end_step()
    assert engine.slot_map(plan) is first and engine.residency.pinned == {first.slots[0]}
    engine.residency.end_step()
    llm.register_adapter("late", env["late"])  # a new slot: the map is rebuilt
    rebuilt = engine.slot_map(plan)
    assert rebuilt is not first and rebuilt == first  # the same slots, built again
    engine.residency.end_step()

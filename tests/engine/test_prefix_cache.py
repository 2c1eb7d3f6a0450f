"""The prefix cache in the engine (float32 on the CPU): blocks are shared only between requests on the
same base and adapter revisions, tenant (private adapters) and salt; a hit skips the cached rows
and returns what a miss returns; cancellation, preemption and retirement leave the accounting
exact (`Engine.check_integrity` after every step)."""

from __future__ import annotations

import pytest
import torch
from helpers.engine_runs import run_to_end
from helpers.tiny_models import build_hf_model, make_peft_adapter, save_hf_model

from loraplex import LLM, SamplingParams
from loraplex.adapters.peft_import import import_peft_adapter
from loraplex.engine.engine import Engine
from loraplex.types import AdapterRef, RequestOutput

BS = 4  # block size: a 23-token prompt has 5 full blocks a hit may cover (the last token is computed)
ATOL = 1e-5
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=4, ignore_eos=True)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


P = _prompt(23, 1)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("prefix")
    hf = build_hf_model("llama", seed=11)
    model_dir = save_hf_model(hf, root / "base")
    paths = {
        name: make_peft_adapter(hf, root / name, r=8, target_modules=TARGETS, seed=300 + i)
        for i, name in enumerate(("a", "b", "a2", "c"))
    }
    return {"model_dir": model_dir, "paths": paths, "cold": {}}


def _llm(env: dict, cache: bool = True, **kw) -> LLM:  # noqa: ANN003
    kw.setdefault("block_size", BS)
    return LLM(env["model_dir"], dtype="float32", seed=1, enable_prefix_caching=cache, **kw)


def _cold(
    env: dict, adapter: str | None, prompt: list[int], params: SamplingParams = GREEDY
) -> RequestOutput:
    """The request alone on an engine without a prefix cache, with `adapter` ("a", "b", "a2" or
    None) registered under its own name; memoized across the module."""
    key = (adapter, tuple(prompt), params)
    if key not in env["cold"]:
        llm = _llm(env, cache=False)
        if adapter is not None:
            llm.register_adapter(adapter, env["paths"][adapter])
        env["cold"][key] = llm.generate([prompt], params, adapter)[0]
    return env["cold"][key]


def _run(
    e: Engine,
    rid: str,
    prompt: list[int],
    adapter: str | AdapterRef | None = None,
    salt: str | None = None,
    params: SamplingParams = GREEDY,
) -> tuple[RequestOutput, int]:
    """Run one request to its end (helpers/engine_runs.py), GREEDY unless told."""
    return run_to_end(e, rid, prompt, params, adapter, salt)


def _same(ours: RequestOutput, want: RequestOutput) -> None:
    """Identical tokens; logprob dicts with the same keys and values within ATOL."""
    assert ours.token_ids == want.token_ids
    assert ours.logprobs is not None and want.logprobs is not None
    for got, ref in zip(ours.logprobs, want.logprobs, strict=True):
        assert got.keys() == ref.keys()
        assert max(abs(got[t] - ref[t]) for t in got) <= ATOL


def _rows_of_a_miss(prompt: list[int], params: SamplingParams = GREEDY) -> int:
    return len(prompt) + params.max_tokens - 1


def test_a_hit_skips_the_cached_rows_and_returns_the_miss_outputs(env: dict) -> None:
    e = _llm(env).engine
    e.register_adapter("a", env["paths"]["a"])
    for adapter in (None, "a"):
        miss, miss_rows = _run(e, f"miss-{adapter}", P, adapter)
        assert miss.num_cached_tokens == 0 and miss_rows == _rows_of_a_miss(P)
        hit, hit_rows = _run(e, f"hit-{adapter}", P, adapter)
        cached = (len(P) - 1) // BS * BS
        assert hit.num_cached_tokens == cached == 20
        assert hit_rows == miss_rows - cached  # the cached rows were not computed
        _same(hit, miss)
        _same(hit, _cold(env, adapter, P))
    stats = e.prefix_cache.stats if e.prefix_cache is not None else None
    assert stats is not None and stats.hit_tokens == 40 and stats.query_tokens == 4 * len(P)
    assert stats.hit_blocks == 10 and stats.query_blocks == 20 and stats.block_hit_rate == 0.5


def test_a_shared_prefix_and_generated_tokens_are_reused(env: dict) -> None:
    """A prompt sharing 3 blocks hits 3; a prompt made of an earlier prompt and its output hits
    the blocks its tokens filled while decoding, too."""
    e = _llm(env).engine
    first, _ = _run(e, "first", P)
    other = P[:12] + _prompt(9, 2)
    out, _ = _run(e, "other", other)
    assert out.num_cached_tokens == 12
    _same(out, _cold(env, None, other))
    longer = P + first.token_ids[:5]  # 28 tokens, 7 full blocks, the last filled by decoding
    out, rows = _run(e, "longer", longer)
    assert out.num_cached_tokens == 24 and rows == _rows_of_a_miss(longer) - 24
    _same(out, _cold(env, None, longer))


def test_a_hit_on_blocks_a_running_request_holds(env: dict) -> None:
    """Request y arrives while x still decodes: it shares x's prefix blocks (held twice), and both
    outputs equal their cold runs; chunked prefill continues after the hit."""
    e = _llm(env, max_num_batched_tokens=8).engine
    long = SamplingParams(max_tokens=12, temperature=0.0, logprobs=4, ignore_eos=True)
    e.add_request("x", P, long)
    while len(e.output("x").token_ids) < 2:
        e.step()
        e.check_integrity()
    y_prompt = P[:16] + _prompt(10, 3)
    e.add_request("y", y_prompt, GREEDY)
    e.step()
    assert e.sequence("y").num_cached_tokens == 16
    shared = e.sequence("y").block_ids[:4]
    assert shared == e.sequence("x").block_ids[:4] and all(e.pool.ref_count(b) == 2 for b in shared)
    while e.has_unfinished():
        e.step()
        e.check_integrity()
    _same(e.output("x"), _cold(env, None, P, long))
    _same(e.output("y"), _cold(env, None, y_prompt))


def test_revisions_never_share_blocks(env: dict) -> None:
    """One prompt under adapter a, adapter b, the base, and a' (a new revision under a's name):
    no request hits another revision's blocks, and each output equals a cold run of its own
    revision; a pinned old revision still hits its own."""
    e = _llm(env).engine
    ref_a = e.register_adapter("a", env["paths"]["a"])
    e.register_adapter("b", env["paths"]["b"])
    outs = {}
    for adapter in ("a", "b", None):
        outs[adapter], _ = _run(e, f"r-{adapter}", P, adapter)
        assert outs[adapter].num_cached_tokens == 0
    ref_a2 = e.register_adapter("a", env["paths"]["a2"])  # a's latest is now a'
    assert ref_a2.revision != ref_a.revision
    out_a2, _ = _run(e, "r-a2", P, "a")
    assert out_a2.adapter == ref_a2 and out_a2.num_cached_tokens == 0
    for adapter, cold in (("a", "a"), ("b", "b"), (None, None)):
        _same(outs[adapter], _cold(env, cold, P))
    _same(out_a2, _cold(env, "a2", P))
    assert outs["a"].token_ids != out_a2.token_ids  # the revisions really differ
    again, _ = _run(e, "pinned", P, ref_a)
    assert again.num_cached_tokens == 20
    _same(again, outs["a"])


def test_repointing_an_alias_never_yields_a_stale_hit(env: dict) -> None:
    e = _llm(env).engine
    ref_a = e.register_adapter("a", env["paths"]["a"])
    ref_b = e.register_adapter("b", env["paths"]["b"])
    e.adapters.set_alias("prod", ref_a)
    first, _ = _run(e, "1", P, "prod")
    e.adapters.set_alias("prod", ref_b)
    second, _ = _run(e, "2", P, "prod")
    assert second.adapter == ref_b and second.num_cached_tokens == 0
    _same(second, _cold(env, "b", P))
    third, _ = _run(e, "3", P, "prod")  # b's own blocks now
    assert third.num_cached_tokens == 20
    _same(third, second)
    _same(first, _cold(env, "a", P))


def test_retiring_a_revision_drops_its_cached_blocks(env: dict) -> None:
    e = _llm(env).engine
    ref_a = e.register_adapter("a", env["paths"]["a"])
    ref_b = e.register_adapter("b", env["paths"]["b"])
    _run(e, "a", P, "a")
    _run(e, "b", P, "b")
    assert e.pool.tags() == {ref_a.revision, ref_b.revision}
    cached = e.pool.num_cached
    e.retire_adapter(ref_a)  # no request holds it: drained now
    assert e.pool.tags() == {ref_b.revision} and e.pool.num_cached == cached // 2
    e.check_integrity()
    # Retired while a request runs on it: the request finishes on it, and its blocks (including
    # the ones it committed after the retirement) go when it ends.
    long = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    e.add_request("late", P, long, "b")
    e.step()
    e.retire_adapter(ref_b)
    assert ref_b.revision in e.pool.tags()
    while e.has_unfinished():
        e.step()
        e.check_integrity()
    assert e.output("late").finish_reason == "length"
    assert e.pool.tags() == set() and e.pool.num_cached == 0 and e.pool.num_free == e.pool.num_blocks


def test_salt_and_private_tenants_separate_the_cache(env: dict) -> None:
    e = _llm(env).engine
    assert _run(e, "s1", P, salt="x")[0].num_cached_tokens == 0
    assert _run(e, "s2", P, salt="y")[0].num_cached_tokens == 0  # another salt: no hit
    assert _run(e, "s3", P)[0].num_cached_tokens == 0  # no salt is not any salt
    out, _ = _run(e, "s4", P, salt="x")
    assert out.num_cached_tokens == 20
    _same(out, _cold(env, None, P))
    # One content registered privately by two tenants is one revision; each tenant's prompts
    # stay its own. Shared under two names, it is one revision and one cache.
    imported = import_peft_adapter(env["paths"]["c"], e.model_config, 64, e.base)
    t1 = e.register_imported("t1-c", imported, tenant="t1", visibility="private")
    t2 = e.register_imported("t2-c", imported, tenant="t2", visibility="private")
    assert t1.revision == t2.revision
    assert _run(e, "t1", P, "t1-c")[0].num_cached_tokens == 0
    assert _run(e, "t2", P, "t2-c")[0].num_cached_tokens == 0
    assert _run(e, "t1-again", P, "t1-c")[0].num_cached_tokens == 20
    e.register_imported("s1-c", imported)
    e.register_imported("s2-c", imported)
    assert _run(e, "s1-c", P, "s1-c")[0].num_cached_tokens == 0
    assert _run(e, "s2-c", P, "s2-c")[0].num_cached_tokens == 20


def test_prompt_logprobs_requests_write_but_do_not_read(env: dict) -> None:
    e = _llm(env).engine
    echo = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2, ignore_eos=True)
    _run(e, "warm", P)
    out, rows = _run(e, "echo", P, params=echo)
    assert out.num_cached_tokens == 0 and rows == _rows_of_a_miss(P, echo)
    assert out.prompt_logprobs is not None and all(lp for lp in out.prompt_logprobs[1:])
    q = _prompt(19, 4)
    _run(e, "echo-first", q, params=echo)
    assert _run(e, "after-echo", q)[0].num_cached_tokens == 16  # the echo request wrote


def test_the_cache_can_be_turned_off(env: dict) -> None:
    e = _llm(env, cache=False).engine
    assert e.prefix_cache is None
    _run(e, "1", P)
    out, rows = _run(e, "2", P)
    assert out.num_cached_tokens == 0 and rows == _rows_of_a_miss(P) and e.pool.num_cached == 0


def test_cancellation_at_every_phase_frees_blocks_and_references(env: dict) -> None:
    """Aborted while queued, while its adapter loads, mid-prefill (after a hit) and mid-decode:
    each frees its blocks, its holds on shared cached blocks and its adapter hold; the request
    sharing those blocks is unaffected."""
    from adapters.test_h2d_copy import ManualCopier

    from loraplex.adapters.h2d_copy import AsyncLoads

    sizer = _llm(env)
    sizer.register_adapter("a", env["paths"]["a"])
    footprint = max(
        sizer.engine.tiers.pool.allocated_of(r) for r in sizer.engine.residency.resident_revisions()
    )
    llm = _llm(env, max_num_seqs=2, max_num_batched_tokens=8, adapter_device_bytes=2 * footprint)
    e = llm.engine
    refs = {name: e.register_adapter(name, env["paths"][name]) for name in ("a", "b", "c")}
    assert e.residency.num_resident == 2  # c waits in the host tier
    copier = ManualCopier()
    e.tiers.copies = AsyncLoads(e.residency, copier)
    long = SamplingParams(max_tokens=30, temperature=0.0, logprobs=4, ignore_eos=True)
    _run(e, "warm", P, "a")  # P's blocks under a are cached

    e.add_request("keep", P, long, "a")  # hits, then decodes while the others come and go
    e.step()
    assert e.sequence("keep").num_cached_tokens == 20
    e.add_request("prefill", P[:16] + _prompt(20, 5), GREEDY, "a")
    e.step()
    seq = e.sequence("prefill")
    assert seq.num_cached_tokens == 16 and 16 < seq.num_computed < seq.num_tokens  # mid-prefill
    shared = seq.block_ids[:4]
    assert all(e.pool.ref_count(b) == 2 for b in shared)
    e.add_request("queued", P, GREEDY, "a")  # two running: max_num_seqs holds it back
    e.step()
    assert e.sequence("queued").block_ids == [] and e.adapters.holds(refs["a"]) == 3
    for rid in ("prefill", "queued"):
        assert e.abort(rid)
        e.check_integrity()
    assert all(e.pool.ref_count(b) == 1 for b in shared)  # only keep holds them now

    e.add_request("loading", P, GREEDY, "c")
    e.step()  # its load is placed and queued on the copier, not completed
    assert len(e.tiers.copies) == 1 and not e.output("loading").token_ids
    assert e.abort("loading") and e.adapters.holds(refs["c"]) == 0
    e.check_integrity()
    copier.events[0].complete()

    e.add_request("decode", _prompt(10, 6), long, "a")  # (a stays resident: keep holds it)
    while len(e.output("decode").token_ids) < 3:
        e.step()
    assert e.sequence("decode").block_ids
    assert e.abort("decode") and e.adapters.holds(refs["a"]) == 1
    e.check_integrity()
    while e.has_unfinished():
        e.step()
        e.check_integrity()
    _same(e.output("keep"), _cold(env, "a", P, long))
    for rid in ("keep", "prefill", "queued", "loading", "decode"):
        e.release(rid)
    assert e.pool.num_used == 0 and all(e.adapters.holds(r) == 0 for r in refs.values())
    assert e.pool.num_cached > 0  # what was computed stays cached, held by nobody
    e.check_integrity()


@pytest.mark.parametrize("num_kv_blocks", [14, 9])
def test_preemption_with_shared_blocks_keeps_outputs_right(env: dict, num_kv_blocks: int) -> None:
    """Four requests sharing a 16-token prefix, each needing up to 9 blocks, in a pool of 14 (they
    preempt one another) or of 9 (one request's worst case: they run one at a time)."""
    params = SamplingParams(max_tokens=14, temperature=0.0, logprobs=4, ignore_eos=True)
    prompts = [P[:16] + _prompt(3 + i, 10 + i) for i in range(4)]
    llm = _llm(env, num_kv_blocks=num_kv_blocks)
    llm.register_adapter("a", env["paths"]["a"])
    e = llm.engine
    adapters = ["a", None, "a", None]
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters, strict=True)):
        e.add_request(f"r{i}", prompt, params, adapter)
    preempted = 0
    while e.has_unfinished():
        e.step()
        e.check_integrity()
        preempted += len(e.last_stats.preempted) if e.last_stats is not None else 0
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters, strict=True)):
        _same(e.output(f"r{i}"), _cold(env, adapter, prompt, params))
    if num_kv_blocks == 14:  # (in 9 blocks, each request's tail evicts the others' prefix)
        assert preempted > 0, "the workload should preempt"
        assert e.prefix_cache is not None and e.prefix_cache.stats.hit_tokens > 0

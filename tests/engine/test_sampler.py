"""Sampler: transformers-equal filtering, greedy, raw logprobs, per-request determinism, frequencies."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from loraplex.engine.sampler import Sampler, SampleResult, filtered_logits, logprob_dicts
from loraplex.types import SamplingParams

V = 32


def _hf_warp(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """What transformers' generate applies for these params (same conditions as in generate)."""
    warpers = LogitsProcessorList()
    if p.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(float(p.temperature)))
    if p.top_k not in (0, -1):
        warpers.append(TopKLogitsWarper(top_k=p.top_k, min_tokens_to_keep=1))
    if p.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=p.top_p, min_tokens_to_keep=1))
    return warpers(torch.zeros(1, 1, dtype=torch.long), row[None].clone())[0]


def _logit_rows() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randn(V, generator=gen) * scale for scale in (0.5, 2.0, 6.0)]
    rows.append(torch.round(torch.randn(V, generator=gen) * 2))  # many ties
    rows.append(torch.zeros(V))  # all tied: top-k / top-p boundaries fall inside one tie group
    wide = torch.randn(V, generator=gen)
    wide[::3] -= 200.0  # probabilities that underflow to exactly 0 in float32
    rows.append(wide)
    return rows


GRID = list(
    itertools.product(
        (0.05, 0.5, 1.0, 1.7),  # temperature
        (0, -1, 1, 2, 5, V - 1, V, V + 7),  # top_k
        (1e-9, 0.05, 0.3, 0.5, 0.9, 0.999999, 1.0),  # top_p
    )
)


def test_filtered_logits_match_transformers_warpers() -> None:
    rows = _logit_rows()
    params, logits = [], []
    for row, (temperature, top_k, top_p) in itertools.product(rows, GRID):
        params.append(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
        logits.append(row)
    batch = torch.stack(logits)
    ours = filtered_logits(batch, params)  # one mixed batch: per-row params
    assert ours.dtype == torch.float32 and ours.shape == batch.shape
    for i, p in enumerate(params):
        ref = _hf_warp(batch[i], p)
        assert torch.equal(torch.isneginf(ours[i]), torch.isneginf(ref)), p
        torch.testing.assert_close(ours[i].softmax(-1), ref.softmax(-1), atol=1e-6, rtol=0)


@pytest.mark.parametrize("vocab", [32, 5000])
def test_filtered_logits_of_a_row_do_not_depend_on_the_batch(vocab: int) -> None:
    gen = torch.Generator().manual_seed(3)
    row = torch.round(torch.randn(vocab, generator=gen) * 3)  # ties everywhere, boundaries inside them
    p = SamplingParams(temperature=0.8, top_k=vocab // 3, top_p=0.6)
    alone = filtered_logits(row[None], [p])[0]
    for size, pos in ((2, 1), (5, 0), (7, 4)):
        batch = torch.round(torch.randn(size, vocab, generator=gen) * 3)
        batch[pos] = row
        params = [SamplingParams(temperature=1.2, top_p=0.3)] * size
        params[pos] = p
        assert torch.equal(filtered_logits(batch, params)[pos], alone)


def test_filtered_logits_ties_and_boundaries() -> None:
    flat = torch.zeros(1, 8)
    # top-k keeps every token tied with the k-th value.
    assert not torch.isinf(filtered_logits(flat, [SamplingParams(top_k=2)])).any()
    # The most likely token always survives top-p, however small top_p is.
    peaked = torch.tensor([[0.0, 5.0, 1.0, 4.0]])
    out = filtered_logits(peaked, [SamplingParams(top_p=1e-9)])
    assert torch.isneginf(out).tolist() == [[True, False, True, True]]
    # top_p == 1.0 drops nothing, even tokens whose probability underflows to 0.
    far = torch.tensor([[0.0, -500.0, 3.0]])
    assert not torch.isinf(filtered_logits(far, [SamplingParams(top_p=1.0)])).any()
    # Low tail with mass exactly 1 - top_p is dropped (cumulative <= 1 - top_p).
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.125]]).log()
    out = filtered_logits(probs, [SamplingParams(top_p=0.75)])
    assert torch.isneginf(out).tolist() == [[False, False, True, True]]


def test_filtered_logits_greedy_rows_are_point_masses_and_dtype_is_float32() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, -1.0], [0.0, 1.0, 2.0, 3.0]], dtype=torch.bfloat16)
    out = filtered_logits(logits, [SamplingParams(temperature=0.0, top_k=1), SamplingParams(temperature=2.0)])
    assert out.dtype == torch.float32
    assert out[0].softmax(-1).tolist() == [0.0, 1.0, 0.0, 0.0]  # tie -> lowest index
    torch.testing.assert_close(out[1], logits[1].float() / 2.0)


def test_greedy_is_argmax_with_lowest_index_ties() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 50, generator=gen)
    logits[2, 7] = logits[2, 30] = logits[2].max() + 1.0
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.1, seed=5) for _ in range(6)]
    res = Sampler()(logits, params, [None] * 6)
    assert isinstance(res, SampleResult)
    assert res.token_ids == logits.argmax(-1).tolist()
    assert res.token_ids[2] == 7
    assert res.logprobs == [None] * 6


def test_logprobs_are_raw_log_softmax_with_chosen_and_exactly_top_n() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(5, 100, generator=gen) * 3).to(torch.bfloat16)
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.4, top_k=10, logprobs=5),
        SamplingParams(temperature=1.3, top_p=0.8, logprobs=0),
        SamplingParams(temperature=0.9),
        SamplingParams(temperature=2.0, logprobs=150),  # more than the vocabulary
    ]
    gens = [None, torch.Generator().manual_seed(3), None, None, torch.Generator().manual_seed(4)]
    res = Sampler(torch.Generator().manual_seed(9))(logits, params, gens)
    raw = torch.log_softmax(logits.float(), dim=-1)  # not temperature-scaled
    assert res.logprobs[3] is None
    for i, p in enumerate(params):
        if p.logprobs is None:
            continue
        d = res.logprobs[i]
        assert d is not None
        chosen = res.token_ids[i]
        top = raw[i].topk(min(p.logprobs, 100)).indices.tolist()
        assert set(d) == {chosen, *top}
        assert all(isinstance(t, int) and isinstance(v, float) for t, v in d.items())
        for tok, lp in d.items():
            assert lp == raw[i, tok].item()
    assert list(res.logprobs[2]) == [res.token_ids[2]]  # logprobs=0: only the sampled token
    assert len(res.logprobs[4]) == 100


def test_logprob_dicts_for_prompt_positions() -> None:
    lp = torch.log_softmax(torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0]]), dim=-1)
    out = logprob_dicts(lp, [0, 1], [2, None])
    assert out[1] is None
    assert out[0] == {0: lp[0, 0].item(), 3: lp[0, 3].item(), 2: lp[0, 2].item()}
    assert logprob_dicts(lp, [0, 1], [None, None]) == [None, None]


def _target_params() -> SamplingParams:
    return SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=1234)


def _run_alone(steps: list[torch.Tensor], seed: int) -> list[int]:
    sampler, g = Sampler(), torch.Generator().manual_seed(seed)
    return [sampler(row[None], [_target_params()], [g]).token_ids[0] for row in steps]


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    vocab, n_steps = 300, 60
    gen = torch.Generator().manual_seed(5)
    steps = [torch.randn(vocab, generator=gen) * 2 for _ in range(n_steps)]
    alone = _run_alone(steps, seed=1234)

    sampler = Sampler(torch.Generator().manual_seed(77))
    target_gen = torch.Generator().manual_seed(1234)
    other_gens = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    others = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.5, top_p=0.5, seed=2, logprobs=2),
    ]
    batched = []
    for t, row in enumerate(steps):
        size = 2 + t % 4  # batch size and the target's position change every step
        pos = t % size
        logits = torch.randn(size, vocab, generator=gen) * 2
        logits[pos] = row
        params = [others[j % 3] for j in range(size)]
        gens: list[torch.Generator | None] = [other_gens[j % 3] if j % 2 else None for j in range(size)]
        params[pos], gens[pos] = _target_params(), target_gen
        batched.append(sampler(logits, params, gens).token_ids[pos])
    assert batched == alone

    different = _run_alone(steps, seed=4321)
    assert sum(a != b for a, b in zip(alone, different, strict=True)) > n_steps // 3


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    keep = probs > 0
    expected = probs[keep] * counts.sum()
    stat = ((counts[keep] - expected) ** 2 / expected).sum().item()
    return stat, int(keep.sum()) - 1


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=6),
        SamplingParams(temperature=1.5, top_p=0.8),
        SamplingParams(temperature=0.8, top_k=9, top_p=0.9),
    ],
)
def test_sampling_frequencies_match_filtered_distribution(params: SamplingParams) -> None:
    vocab, draws = 12, 20000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(6)) * 1.5
    probs = filtered_logits(logits[None], [params])[0].softmax(-1)

    # Shared-generator path: many identical rows in one call.
    shared = Sampler(torch.Generator().manual_seed(7))
    counts = torch.bincount(
        torch.tensor(shared(logits.expand(draws, vocab), [params] * draws, [None] * draws).token_ids),
        minlength=vocab,
    ).double()
    # Private-generator path: one row over many steps with a persistent generator.
    g, alone = torch.Generator().manual_seed(8), Sampler()
    own = torch.bincount(
        torch.tensor([alone(logits[None], [params], [g]).token_ids[0] for _ in range(3000)]), minlength=vocab
    ).double()

    for c in (counts, own):
        assert c[probs == 0].sum() == 0  # never a masked token
        stat, dof = _chi_square(c, probs.double())
        # Mean dof, sd sqrt(2 dof): 6 sd is far outside chance (and the seeds are fixed).
        assert stat < dof + 6 * (2 * dof) ** 0.5, (stat, dof)

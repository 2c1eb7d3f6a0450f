"""Turn one step's logits into tokens (and logprobs) under each request's SamplingParams.

Semantics, per row:
- greedy (`temperature == 0`): `argmax` of the raw logits, ties to the lowest index; top-k and
  top-p do not apply.
- sampling: the logits are divided by the temperature, then top-k and then top-p mask tokens to
  `-inf`: the same order, tie rules and thresholds as transformers' `generate` with
  `TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper` (`min_tokens_to_keep=1`).
  A token is drawn from `softmax` of the result.
- logprobs: the raw `log_softmax` of the model's logits in float32, taken before temperature,
  top-k and top-p (what vLLM reports).

Determinism: a row with its own generator draws its noise from that generator alone, so its token
depends only on its logits row, its params and its generator state, never on the batch around it.
Generators live on the device of the logits (the engine creates each request's generator there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loraplex.types import SamplingParams

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]  # one per row
    # Per row: None unless params.logprobs is set; else {sampled token: lp, top-N tokens: lp}.
    logprobs: list[dict[int, float] | None]


def filtered_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each row is sampled from, as float32 logits with filtered tokens at -inf.

    logits: [N, V]. Sampling rows: temperature-scaled, then top-k, then top-p masked, exactly as
    transformers' warpers in that order. Greedy rows: every token but the argmax is -inf and the
    argmax is 0.0 (a point mass on the greedy choice).
    """
    vocab = logits.shape[-1]
    device = logits.device
    # Dividing by a float32 tensor gives the same bits as transformers' `scores / temperature` (CPU).
    # Greedy rows get 1.0 here and are replaced by their point mass below.
    temps = torch.tensor([p.temperature or 1.0 for p in params], dtype=torch.float32, device=device)
    out = logits.float() / temps[:, None]  # [N, V], a fresh tensor we may write into

    topk_rows = [i for i, p in enumerate(params) if not p.greedy and 0 < p.top_k < vocab]
    if topk_rows:
        rows = torch.tensor(topk_rows, device=device)
        k_list = [params[i].top_k for i in topk_rows]
        ks = torch.tensor(k_list, device=device)
        sub = out[rows]
        # Like TopKLogitsWarper: drop what is strictly below the k-th largest value, so ties with
        # the k-th value all survive.
        top_vals = torch.topk(sub, max(k_list), dim=-1).values  # [R, kmax], descending
        kth = top_vals.gather(1, (ks - 1)[:, None])
        out[rows] = sub.masked_fill(sub < kth, _NEG_INF)

    # transformers' generate skips the top-p warper at top_p == 1.0 (applied, it would also drop
    # tokens whose probability underflows to 0), so we do too.
    topp_rows = [i for i, p in enumerate(params) if not p.greedy and p.top_p < 1.0]
    if topp_rows:
        rows = torch.tensor(topp_rows, device=device)
        # 1 - top_p in double, rounded once to float32: what comparing with the python scalar does.
        cutoff = torch.tensor([1.0 - params[i].top_p for i in topp_rows], dtype=torch.float32, device=device)
        sub = out[rows]
        # The same (unstable) sort as TopPLogitsWarper: where tied logits straddle the cutoff, which
        # of them survive is torch.sort's order, as in transformers. Each row is sorted on its own,
        # so that order depends only on the row, never on the batch.
        sorted_vals, order = torch.sort(sub, dim=-1, descending=False)
        cumulative = sorted_vals.softmax(dim=-1).cumsum(dim=-1)
        # Drop the low tail whose mass is at most 1 - top_p; the most likely token always stays.
        drop_sorted = cumulative <= cutoff[:, None]
        drop_sorted[:, -1] = False
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        out[rows] = sub.masked_fill(drop, _NEG_INF)

    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    if greedy_rows:
        rows = torch.tensor(greedy_rows, device=device)
        point = torch.full((len(greedy_rows), vocab), _NEG_INF, dtype=torch.float32, device=device)
        point.scatter_(1, logits[rows].argmax(dim=-1, keepdim=True), 0.0)
        out[rows] = point
    return out


def logprob_dicts(
    logprobs: torch.Tensor, chosen: Sequence[int], top_n: Sequence[int | None]
) -> list[dict[int, float] | None]:
    """Per row: None where top_n is None, else {chosen token: lp} plus the top_n most likely tokens.

    logprobs: [N, V] log-softmax of the raw logits. The chosen token comes first; the top-N follow
    in descending order (ties in any order); a chosen token that is also in the top-N appears once.
    """
    out: list[dict[int, float] | None] = [None] * len(top_n)
    wanted = [i for i, k in enumerate(top_n) if k is not None]
    if not wanted:
        return out
    device = logprobs.device
    rows = torch.tensor(wanted, device=device)
    sub = logprobs[rows].float()  # [R, V]
    chosen_ids = torch.tensor([chosen[i] for i in wanted], device=device)
    chosen_lp = sub.gather(1, chosen_ids[:, None]).squeeze(1).tolist()
    kmax = min(max(top_n[i] for i in wanted), sub.shape[-1])
    top_vals: list[list[float]] = [[] for _ in wanted]
    top_ids: list[list[int]] = [[] for _ in wanted]
    if kmax > 0:
        vals, ids = torch.topk(sub, kmax, dim=-1)
        top_vals, top_ids = vals.tolist(), ids.tolist()
    for j, i in enumerate(wanted):
        row = {int(chosen[i]): chosen_lp[j]}
        k = top_n[i]
        for tok, lp in zip(top_ids[j][:k], top_vals[j][:k], strict=True):
            row.setdefault(tok, lp)
        out[i] = row
    return out


def _gumbel_noise(uniform: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise from uniform draws in [0, 1) (as torch.rand gives), in place.

    -log(u) is never 0 (u < 1), so no token can win outright whatever its probability; u == 0
    would give -inf noise and is clamped, so a row's only surviving token can still win.
    """
    uniform.clamp_min_(torch.finfo(uniform.dtype).tiny)
    return uniform.log_().neg_().log_().neg_()


class Sampler:
    """Picks one token per logits row.

    Sampling uses the Gumbel-max trick: argmax(filtered logits + Gumbel noise) is a draw from
    softmax(filtered logits). A row with its own generator draws its own [V] noise vector from it;
    the others share one draw from `generator` (None: torch's default generator of the device).
    """

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> SampleResult:
        n, vocab = logits.shape
        device = logits.device
        tokens = torch.empty(n, dtype=torch.long, device=device)

        greedy = [i for i, p in enumerate(params) if p.greedy]
        if greedy:
            rows = torch.tensor(greedy, device=device)
            tokens[rows] = logits[rows].float().argmax(dim=-1)

        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            rows = torch.tensor(sampled, device=device)
            scores = filtered_logits(logits[rows], [params[i] for i in sampled])  # [S, V]
            uniform = torch.empty_like(scores)
            shared = [j for j, i in enumerate(sampled) if generators[i] is None]
            if shared:
                draw = torch.rand((len(shared), vocab), generator=self.generator, device=device)
                uniform[torch.tensor(shared, device=device)] = draw
            for j, i in enumerate(sampled):
                if generators[i] is not None:
                    uniform[j].uniform_(generator=generators[i])  # this row's [V] draw, its stream only
            # Masked tokens stay -inf (the noise is finite), so they can never be picked.
            tokens[rows] = (scores + _gumbel_noise(uniform)).argmax(dim=-1)

        token_ids = tokens.tolist()
        result: list[dict[int, float] | None] = [None] * n
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if wanted:
            rows = torch.tensor(wanted, device=device)
            logprobs = torch.log_softmax(logits[rows].float(), dim=-1)  # raw: before any warping
            chosen = [token_ids[i] for i in wanted]
            dicts = logprob_dicts(logprobs, chosen, [params[i].logprobs for i in wanted])
            for i, d in zip(wanted, dicts, strict=True):
                result[i] = d
        return SampleResult(token_ids, result)

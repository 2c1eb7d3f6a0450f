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

Two halves (`Sampler.launch`, then `PendingSample.result`): the first queues every device op of the
step's sampling and logprobs, the second copies the results to the host (the one sync) and builds
the logprob dicts. A serving loop launches the next step between the two (`Engine.step_overlapped`).

Determinism: a row with its own generator draws its noise from that generator alone, so its token
depends only on its logits row, its params and its generator state, never on the batch around it.
Generators live on the device of the logits (the engine creates each request's generator there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loraplex.host_to_device import to_device
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
    n, vocab = logits.shape
    device = logits.device
    temp_list: list[float] = []
    topk_rows: list[int] = []
    topp_rows: list[int] = []
    greedy_rows: list[int] = []
    for i, p in enumerate(params):
        if p.temperature == 0.0:
            greedy_rows.append(i)
            temp_list.append(1.0)
            continue
        temp_list.append(p.temperature)
        if 0 < p.top_k < vocab:
            topk_rows.append(i)
        if p.top_p < 1.0:
            topp_rows.append(i)
    # Dividing by a float32 tensor gives the same bits as transformers' `scores / temperature` (CPU).
    # Greedy rows get 1.0 here and are replaced by their point mass below.
    temps = to_device(temp_list, torch.float32, device)
    out = logits.float() / temps[:, None]  # [N, V], a fresh tensor we may write into

    # A step applies to a subset of rows (gathered, masked, scattered back) or, when every row
    # takes it, to `out` in place: the same values either way, fewer device ops.
    if topk_rows:
        k_list = [params[i].top_k for i in topk_rows]
        ks = to_device(k_list, torch.int64, device)
        every = len(topk_rows) == n
        rows = None if every else to_device(topk_rows, torch.int64, device)
        sub = out if rows is None else out[rows]
        # Like TopKLogitsWarper: drop what is strictly below the k-th largest value, so ties with
        # the k-th value all survive.
        top_vals = torch.topk(sub, max(k_list), dim=-1).values  # [R, kmax], descending
        kth = top_vals.gather(1, (ks - 1)[:, None])
        if rows is None:
            out.masked_fill_(out < kth, _NEG_INF)
        else:
            out[rows] = sub.masked_fill(sub < kth, _NEG_INF)

    # transformers' generate skips the top-p warper at top_p == 1.0 (applied, it would also drop
    # tokens whose probability underflows to 0), so we do too.
    if topp_rows:
        rows = None if len(topp_rows) == n else to_device(topp_rows, torch.int64, device)
        # 1 - top_p in double, rounded once to float32: what comparing with the python scalar does.
        cutoff = to_device([1.0 - params[i].top_p for i in topp_rows], torch.float32, device)
        sub = out if rows is None else out[rows]
        # The same (unstable) sort as TopPLogitsWarper: where tied logits straddle the cutoff, which
        # of them survive is torch.sort's order, as in transformers. Each row is sorted on its own,
        # so that order depends only on the row, never on the batch.
        sorted_vals, order = torch.sort(sub, dim=-1, descending=False)
        cumulative = sorted_vals.softmax(dim=-1).cumsum(dim=-1)
        # Drop the low tail whose mass is at most 1 - top_p; the most likely token always stays.
        drop_sorted = cumulative <= cutoff[:, None]
        drop_sorted[:, -1] = False
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        if rows is None:
            out.masked_fill_(drop, _NEG_INF)
        else:
            out[rows] = sub.masked_fill(drop, _NEG_INF)

    if greedy_rows:
        rows = to_device(greedy_rows, torch.int64, device)
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
    if len(wanted) == len(top_n):
        sub = logprobs.float()  # [N, V]
    else:
        sub = logprobs[to_device(wanted, torch.int64, device)].float()  # [R, V]
    chosen_ids = to_device([int(chosen[i]) for i in wanted], torch.int64, device)
    _, dicts = _rows_logprobs(sub, chosen_ids, [top_n[i] for i in wanted])  # type: ignore[misc]
    for i, d in zip(wanted, dicts, strict=True):
        out[i] = d
    return out


def _rows_logprobs(
    logprobs: torch.Tensor, chosen_ids: torch.Tensor, top_n: list[int]
) -> tuple[list[int], list[dict[int, float]]]:
    """logprob_dicts where every row wants logprobs and the chosen tokens are still on the device
    ([R] int64): returns them on the host too. Two copies to the host in all (ints, floats), so
    one sync after the one the sampled tokens need anyway, whatever top_n is."""
    return _logprob_rows(*_logprob_tensors(logprobs, chosen_ids, top_n), top_n)


def _logprob_tensors(
    logprobs: torch.Tensor, chosen_ids: torch.Tensor, top_n: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The device half of `_rows_logprobs`: per row the chosen token (its logprob) first, then
    the top-kmax tokens (logprobs), as [R, 1 + kmax] int64 and float32."""
    chosen_lp = logprobs.gather(1, chosen_ids[:, None])  # [R, 1]
    kmax = min(max(top_n), logprobs.shape[-1])
    if kmax > 0:
        vals, ids = torch.topk(logprobs, kmax, dim=-1)  # [R, kmax], descending
        return torch.cat((chosen_ids[:, None], ids), dim=1), torch.cat((chosen_lp, vals), dim=1)
    return chosen_ids[:, None], chosen_lp


def _logprob_rows(
    ints_t: torch.Tensor, floats_t: torch.Tensor, top_n: list[int]
) -> tuple[list[int], list[dict[int, float]]]:
    """The host half of `_rows_logprobs`: two copies to the host, then the dicts."""
    ints, floats = ints_t.tolist(), floats_t.tolist()
    kmax = len(ints[0]) - 1 if ints else 0
    dicts: list[dict[int, float]] = []
    add = dicts.append
    for row_ids, row_vals, k in zip(ints, floats, top_n, strict=True):
        if k < kmax:
            row_ids, row_vals = row_ids[: k + 1], row_vals[: k + 1]
        row = dict(zip(row_ids, row_vals, strict=True))
        row[row_ids[0]] = row_vals[0]  # a chosen token among the top-N keeps its place (first) and value
        add(row)
    return [r[0] for r in ints], dicts


def _neg_gumbel_noise(uniform: torch.Tensor) -> torch.Tensor:
    """Minus Gumbel(0, 1) noise, log(-log(u)), from uniform draws in [0, 1) (as torch.rand gives),
    in place. `scores - this` is bit for bit `scores + Gumbel noise` (x - y is x + (-y) in IEEE
    arithmetic), one device op fewer.

    -log(u) is never 0 (u < 1), so no token can win outright whatever its probability; u == 0
    would give -inf noise and is clamped, so a row's only surviving token can still win.
    """
    uniform.clamp_min_(torch.finfo(uniform.dtype).tiny)
    return uniform.log_().neg_().log_()


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy of t in pinned host memory, queued on the stream (the caller waits for an event)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


class PendingSample:
    """A step's sampling, queued on the device: `result()` brings it to the host.

    On CUDA the copies to the host are queued with the sampling, into pinned memory, and an event
    marks their end: `result()` waits for that event only. A plain `.tolist()` of a device tensor
    would wait for everything queued on the stream by then, which, one step ahead
    (`Engine.step_overlapped`), is the whole next step: the device would idle through every
    host-side part of a step."""

    def __init__(
        self,
        n: int,
        tokens: torch.Tensor,
        logprob_rows: list[int] | None = None,
        logprob_tensors: tuple[torch.Tensor, torch.Tensor] | None = None,
        top_n: list[int] | None = None,
    ) -> None:
        self._n = n
        self._tokens = tokens
        self._rows = logprob_rows  # the rows that asked for logprobs (None: none did)
        self._lp = logprob_tensors
        self._top_n = top_n
        self._host_tokens, self._host_lp = tokens, logprob_tensors
        self._copied: torch.cuda.Event | None = None
        if tokens.is_cuda:
            if logprob_rows is None or len(logprob_rows) != n:  # else they come with the logprobs
                self._host_tokens = _to_host(tokens)
            if logprob_tensors is not None:
                self._host_lp = (_to_host(logprob_tensors[0]), _to_host(logprob_tensors[1]))
            self._copied = torch.cuda.Event()
            self._copied.record()

    @property
    def tokens(self) -> torch.Tensor:
        """[n] int64 on the device: the sampled tokens (what the next step's rows read)."""
        return self._tokens

    def result(self) -> SampleResult:
        n, rows = self._n, self._rows
        if self._copied is not None:
            self._copied.synchronize()
        lp = self._host_lp
        if rows is None or lp is None or self._top_n is None:
            return SampleResult(self._host_tokens.tolist(), [None] * n)
        if len(rows) == n:  # every row: the tokens come back with the logprobs
            token_ids, dicts = _logprob_rows(*lp, self._top_n)
            return SampleResult(token_ids, dicts)  # type: ignore[arg-type]
        token_ids = self._host_tokens.tolist()
        result: list[dict[int, float] | None] = [None] * n
        _, dicts = _logprob_rows(*lp, self._top_n)
        for i, d in zip(rows, dicts, strict=True):
            result[i] = d
        return SampleResult(token_ids, result)


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
        return self.launch(logits, params, generators).result()

    def launch(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> PendingSample:
        """Queue the sampling (and logprobs) of these rows; nothing waits for the device."""
        n, vocab = logits.shape
        device = logits.device
        temps = [p.temperature for p in params]  # a row is greedy iff its temperature is 0 (falsy)
        top_n = [p.logprobs for p in params]
        wants_logprobs = top_n.count(None) != n

        if not any(temps):
            # Every row greedy (the common serving case): one argmax over the batch.
            tokens = logits.float().argmax(dim=-1)
        elif all(temps):
            tokens = self._sample(logits, params, generators)
        else:
            greedy = [i for i, t in enumerate(temps) if t == 0.0]
            sampled = [i for i, t in enumerate(temps) if t != 0.0]
            tokens = torch.empty(n, dtype=torch.long, device=device)
            rows = to_device(greedy, torch.int64, device)
            tokens[rows] = logits[rows].float().argmax(dim=-1)
            rows = to_device(sampled, torch.int64, device)
            tokens[rows] = self._sample(
                logits[rows], [params[i] for i in sampled], [generators[i] for i in sampled]
            )
        if not wants_logprobs:
            return PendingSample(n, tokens)
        if top_n.count(None) == 0:  # every row: no gather, and the tokens come back with the logprobs
            logprobs = torch.log_softmax(logits.float(), dim=-1)  # raw: before any warping
            tensors = _logprob_tensors(logprobs, tokens, top_n)  # type: ignore[arg-type]
            return PendingSample(n, tokens, list(range(n)), tensors, top_n)  # type: ignore[arg-type]
        wanted = [i for i, k in enumerate(top_n) if k is not None]
        rows = to_device(wanted, torch.int64, device)
        logprobs = torch.log_softmax(logits[rows].float(), dim=-1)  # raw: before any warping
        wanted_n: list[int] = [top_n[i] for i in wanted]  # type: ignore[misc]
        return PendingSample(n, tokens, wanted, _logprob_tensors(logprobs, tokens[rows], wanted_n), wanted_n)

    def _sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> torch.Tensor:
        """[S] int64 tokens of rows that all sample (none greedy)."""
        scores = filtered_logits(logits, params)  # [S, V] float32, fresh
        device = scores.device
        shared = [j for j, g in enumerate(generators) if g is None]
        if len(shared) == len(generators):
            # The shared generator's one [S, V] draw, as below with every row shared.
            uniform = torch.rand(scores.shape, generator=self.generator, device=device).to(scores.dtype)
        else:
            uniform = torch.empty_like(scores)
            if shared:
                draw = torch.rand((len(shared), scores.shape[1]), generator=self.generator, device=device)
                uniform[to_device(shared, torch.int64, device)] = draw
            # Row views from one unbind when most rows need one (cheaper than indexing each).
            rows = uniform.unbind(0) if 2 * len(shared) < len(generators) else uniform
            for j, g in enumerate(generators):
                if g is not None:
                    rows[j].uniform_(generator=g)  # this row's [V] draw, its stream only
        # Masked tokens stay -inf (the noise is finite), so they can never be picked.
        return scores.sub_(_neg_gumbel_noise(uniform)).argmax(dim=-1)

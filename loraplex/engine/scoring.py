"""Prompt scoring: logprobs of prompt tokens, and requests that end once their prompt is computed
(`max_tokens=0`)."""

from __future__ import annotations

import torch

from loraplex.engine.model_runner import ForwardResult
from loraplex.engine.sampler import logprob_dicts
from loraplex.engine.scheduler import StepPlan
from loraplex.engine.sequence import Sequence
from loraplex.host_to_device import to_device


def record_prompt_logprobs(plan: StepPlan, result: ForwardResult) -> None:
    """Append this step's prompt-token logprobs to the sequences that asked for them."""
    if not result.prompt_rows:
        return
    lps = torch.log_softmax(result.prompt_logits, dim=-1)
    seqs = [plan.chunks[r.chunk].seq for r in result.prompt_rows]
    actual = [s.prompt_token_ids[r.position] for s, r in zip(seqs, result.prompt_rows, strict=True)]
    dicts = logprob_dicts(lps, actual, [s.params.prompt_logprobs for s in seqs])
    for seq, d in zip(seqs, dicts, strict=True):
        seq.prompt_logprobs.append(d)


def split_scoring(
    seqs: list[Sequence], logits: torch.Tensor
) -> tuple[list[Sequence], list[Sequence], torch.Tensor]:
    """(the max_tokens=0 sequences among `seqs`, whose prompts are now computed; the others; the
    others' logits rows). The scoring rows never reach the sampler: a row there would take its
    share of the shared generator's draw and shift every other row's noise."""
    keep = [i for i, s in enumerate(seqs) if s.params.max_tokens]
    if len(keep) == len(seqs):
        return [], seqs, logits
    done = [s for s in seqs if not s.params.max_tokens]
    if not keep:
        return done, [], logits[:0]
    rows = to_device(keep, torch.int64, logits.device)
    return done, [seqs[i] for i in keep], logits.index_select(0, rows)

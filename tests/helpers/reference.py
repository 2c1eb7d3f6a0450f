"""Reference outputs from transformers + PEFT (nothing here runs loraplex code)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

BASE = "__base__"  # PEFT's adapter_names entry for a row without an adapter


@dataclass
class ReferenceRun:
    prompt_logprobs: torch.Tensor  # [P - 1, V]: row p predicts prompt token p + 1
    step_logprobs: torch.Tensor  # [steps, V]: the distribution each greedy token was taken from
    tokens: list[int]


def load_peft_mixture(base: transformers.PreTrainedModel, adapters: dict[str, Path]):  # noqa: ANN201
    """One PeftModel holding every adapter, for `adapter_names` mixed batches."""
    import copy

    from peft import PeftModel

    names = list(adapters)
    model = PeftModel.from_pretrained(copy.deepcopy(base), str(adapters[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(adapters[name]), adapter_name=name)
    return model.eval()


@torch.no_grad()
def padded_batch(seqs: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of right-padded sequences."""
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask


@torch.no_grad()
def teacher_forced_logprobs(
    model,  # noqa: ANN001 (a PeftModel holding every adapter of `names`)
    seqs: Sequence[Sequence[int]],
    names: Sequence[str],
    device: str,
) -> list[torch.Tensor]:
    """log_softmax at every position of each full sequence, one right-padded mixed batch: row p
    of a sequence's tensor is the distribution of its token p + 1."""
    ids, mask = padded_batch(seqs)
    logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), adapter_names=list(names)).logits
    lps = torch.log_softmax(logits.float(), dim=-1).cpu()
    return [lps[i, : len(s) - 1] for i, s in enumerate(seqs)]


@torch.no_grad()
def mixed_batch_greedy(
    model,  # noqa: ANN001 (PeftModel or plain transformers model)
    prompts: Sequence[Sequence[int]],
    adapter_names: Sequence[str | None] | None,
    steps: int,
) -> list[ReferenceRun]:
    """Greedy decoding of a right-padded mixed batch by full forwards (no KV cache), so every
    step's logits come from one `adapter_names` forward over all rows."""
    seqs = [list(p) for p in prompts]
    names = None if adapter_names is None else [BASE if a is None else a for a in adapter_names]
    runs = [ReferenceRun(torch.empty(0), torch.empty(0), []) for _ in prompts]
    step_rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    for step in range(steps + 1):
        ids, mask = padded_batch(seqs)
        kwargs = {} if names is None else {"adapter_names": names}
        logits = model(input_ids=ids, attention_mask=mask, **kwargs).logits.float()
        lps = torch.log_softmax(logits, dim=-1)
        for i, s in enumerate(seqs):
            if step == 0:
                runs[i].prompt_logprobs = lps[i, : len(prompts[i]) - 1].clone()
            if step < steps:
                row = lps[i, len(s) - 1]
                step_rows[i].append(row.clone())
                token = int(row.argmax())
                runs[i].tokens.append(token)
                s.append(token)
    for i in range(len(prompts)):
        runs[i].step_logprobs = torch.stack(step_rows[i]) if step_rows[i] else torch.empty(0)
    return runs


def assert_logprob_dicts_match(
    ours: Sequence[dict[int, float] | None], ref: torch.Tensor, top_n: int, atol: float, what: str
) -> None:
    """Every entry of every dict within atol of the reference, and the top-N keys agree."""
    assert len(ours) == ref.shape[0], f"{what}: {len(ours)} dicts vs {ref.shape[0]} reference rows"
    for pos, (d, row) in enumerate(zip(ours, ref, strict=True)):
        assert d is not None, f"{what}[{pos}] missing"
        for token, value in d.items():
            assert abs(value - float(row[token])) <= atol, (
                f"{what}[{pos}] token {token}: {value} vs reference {float(row[token])}"
            )
        ref_top = set(torch.topk(row, top_n).indices.tolist())
        assert ref_top <= set(d), f"{what}[{pos}]: top-{top_n} {ref_top} not all in {sorted(d)}"

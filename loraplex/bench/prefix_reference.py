"""The float32 reference of `bench prefix`: where a prefix-cache hit must give a miss's greedy tokens.

In bf16 a request's logits depend on the batch it ran in (GEMM kernels differ by row count), so two
runs of one prompt may pick different tokens wherever two candidates are nearly tied, with or
without a prefix cache. transformers + PEFT in float32, teacher-forced along each cold request's
prompt and greedy tokens, gives the top-2 margin of the context at every output step. Warm (the
hit) and cold (the miss) must then agree, and give the reference's token, at every step whose
margin is at least `MARGIN`, for as long as they share their context: once they part at a
near-tie, they continue from different contexts and the comparison stops. The same rule as the
prefix cache's bf16 GPU test (tests/engine/test_gpu_prefix_bf16.py). Also here: the runs' greedy
tokens against each other (`compare_tokens`), and each run against the reference on its own
(`agreement_by_run`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MARGIN = 0.1  # a top-2 margin (float32 logits) under which bf16 may pick either token


@dataclass(frozen=True)
class ReferenceRequest:
    prompt: list[int]
    tokens: list[int]  # the cold run's greedy tokens, teacher-forced
    adapter: str | None  # its adapter's name, None: the base model


def reference_steps(
    model_dir: str,
    adapter_dirs: dict[str, str],
    requests: Sequence[ReferenceRequest],
    device: str,
    batch: int = 4,
) -> list[list[tuple[int, float]]]:
    """Per request and output step: (the float32 argmax token, its top-2 logit margin)."""
    import torch

    from loraplex.bench.serve_hf import load_peft_model

    used = sorted({r.adapter for r in requests if r.adapter is not None})
    model = load_peft_model(model_dir, {n: adapter_dirs[n] for n in used}, torch.float32, device)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 products, not TF32's 10-bit mantissas
    try:
        out: list[list[tuple[int, float]]] = []
        for start in range(0, len(requests), batch):
            out += _forward(model, requests[start : start + batch], bool(used), device)
        return out
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        del model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def _forward(
    model: Any,  # noqa: ANN401
    chunk: Sequence[ReferenceRequest],
    mixed: bool,
    device: str,
) -> list[list[tuple[int, float]]]:
    import torch

    seqs = [r.prompt + r.tokens for r in chunk]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):  # right-padded: positions stay those of the unpadded sequence
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    from loraplex.bench.serve_hf import BASE

    kwargs = {"adapter_names": [r.adapter or BASE for r in chunk]} if mixed else {}
    with torch.no_grad():
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs).logits
    out = []
    for i, r in enumerate(chunk):
        # the logits at position p give token p + 1: output step s is read at len(prompt) - 1 + s
        rows = logits[i, len(r.prompt) - 1 : len(r.prompt) - 1 + len(r.tokens)].float()
        top = torch.topk(rows, 2, dim=-1)
        margins = (top.values[:, 0] - top.values[:, 1]).tolist()
        out.append(list(zip(top.indices[:, 0].tolist(), margins, strict=True)))
    return out


def compare_tokens(reference: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Per request, whether `other`'s greedy tokens equal `reference`'s; for those that differ,
    the first differing step and the reference's top-2 margin there."""
    differences = []
    for ref, got in zip(reference["requests"], other["requests"], strict=True):
        assert ref["index"] == got["index"]
        a, b = ref["token_ids"], got["token_ids"]
        if a == b:
            continue
        step = next((s for s, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        margins = ref["margins"]
        differences.append(
            {"index": ref["index"], "step": step, "margin": margins[step] if step < len(margins) else None}
        )
    n = len(reference["requests"])
    return {"requests": n, "identical": n - len(differences), "differences": differences}


def agree(cold: Sequence[int], warm: Sequence[int], ref: Sequence[tuple[int, float]]) -> dict[str, Any]:
    """Steps where the reference decides (margin >= MARGIN) checked while cold and warm share their
    context; the first such step where cold, warm and the reference do not all agree, if any."""
    checked = 0
    for step, (a, b) in enumerate(zip(cold, warm, strict=False)):
        token, margin = ref[step]
        if margin >= MARGIN:
            if not a == b == token:
                failure = {"step": step, "cold": a, "warm": b, "reference": token, "margin": margin}
                return {"checked": checked, "failure": failure}
            checked += 1
        if a != b:
            break  # a near-tie: from here the two continue from different contexts
    return {"checked": checked, "failure": None}


def compare_with_reference(
    cold: dict[str, Any], warm: dict[str, Any], refs: Sequence[Sequence[tuple[int, float]]]
) -> dict[str, Any]:
    """`agree` over a run's requests (bench/prefix.py's run dicts, in request order)."""
    checked, failures = 0, []
    for c, w, ref in zip(cold["requests"], warm["requests"], refs, strict=True):
        assert c["index"] == w["index"]
        result = agree(c["token_ids"], w["token_ids"], ref)
        checked += result["checked"]
        if result["failure"] is not None:
            failures.append({"index": c["index"], **result["failure"]})
    steps = sum(len(c["token_ids"]) for c in cold["requests"])
    decided = sum(m >= MARGIN for ref in refs for _, m in ref)
    return {
        "margin": MARGIN,
        "requests": len(refs),
        "steps": steps,
        "steps_decided": decided,  # reference margin >= MARGIN, shared context or not
        "steps_checked": checked,
        "failures": failures,
        "pass": not failures and checked > 0,
    }


def agreement_by_run(
    runs: dict[str, dict[str, Any]], refs: Sequence[Sequence[tuple[int, float]]]
) -> dict[str, dict[str, Any]]:
    """How closely each run follows the float32 reference, with or without prefix-cache hits.

    The reference is teacher-forced along the cold run's tokens, so a run is checked at a step
    only while its tokens so far equal the cold run's (its context is the reference's). At each
    such step the reference decides (margin >= MARGIN), the run either picks the reference's token
    or not. `largest_margin_missed` is the run's noise floor against float32: no disagreement was
    seen at any larger margin. A run without prefix hits (`cold_unshared`, `cache_off`) measures
    the floor of the engine's dtype alone; a hit run whose floor and disagreement rate are no worse
    adds no error of its own.
    """
    out: dict[str, dict[str, Any]] = {}
    cold = runs["cold"]["requests"]
    for name, run in runs.items():
        if name == "prime":
            continue
        checked = missed = 0
        largest = 0.0
        for c, r, ref in zip(cold, run["requests"], refs, strict=True):
            for step, token in enumerate(r["token_ids"]):
                want, margin = ref[step]
                if margin >= MARGIN:
                    checked += 1
                    if token != want:
                        missed += 1
                        largest = max(largest, margin)
                if token != c["token_ids"][step]:
                    break  # its context is no longer the reference's
        out[name] = {
            "steps_checked": checked,
            "missed": missed,
            "missed_fraction": missed / checked if checked else None,
            "largest_margin_missed": largest if missed else None,
        }
    return out

"""The same workload through Hugging Face transformers + PEFT, the baseline `bench serve` states its
ratio to: the same model, adapters and prompts, generated with fixed settings (sdpa attention,
left-padded static batches in workload order, PEFT's `adapter_names` mixed batches, greedy, EOS
ignored, each batch run to its longest output). Only each request's own output length counts as
output; padding and the tokens a batch generates past a shorter request's end do not.

With a time limit, generation stops once it has run that long (inside a batch: a stopping
criterion, which also times every step). The result then counts the real tokens generated so far,
and bounds what a full run could have given: the batches done, plus the cut batch's first step and
its remaining steps at the fastest step seen (steps only slow down as the KV cache grows), over
the requests up to the cut batch's end (`output_tokens_per_s_upper_bound`)."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

BASE = "__base__"  # PEFT's adapter_names entry for a row on the base model


def load_peft_model(model_dir: str, adapter_dirs: dict[str, str], dtype: Any, device: str) -> Any:  # noqa: ANN401
    """transformers' model (sdpa attention) holding every adapter of `adapter_dirs` by its name, for
    PEFT's `adapter_names` mixed batches; the plain model when there is none."""
    import transformers
    from peft import PeftModel

    # on the device before the adapters go in, so that they load there (no host copy of the model)
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation="sdpa"
    )
    model = model.to(device)
    names = list(adapter_dirs)
    if names:
        model = PeftModel.from_pretrained(model, adapter_dirs[names[0]], adapter_name=names[0])
        for name in names[1:]:
            model.load_adapter(adapter_dirs[name], adapter_name=name)
    return model.to(device).eval()


def run_hf(
    model_dir: str,
    adapter_dirs: dict[str, str],
    names: list[str],
    prompts: list[list[int]],
    output_lens: list[int],
    adapters: list[int | None],
    device: str,
    batch: int = 64,
    progress: bool = False,
    time_limit_s: float | None = None,
) -> dict[str, Any]:
    """Generate every prompt; adapters[i] indexes `names` (None: base). Returns throughput."""
    import torch
    import transformers
    from tqdm import tqdm

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    used = sorted({names[a] for a in adapters if a is not None})
    model = load_peft_model(model_dir, {n: adapter_dirs[n] for n in used}, dtype, device)
    config = model.config
    pad = int(config.pad_token_id if config.pad_token_id is not None else 0)

    class Pace(transformers.StoppingCriteria):
        """Times every generated step; stops the batch once the deadline has passed."""

        def __init__(self, deadline: float | None) -> None:
            self.deadline = deadline
            self.times: list[float] = []

        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:  # noqa: ANN401
            now = time.perf_counter()
            self.times.append(now)
            stop = self.deadline is not None and now >= self.deadline
            return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)

    bar = tqdm(total=len(prompts), desc="bench serve (transformers + PEFT)", unit="req", disable=not progress)
    start = time.perf_counter()
    deadline = None if time_limit_s is None else start + time_limit_s
    batches = -(-len(prompts) // batch)
    output, covered, bound_s, cut = 0, 0, 0.0, False
    steps: list[float] = []
    first_steps: list[float] = []
    for lo in range(0, len(prompts), batch):
        rows = range(lo, min(lo + batch, len(prompts)))
        width = max(len(prompts[i]) for i in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, i in enumerate(rows):  # left padding, as generation wants it
            ids[r, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]) :] = 1
        new = max(output_lens[i] for i in rows)
        kwargs: dict[str, Any] = {}
        if used:
            kwargs["adapter_names"] = [BASE if (a := adapters[i]) is None else names[a] for i in rows]
        pace = Pace(deadline)
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=new,
                min_new_tokens=new,  # EOS ignored, as the engine's runs do
                do_sample=False,
                pad_token_id=pad,
                stopping_criteria=transformers.StoppingCriteriaList([pace]),
                **kwargs,
            )
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        done = len(pace.times)  # steps generated (each one token a row)
        if pace.times:
            first_steps.append(pace.times[0] - t0)
            steps += [b - a for a, b in zip(pace.times, pace.times[1:], strict=False)]
        covered += len(rows)
        if done < new:  # cut by the time limit
            cut = True
            output += sum(min(output_lens[i], done) for i in rows)
            fastest = min(steps) if steps else 0.0
            bound_s += (first_steps[-1] if pace.times else t1 - t0) + (new - 1) * fastest
            bound_tokens = sum(output_lens[:covered])
            break
        output += sum(output_lens[i] for i in rows)
        bound_s += t1 - t0
        bar.update(len(rows))
        if not progress:  # a line a batch: a run cut short by a time limit still tells its pace
            print(
                f"transformers + PEFT: batch {lo // batch + 1}/{batches} done, {t1 - start:.1f} s",
                file=sys.stderr,
                flush=True,
            )
    bar.close()
    wall = time.perf_counter() - start
    result: dict[str, Any] = {
        "wall_s": wall,
        "output_tokens": output,
        "output_tokens_per_s": output / wall if wall > 0 else 0.0,
        "cut": cut,
        "requests_covered": covered,
        "first_step_s": first_steps,
        "step_s_median": statistics.median(steps) if steps else None,
        "step_s_min": min(steps) if steps else None,
        "steps_timed": len(steps),
        "settings": {"batch": batch, "dtype": str(dtype).removeprefix("torch."), "attention": "sdpa"},
        "model_dir": str(Path(model_dir).name),
    }
    if cut:
        result["time_limit_s"] = time_limit_s
        result["output_tokens_per_s_upper_bound"] = bound_tokens / bound_s if bound_s > 0 else None
    return result

"""The same workload through Hugging Face transformers + PEFT, the baseline `bench serve` states its
ratio to: the same model, adapters and prompts, generated with fixed settings (sdpa attention,
left-padded static batches in workload order, PEFT's `adapter_names` mixed batches, greedy, EOS
ignored, each batch run to its longest output). Only each request's own output length counts as
output; padding and the tokens a batch generates past a shorter request's end do not."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

BASE = "__base__"  # PEFT's adapter_names entry for a row on the base model


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
) -> dict[str, Any]:
    """Generate every prompt; adapters[i] indexes `names` (None: base). Returns throughput."""
    import torch
    import transformers
    from peft import PeftModel
    from tqdm import tqdm

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    # on the device before the adapters go in, so that they load there (no host copy of the model)
    base: Any = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation="sdpa"
    )
    base = base.to(device)
    pad = int(base.config.pad_token_id if base.config.pad_token_id is not None else 0)
    used = sorted({names[a] for a in adapters if a is not None})
    model: Any = base
    if used:
        model = PeftModel.from_pretrained(base, adapter_dirs[used[0]], adapter_name=used[0])
        for name in used[1:]:
            model.load_adapter(adapter_dirs[name], adapter_name=name)
    model = model.to(device).eval()
    bar = tqdm(total=len(prompts), desc="bench serve (transformers + PEFT)", unit="req", disable=not progress)
    start = time.perf_counter()
    batches = -(-len(prompts) // batch)
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
        with torch.no_grad():
            model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=new,
                min_new_tokens=new,  # EOS ignored, as the engine's runs do
                do_sample=False,
                pad_token_id=pad,
                **kwargs,
            )
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        bar.update(len(rows))
        if not progress:  # a line a batch: a run cut short by a time limit still tells its pace
            done = time.perf_counter() - start
            print(
                f"transformers + PEFT: batch {lo // batch + 1}/{batches} done, {done:.1f} s",
                file=sys.stderr,
                flush=True,
            )
    bar.close()
    wall = time.perf_counter() - start
    output = sum(output_lens)
    return {
        "wall_s": wall,
        "output_tokens": output,
        "output_tokens_per_s": output / wall if wall > 0 else 0.0,
        "settings": {"batch": batch, "dtype": str(dtype).removeprefix("torch."), "attention": "sdpa"},
        "model_dir": str(Path(model_dir).name),
    }

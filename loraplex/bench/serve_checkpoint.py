"""Random weights as a Hugging Face checkpoint and PEFT adapter directories, so that the engine and
the transformers + PEFT baseline of `bench serve` load the very same model and adapters. Written
once per (shape, layers, ranks, seed) under a work directory and reused by later runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loraplex.lora.layout import HF_MODULE_NAMES


def write_random_checkpoint(
    hf_dict: dict[str, Any], ranks: list[int], workdir: Path, device: str, seed: int
) -> tuple[str, dict[str, str]]:
    """(model directory, adapter name -> directory) of a random model with one LoRA adapter per
    rank in `ranks` (named bench-0, bench-1, ... on all seven targets), on bf16 weights."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    key = json.dumps({"model": hf_dict, "ranks": ranks, "seed": seed}, sort_keys=True)
    model_dir = workdir / "model"
    names = [f"bench-{i}" for i in range(len(ranks))]
    adapter_dirs = {name: str(workdir / "adapters" / name) for name in names}
    marker = workdir / "checkpoint.json"
    if marker.is_file() and marker.read_text() == key:
        return str(model_dir), adapter_dirs
    workdir.mkdir(parents=True, exist_ok=True)
    config = transformers.LlamaConfig(**hf_dict)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.fill_(1.0)  # norm weights
            else:
                p.normal_(0.0, 0.02)
    model.save_pretrained(str(model_dir))
    targets = [name.rsplit(".", 1)[1] for name in HF_MODULE_NAMES.values()]
    for i, (name, rank) in enumerate(zip(names, ranks, strict=True)):
        torch.manual_seed(seed + 1000 + i)
        cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
        peft_model = get_peft_model(model, cfg)
        with torch.no_grad():  # deltas small enough that outputs stay in a sane range
            for param_name, p in peft_model.named_parameters():
                if "lora_B" in param_name:
                    p.mul_(0.01)
        peft_model.save_pretrained(adapter_dirs[name])
        model = peft_model.unload()  # the plain model back, for the next adapter
    marker.write_text(key)
    return str(model_dir), adapter_dirs

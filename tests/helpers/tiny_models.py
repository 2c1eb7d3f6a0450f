"""Tiny random models and PEFT adapters, built from transformers configs (nothing is downloaded)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import save_file

ARCHS = ("llama", "mistral", "qwen2", "qwen3")

_BASE = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def hf_config(arch: str, **overrides: Any) -> transformers.PretrainedConfig:
    kw = dict(_BASE)
    if arch == "llama":
        kw.update(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        )
        kw.update(overrides)
        return transformers.LlamaConfig(**kw)
    if arch == "mistral":
        kw.update(num_key_value_heads=1, sliding_window=48, head_dim=24)  # MQA, explicit head_dim
        kw.update(overrides)
        return transformers.MistralConfig(**kw)
    if arch == "qwen2":
        kw.update(tie_word_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 2.0})
        kw.update(overrides)
        return transformers.Qwen2Config(**kw)
    if arch == "qwen3":
        kw.update(head_dim=32, tie_word_embeddings=False)
        kw.update(overrides)
        return transformers.Qwen3Config(**kw)
    raise ValueError(arch)


def build_hf_model(arch: str, seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    cfg = hf_config(arch, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Random init is small; widen it so layers and adapters move logits noticeably.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.dim() == 1:
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.08)
    return model.eval()


def save_hf_model(model: transformers.PreTrainedModel, path: Path, shards: int = 1) -> Path:
    """Save config + safetensors; with shards > 1 write a sharded checkpoint with an index."""
    path.mkdir(parents=True, exist_ok=True)
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(path)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if shards == 1:
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    keys = sorted(state)
    weight_map: dict[str, str] = {}
    for i in range(shards):
        part = keys[i::shards]
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: state[k] for k in part}, str(path / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def make_peft_adapter(
    base: transformers.PreTrainedModel,
    path: Path,
    r: int,
    target_modules: Sequence[str] | str,
    seed: int,
    lora_alpha: int | None = None,
    **lora_kwargs: Any,
) -> Path:
    """Random (init_lora_weights=False) PEFT LoRA adapter on `base`, saved to `path`."""
    import copy

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(
        r=r,
        lora_alpha=lora_alpha if lora_alpha is not None else 2 * r,
        target_modules=list(target_modules) if not isinstance(target_modules, str) else target_modules,
        init_lora_weights=False,
        **lora_kwargs,
    )
    peft_model = get_peft_model(copy.deepcopy(base), cfg)
    peft_model.save_pretrained(str(path))
    return path

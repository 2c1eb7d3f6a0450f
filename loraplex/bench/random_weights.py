"""Random Llama-family weights made directly on the device, and random adapters of exact rank:
models and adapters for the benches that need no checkpoint (`bench engine`, `bench serve
--random-layers`, the capacity and host-overhead benches).

`llama3_8b_hf_dict` is Llama-3-8B's config.json (optionally with fewer layers), `tiny_hf_dict` a
tiny model of the same architecture for CPU smoke runs.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from loraplex.adapters.peft_import import LAYOUT_VERSION, MANIFEST_FORMAT, ImportedAdapter
from loraplex.config import ModelConfig
from loraplex.lora.layout import TARGETS
from loraplex.lora.weights import AdapterWeights, LoRAPair
from loraplex.model.llama import LlamaFamilyModel
from loraplex.model.registry import MODEL_CLASSES


def llama3_8b_hf_dict(layers: int | None = None) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": layers or 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "tie_word_embeddings": False,
    }


def tiny_hf_dict(layers: int | None = None) -> dict[str, Any]:
    d = llama3_8b_hf_dict(layers or 2)
    d.update(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
    )
    return d


def random_model(mc: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int) -> LlamaFamilyModel:
    """The model with random weights made on `device` (never staged on the host)."""
    torch.manual_seed(seed)
    with device:
        model = MODEL_CLASSES[mc.architecture](mc, dtype)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.fill_(1.0)  # norm weights (and biases, which Llama has none of)
            else:
                p.normal_(0.0, 0.02)
    return model.to(device).eval()


def random_adapter(
    mc: ModelConfig,
    rank: int,
    seed: int,
    dtype: torch.dtype,
    device: torch.device,
    targets: tuple[str, ...] = TARGETS,
) -> ImportedAdapter:
    """An adapter of exact rank `rank` on `targets` (default all seven) of every layer, random A
    and B."""
    gen = torch.Generator(device=device).manual_seed(seed)
    alpha = 2.0 * rank
    pairs: dict[tuple[int, str], LoRAPair] = {}
    modules = []
    for layer in range(mc.num_hidden_layers):
        for target in targets:
            d_in, d_out = mc.module_dims[target]
            a = torch.randn(rank, d_in, generator=gen, device=device, dtype=dtype) / math.sqrt(d_in)
            b = torch.randn(d_out, rank, generator=gen, device=device, dtype=dtype) * 0.01
            pairs[(layer, target)] = LoRAPair(a, b, alpha / rank)
            modules.append(
                {
                    "layer": layer,
                    "target": target,
                    "rank": rank,
                    "alpha": alpha,
                    "scale": alpha / rank,
                    "a_shape": [rank, d_in],
                    "b_shape": [d_out, rank],
                }
            )
    manifest = {
        "format": MANIFEST_FORMAT,
        "layout_version": LAYOUT_VERSION,
        "peft_type": "LORA",
        "base_architecture": mc.architecture,
        "use_rslora": False,
        "targets": list(targets),
        "source_dtypes": [str(dtype).removeprefix("torch.")],
        "max_rank": rank,
        "modules": modules,
    }
    return ImportedAdapter(AdapterWeights(pairs), manifest)

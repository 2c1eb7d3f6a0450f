"""Load a Hugging Face model directory (config.json + safetensors, sharded or not) into the
execution layout. Pickled checkpoints are never read."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import torch
from safetensors import safe_open

from loraplex.config import ModelConfig
from loraplex.layers.linear import ColumnParallelLinear
from loraplex.model.llama import LlamaFamilyModel
from loraplex.model.registry import MODEL_CLASSES

_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"sharded checkpoint in {model_dir} is missing {', '.join(missing)}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
        raise ValueError(f"{model_dir} holds only pickled weights (.bin/.pt); convert them to safetensors")
    raise ValueError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def iter_checkpoint(files: list[Path], progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(files), desc="loading weights", unit="shard")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield key, f.get_tensor(key)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    progress: bool = False,
) -> LlamaFamilyModel:
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    model = MODEL_CLASSES[cfg.architecture](cfg, dtype).to(device)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for key, tensor in iter_checkpoint(checkpoint_files(model_dir), progress):
        _load_one(model, params, cfg, key, tensor.to(dtype), loaded)
    expected = {n for n in params if n != "lm_head"} | ({"lm_head"} if model.lm_head is not None else set())
    fused_sources = {f"{dst}.{suffix}" for dst, _ in _FUSED.values() for suffix in ("weight", "bias")}
    missing = sorted(n for n in expected if n not in loaded and not any(n.endswith(s) for s in fused_sources))
    missing += _missing_fused(model, loaded)
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks tensors: {', '.join(missing[:8])}")
    return model.eval()


def _load_one(
    model: LlamaFamilyModel,
    params: dict[str, torch.nn.Parameter],
    cfg: ModelConfig,
    key: str,
    tensor: torch.Tensor,
    loaded: set[str],
) -> None:
    if key == "lm_head.weight":
        if model.lm_head is not None:
            _copy(params["lm_head"], tensor, key)
            loaded.add("lm_head")
        return  # tied: the head is the embedding; a saved copy is redundant
    if key.endswith("rotary_emb.inv_freq"):
        return  # recomputed from the config
    match = _LAYER_KEY.match(key)
    if match is None:
        name = key.removeprefix("model.")
        if name not in params:
            raise ValueError(f"unexpected tensor {key!r} in checkpoint")
        _copy(params[name], tensor, key)
        loaded.add(name)
        return
    layer, rest = int(match.group(1)), match.group(2)
    if layer >= cfg.num_hidden_layers:
        raise ValueError(
            f"checkpoint tensor {key!r} is for layer {layer}; the model has {cfg.num_hidden_layers}"
        )
    module_name, _, suffix = rest.rpartition(".")
    if module_name in _FUSED:
        fused_name, index = _FUSED[module_name]
        fused = cast(ColumnParallelLinear, model.layers[layer].get_submodule(fused_name))
        fused.load_slice(index, tensor, bias=suffix == "bias")
        loaded.add(f"layers.{layer}.{fused_name}.{suffix}[{index}]")
        return
    name = f"layers.{layer}.{rest}"
    if name not in params:
        raise ValueError(f"unexpected tensor {key!r} in checkpoint")
    _copy(params[name], tensor, key)
    loaded.add(name)


def _missing_fused(model: LlamaFamilyModel, loaded: set[str]) -> list[str]:
    missing = []
    for i, layer in enumerate(model.layers):
        for fused_name, n_slices in (("self_attn.qkv_proj", 3), ("mlp.gate_up_proj", 2)):
            module = layer.get_submodule(fused_name)
            suffixes = ["weight"] + (["bias"] if module.bias is not None else [])
            for suffix in suffixes:
                for s in range(n_slices):
                    if f"layers.{i}.{fused_name}.{suffix}[{s}]" not in loaded:
                        missing.append(f"layers.{i}.{fused_name}.{suffix}[{s}]")
    return missing


def _copy(param: torch.nn.Parameter, tensor: torch.Tensor, key: str) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(
            f"checkpoint tensor {key!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
        )
    param.data.copy_(tensor)

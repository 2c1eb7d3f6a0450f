"""Derive which base modules a PEFT LoRA config adapts, and at which rank and scale: the module plan.

PEFT decides the adapted module set from `adapter_config.json` alone; the weights file only fills it
in. So this re-derives that set the way PEFT 0.21 does (target and exclude matching,
`layers_to_transform` / `layers_pattern`, `rank_pattern` / `alpha_pattern`, rsLoRA scaling) against
the module names of the Hugging Face model the base architecture builds. A target that hits anything
but a q/k/v/o/gate/up/down projection is refused rather than silently narrowed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loraplex.adapters.peft_config import AdapterImportError, LoraSpec
from loraplex.config import ModelConfig
from loraplex.lora.layout import HF_MODULE_NAMES, TARGETS


@dataclass(frozen=True)
class PlannedModule:
    layer: int
    target: str
    rank: int
    alpha: float
    scale: float
    d_in: int
    d_out: int


def base_module_names(model_config: ModelConfig) -> list[str]:
    """The names `named_modules()` yields for the Hugging Face causal LM of this architecture.

    PEFT matches `target_modules` against exactly these names, so a pattern that also hits a norm,
    an embedding or a container must be seen (and refused) rather than silently narrowed.
    """
    names = ["", "model", "model.embed_tokens", "model.layers"]
    for i in range(model_config.num_hidden_layers):
        layer = f"model.layers.{i}"
        names += [layer, f"{layer}.self_attn"]
        names += [f"{layer}.{HF_MODULE_NAMES[t]}" for t in ("q", "k", "v", "o")]
        if model_config.qk_norm:
            names += [f"{layer}.self_attn.q_norm", f"{layer}.self_attn.k_norm"]
        names += [f"{layer}.mlp"] + [f"{layer}.{HF_MODULE_NAMES[t]}" for t in ("gate", "up", "down")]
        names += [f"{layer}.mlp.act_fn", f"{layer}.input_layernorm", f"{layer}.post_attention_layernorm"]
    return names + ["model.norm", "model.rotary_emb", "lm_head"]


def plan_modules(spec: LoraSpec, model_config: ModelConfig) -> dict[str, PlannedModule]:
    """module key -> what the config says that module gets; refuses targets the layout cannot hold."""
    _check_regexes(spec)
    projections = projection_keys(model_config)
    all_names = base_module_names(model_config)
    if not isinstance(spec.target_modules, str):
        for name in spec.target_modules:
            if not any(_matches_name_list([name], key) for key in all_names if key):
                raise AdapterImportError(
                    f"target module {name!r} matches no module of the {model_config.architecture} base model"
                )
    targeted = [key for key in all_names if key and _is_targeted(spec, key)]
    unsupported = [key for key in targeted if key not in projections]
    if unsupported:
        raise AdapterImportError(
            f"the config targets {', '.join(unsupported[:8])}{' ...' if len(unsupported) > 8 else ''}: "
            f"LoRA on these modules is not supported yet (only the {', '.join(HF_MODULE_NAMES.values())} "
            "projections)"
        )
    if not targeted:
        raise AdapterImportError(
            f"target_modules={spec.target_modules!r} match no module of the "
            f"{model_config.architecture} base model"
        )
    return {key: _planned(spec, key, *projections[key], model_config) for key in targeted}


def projection_keys(model_config: ModelConfig) -> dict[str, tuple[int, str]]:
    """module key -> (layer, target) for every projection the execution layout can hold."""
    return {
        f"model.layers.{i}.{HF_MODULE_NAMES[t]}": (i, t)
        for i in range(model_config.num_hidden_layers)
        for t in TARGETS
    }


def _planned(spec: LoraSpec, key: str, layer: int, target: str, model_config: ModelConfig) -> PlannedModule:
    rank = _pattern_value(spec.rank_pattern, key, spec.r)
    alpha = _pattern_value(spec.alpha_pattern, key, spec.alpha)
    scale = alpha / math.sqrt(rank) if spec.use_rslora else alpha / rank
    d_in, d_out = model_config.module_dims[target]
    return PlannedModule(layer, target, rank, alpha, scale, d_in, d_out)


def _check_regexes(spec: LoraSpec) -> None:
    """Compile every user pattern in the exact form matching embeds it, so matching cannot fail later."""
    for what, value in (("target_modules", spec.target_modules), ("exclude_modules", spec.exclude_modules)):
        if isinstance(value, str):
            _compile(value, what, value)
    layers_patterns = (
        [spec.layers_pattern] if isinstance(spec.layers_pattern, str) else spec.layers_pattern or []
    )
    for pattern in layers_patterns:
        _compile(_layers_pattern_regex(pattern), "layers_pattern", pattern)
    for what, patterns in (("rank_pattern", spec.rank_pattern), ("alpha_pattern", spec.alpha_pattern)):
        for key in patterns:
            _compile(_pattern_key_regex(key), what, key)


def _compile(regex: str, what: str, pattern: str) -> None:
    try:
        re.compile(regex)
    except re.error as err:
        raise AdapterImportError(f"{what} pattern {pattern!r} is not a valid regex: {err}") from None


# --- which modules the config adapts (PEFT's matching rules) ------------------------------------


def _matches_name_list(names: Sequence[str], key: str) -> bool:
    return key in names or any(key.endswith(f".{name}") for name in names)


def _is_excluded(spec: LoraSpec, key: str) -> bool:
    excluded = spec.exclude_modules
    if not excluded:
        return False
    if isinstance(excluded, str):
        return re.fullmatch(excluded, key) is not None
    return _matches_name_list(excluded, key)


def _layer_index(key: str, layers_pattern: list[str] | str | None) -> int | None:
    # The first numbered segment is the layer index (lazy match, so nested indices are not picked).
    if not layers_pattern:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
    else:
        match = None
        for pattern in [layers_pattern] if isinstance(layers_pattern, str) else layers_pattern:
            match = re.match(_layers_pattern_regex(pattern), key)
            if match is not None:
                break
    return int(match.group("idx")) if match else None


def _is_targeted(spec: LoraSpec, key: str) -> bool:
    if _is_excluded(spec, key):
        return False
    targets = spec.target_modules
    if isinstance(targets, str):
        return re.fullmatch(targets, key) is not None
    if key in targets:
        return True  # a module named in full is adapted whatever layers_to_transform says
    if not any(key.endswith(f".{t}") for t in targets):
        return False
    layers = spec.layers_to_transform
    if layers is None or (isinstance(layers, list) and not layers):
        return True
    index = _layer_index(key, spec.layers_pattern)
    if index is None:
        return False
    return index == layers if isinstance(layers, int) else index in layers


def _layers_pattern_regex(pattern: str) -> str:
    return rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\."


def _pattern_key_regex(pattern: str) -> str:
    return rf"(.*\.)?({pattern})$"


def _pattern_value(patterns: dict[str, Any], key: str, default: Any) -> Any:
    # The first pattern that matches a dot-aligned suffix of the key wins (PEFT's get_pattern_key).
    for pattern, value in patterns.items():
        if re.match(_pattern_key_regex(pattern), key):
            return value
    return default

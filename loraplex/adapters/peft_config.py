"""Read and validate a PEFT LoRA `adapter_config.json` into the spec the module plan is derived from.

The config alone decides which base modules an adapter adapts and at which rank and scale, so every
field is accounted for: plan fields are parsed and type-checked the way `LoraConfig` accepts them,
provenance- and training-only fields are ignored, and anything that would make the adapter compute
something other than `scale * B @ A` (DoRA, base-rewriting inits, retrained biases, unknown fields from
a newer PEFT, ...) is refused with an `AdapterImportError` naming it.

`AdapterImportError` lives here, the lowest of the PEFT import modules, and is re-exported by
`loraplex.adapters.peft_import`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.config import ModelConfig
from loraplex.lora.layout import HF_MODULE_NAMES, TARGETS

CONFIG_FILE = "adapter_config.json"

_MAX_CONFIG_BYTES = 4 << 20  # a config with a rank_pattern entry per module of a 100-layer model is ~50 KiB

# PEFT's default target_modules when a config leaves them unset (its per-model_type mapping).
_DEFAULT_TARGET_MODULES = {
    "LlamaForCausalLM": ["q_proj", "v_proj"],
    "MistralForCausalLM": ["q_proj", "v_proj"],
    "Qwen2ForCausalLM": ["q_proj", "v_proj"],
    "Qwen3ForCausalLM": ["q_proj", "v_proj"],
}

# Config fields that only record provenance or only act while training. Dropout is the identity at
# inference; init_lora_weights is checked on its own (some inits rewrite the base weights); the
# loftq / corda / lora_ga configs, megatron_core and qalora_group_size only act together with fields
# or inits that are refused; ensure_weight_tying only ties embedding / lm_head adapters (refused).
_INERT_FIELDS = frozenset(
    [
        "peft_type",
        "task_type",
        "base_model_name_or_path",
        "revision",
        "inference_mode",
        "auto_mapping",
        "peft_version",
        "lora_dropout",
        "init_lora_weights",
        "loftq_config",
        "eva_config",
        "corda_config",
        "lora_ga_config",
        "megatron_core",
        "qalora_group_size",
        "ensure_weight_tying",
        "runtime_config",
    ]
)

# Config fields the module plan is derived from.
_PLAN_FIELDS = frozenset(
    [
        "r",
        "lora_alpha",
        "use_rslora",
        "bias",
        "target_modules",
        "exclude_modules",
        "layers_to_transform",
        "layers_pattern",
        "rank_pattern",
        "alpha_pattern",
    ]
)

# Fields whose non-default value changes what the adapter computes beyond `scale * B @ A`.
_UNSUPPORTED_FIELDS = {
    "use_dora": "DoRA (use_dora) is not supported",
    "modules_to_save": "modules_to_save (fully trained copies of base modules) is not supported",
    "lora_bias": "a bias on lora_B (lora_bias) is not supported",
    "fan_in_fan_out": "fan_in_fan_out (transposed Conv1D weights) is not supported",
    "layer_replication": "layer_replication (a re-stacked base model) is not supported",
    "trainable_token_indices": "trainable_token_indices (retrained embedding rows) is not supported",
    "target_parameters": "target_parameters (LoRA on raw parameters) is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "use_qalora": "QA-LoRA (use_qalora) is not supported",
    "megatron_config": "Megatron parallel layers (megatron_config) are not supported",
    "velora_config": "VeLoRA (velora_config) is not supported",
    "kasa_config": "KaSA (kasa_config) is not supported",
    "use_bdlora": "block-diagonal LoRA (use_bdlora) is not supported",
    "arrow_config": "Arrow routing (arrow_config) is not supported",
    "monteclora_config": "MonteCLoRA (monteclora_config) is not supported",
}

# Inits that keep the base weights as they are; the others train against a rewritten base.
_PLAIN_INITS = ("gaussian", "eva", "orthogonal", "mica")
_BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


class AdapterImportError(ValueError):
    """A PEFT adapter that loraplex cannot serve exactly; the message names the problem."""


@dataclass(frozen=True)
class LoraSpec:
    """The parts of a LoRA config that decide which modules are adapted, at which rank and scale."""

    r: int
    alpha: float
    use_rslora: bool
    target_modules: list[str] | str
    exclude_modules: list[str] | str | None
    layers_to_transform: list[int] | int | None
    layers_pattern: list[str] | str | None
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]


def read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise AdapterImportError(f"{CONFIG_FILE} not found")
    if path.stat().st_size > _MAX_CONFIG_BYTES:
        raise AdapterImportError(f"{CONFIG_FILE} is larger than {_MAX_CONFIG_BYTES} bytes")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as err:
        raise AdapterImportError(f"{CONFIG_FILE} is malformed JSON: {err}") from None
    if not isinstance(raw, dict):
        raise AdapterImportError(
            f"{CONFIG_FILE} is malformed: expected a JSON object, got {type(raw).__name__}"
        )
    return raw


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard constant {name}")


def parse_config(raw: dict[str, Any], model_config: ModelConfig) -> LoraSpec:
    # The user regexes in the spec are compiled by peft_targets, which owns the forms matching embeds them in.
    peft_type = raw.get("peft_type")
    if peft_type != "LORA":
        raise AdapterImportError(f"peft_type is {peft_type!r}; only LORA adapters are supported")
    _check_unsupported_fields(raw)
    _check_init(raw.get("init_lora_weights", True))
    bias = raw.get("bias", "none")
    if bias != "none":
        raise AdapterImportError(
            f"bias={bias!r} is not supported: it retrains base biases (only bias='none')"
        )
    r = _positive_int(raw.get("r", 8), "r")
    alpha = _finite_number(raw.get("lora_alpha", 8), "lora_alpha")
    use_rslora = raw.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise AdapterImportError(f"use_rslora must be true or false, got {use_rslora!r}")
    target_modules = _parse_targets(raw.get("target_modules"), model_config)
    exclude_modules = _optional_names(raw.get("exclude_modules"), "exclude_modules")
    layers_to_transform = _parse_layer_indexes(raw.get("layers_to_transform"))
    layers_pattern = _optional_names(raw.get("layers_pattern"), "layers_pattern")
    # The same combinations LoraConfig itself rejects.
    regex_targets = isinstance(raw.get("target_modules"), str)
    if regex_targets and (layers_to_transform is not None or layers_pattern is not None):
        raise AdapterImportError(
            "layers_to_transform / layers_pattern cannot be used with a regex target_modules"
        )
    if layers_pattern and layers_to_transform is None:
        raise AdapterImportError("layers_pattern is set but layers_to_transform is not")
    return LoraSpec(
        r=r,
        alpha=alpha,
        use_rslora=use_rslora,
        target_modules=target_modules,
        exclude_modules=exclude_modules,
        layers_to_transform=layers_to_transform,
        layers_pattern=layers_pattern,
        rank_pattern=_parse_pattern(raw.get("rank_pattern"), "rank_pattern", _positive_int),
        alpha_pattern=_parse_pattern(raw.get("alpha_pattern"), "alpha_pattern", _finite_number),
    )


def _is_unset(value: Any) -> bool:
    # An empty dict is *set*: PEFT turns `{}` for a sub-config (kasa_config, velora_config, ...) into
    # that sub-config with its defaults, which switches the variant on.
    return value is None or value is False or (isinstance(value, (str, list)) and len(value) == 0)


def _check_unsupported_fields(raw: dict[str, Any]) -> None:
    for field, reason in _UNSUPPORTED_FIELDS.items():
        if not _is_unset(raw.get(field)):
            raise AdapterImportError(f"{reason} ({field}={raw[field]!r})")
    # A field this importer does not know may come from a newer PEFT and may change the output.
    for field, value in raw.items():
        known = field in _INERT_FIELDS or field in _PLAN_FIELDS or field in _UNSUPPORTED_FIELDS
        if not known and not _is_unset(value):
            raise AdapterImportError(
                f"unknown config field {field}={value!r}; cannot tell whether it changes the output"
            )


def _check_init(init: Any) -> None:
    if isinstance(init, bool):
        return
    if isinstance(init, str):
        lowered = init.lower()
        if lowered in _PLAIN_INITS:
            return
        if lowered.startswith(_BASE_REWRITING_INITS):
            raise AdapterImportError(
                f"init_lora_weights={init!r} trains against rewritten base weights, so it does not apply "
                "to the original base model; convert it to a plain LoRA first (PEFT save_pretrained with "
                "path_initial_model_for_weight_conversion)"
            )
    raise AdapterImportError(f"unknown init_lora_weights={init!r}")


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise AdapterImportError(f"{what} must be a positive integer, got {value!r}")
    return value


def _finite_number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise AdapterImportError(f"{what} must be a finite number, got {value!r}")
    return float(value)


def _optional_names(value: Any, what: str) -> list[str] | str | None:
    """None, one regex string, or a list of module-name suffixes, as LoraConfig accepts them."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise AdapterImportError(f"{what} must be a string or a list of strings, got {value!r}")


def _parse_targets(value: Any, model_config: ModelConfig) -> list[str] | str:
    if value is None:
        if model_config.architecture not in _DEFAULT_TARGET_MODULES:
            raise AdapterImportError(
                f"target_modules is unset and {model_config.architecture} has no default"
            )
        return list(_DEFAULT_TARGET_MODULES[model_config.architecture])
    if isinstance(value, str) and value.lower() == "all-linear":
        # PEFT expands this to every linear layer except the output head.
        return [
            f"model.layers.{i}.{HF_MODULE_NAMES[t]}"
            for i in range(model_config.num_hidden_layers)
            for t in TARGETS
        ]
    targets = _optional_names(value, "target_modules")
    assert targets is not None
    return targets


def _parse_layer_indexes(value: Any) -> list[int] | int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    raise AdapterImportError(f"layers_to_transform must be an integer or a list of integers, got {value!r}")


def _parse_pattern(value: Any, what: str, convert: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise AdapterImportError(f"{what} must be a JSON object, got {value!r}")
    return {key: convert(v, f"{what}[{key!r}]") for key, v in value.items()}

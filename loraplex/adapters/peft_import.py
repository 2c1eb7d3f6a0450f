"""Import a PEFT LoRA adapter directory into the execution layout, refusing what cannot be served exactly.

PEFT decides which base modules an adapter adapts from `adapter_config.json` alone; the weights file
only fills them in. So the importer re-derives that module set the way PEFT 0.21 does (target and
exclude matching, `layers_to_transform`, `rank_pattern` / `alpha_pattern`, rsLoRA scaling) against
the module names of the Hugging Face model the base architecture builds, then requires the weights
file to hold exactly one A/B pair per derived module, each with the shape the base and the config
imply. Whatever else the config or the file says that would make the adapter compute something other
than `scale * B @ A` added to a q/k/v/o/gate/up/down projection is refused with an
`AdapterImportError` naming it; nothing is served half-understood.

Only safetensors is read. Pickled checkpoints are never opened: unpickling can run arbitrary code.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from loraplex.config import ModelConfig
from loraplex.lora.layout import HF_MODULE_NAMES, TARGETS
from loraplex.lora.weights import AdapterWeights, LoRAPair

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MANIFEST_FORMAT = "loraplex-adapter"
LAYOUT_VERSION = 1

_MAX_CONFIG_BYTES = 4 << 20  # a config with a rank_pattern entry per module of a 100-layer model is ~50 KiB
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
_STATE_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the HF causal LM
_FLOAT_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_MAX_SOURCE_ITEMSIZE = 8  # float64, the widest dtype accepted; bounds the weights file size

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

# Tensor-key fragments of PEFT features that have no place in the execution layout.
_UNSUPPORTED_KEY_PARTS = {
    "lora_embedding_": "embedding LoRA weights are not supported yet",
    "lora_magnitude_vector": "DoRA magnitude vectors are not supported",
    "modules_to_save": "modules_to_save weights are not supported",
    "original_module": "modules_to_save weights are not supported",
    "trainable_tokens": "trainable token weights are not supported",
}
_LORA_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<which>[AB])(?:\.(?P<adapter>[^.]+))?\.(?P<param>[^.]+)")


class AdapterImportError(ValueError):
    """A PEFT adapter that loraplex cannot serve exactly; the message names the problem."""


@dataclass(frozen=True)
class ImportedAdapter:
    weights: AdapterWeights  # float32, CPU, contiguous
    manifest: dict[str, Any]  # JSON-serialisable description; hashed into the revision


@dataclass(frozen=True)
class _LoraSpec:
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


@dataclass(frozen=True)
class _PlannedModule:
    layer: int
    target: str
    rank: int
    alpha: float
    scale: float
    d_in: int
    d_out: int


def import_peft_adapter(path: str | Path, model_config: ModelConfig, max_rank: int) -> ImportedAdapter:
    """Read a PEFT LoRA adapter directory and normalize it for `model_config`'s base model.

    Raises `AdapterImportError` (a `ValueError`) naming the problem for anything that cannot be
    served exactly; never unpickles anything.
    """
    if isinstance(max_rank, bool) or not isinstance(max_rank, int) or max_rank <= 0:
        raise ValueError(f"max_rank must be a positive integer, got {max_rank!r}")
    root = Path(path)
    try:
        return _import(root, model_config, max_rank)
    except AdapterImportError as err:
        raise AdapterImportError(f"cannot import PEFT adapter {root}: {err}") from None


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


def _import(root: Path, model_config: ModelConfig, max_rank: int) -> ImportedAdapter:
    if not root.is_dir():
        raise AdapterImportError("not a directory")
    raw = _read_config(root / CONFIG_FILE)
    spec = _parse_config(raw, model_config)
    plan = _plan_modules(spec, model_config)
    for key, module in plan.items():
        if module.rank > max_rank:
            raise AdapterImportError(f"rank {module.rank} of {key} exceeds max_rank {max_rank}")
    pairs, dtypes = _read_weights(_weights_file(root), plan, model_config)
    weights = AdapterWeights(pairs)
    return ImportedAdapter(weights=weights, manifest=_manifest(plan, dtypes, spec, model_config))


# --- adapter_config.json -------------------------------------------------------------------------


def _read_config(path: Path) -> dict[str, Any]:
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


def _parse_config(raw: dict[str, Any], model_config: ModelConfig) -> _LoraSpec:
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
    spec = _LoraSpec(
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
    _check_regexes(spec)
    return spec


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


def _check_regexes(spec: _LoraSpec) -> None:
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


def _is_excluded(spec: _LoraSpec, key: str) -> bool:
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


def _is_targeted(spec: _LoraSpec, key: str) -> bool:
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


def _plan_modules(spec: _LoraSpec, model_config: ModelConfig) -> dict[str, _PlannedModule]:
    """module key -> what the config says that module gets; refuses targets the layout cannot hold."""
    projections = _projection_keys(model_config)
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


def _projection_keys(model_config: ModelConfig) -> dict[str, tuple[int, str]]:
    return {
        f"model.layers.{i}.{HF_MODULE_NAMES[t]}": (i, t)
        for i in range(model_config.num_hidden_layers)
        for t in TARGETS
    }


def _planned(spec: _LoraSpec, key: str, layer: int, target: str, model_config: ModelConfig) -> _PlannedModule:
    rank = _pattern_value(spec.rank_pattern, key, spec.r)
    alpha = _pattern_value(spec.alpha_pattern, key, spec.alpha)
    scale = alpha / math.sqrt(rank) if spec.use_rslora else alpha / rank
    d_in, d_out = model_config.module_dims[target]
    return _PlannedModule(layer, target, rank, alpha, scale, d_in, d_out)


# --- adapter_model.safetensors -------------------------------------------------------------------


def _weights_file(root: Path) -> Path:
    path = root / WEIGHTS_FILE
    if path.is_file():
        return path
    pickled = sorted(p.name for p in root.iterdir() if p.is_file() and p.suffix.lower() in _PICKLE_SUFFIXES)
    if pickled:
        raise AdapterImportError(
            f"only pickled weights found ({', '.join(pickled)}); pickled weights are not loaded because "
            f"unpickling can run arbitrary code; save the adapter as {WEIGHTS_FILE}"
        )
    raise AdapterImportError(f"{WEIGHTS_FILE} not found")


def _max_weights_bytes(plan: dict[str, _PlannedModule]) -> int:
    # Every tensor at the widest accepted dtype, plus a generous header allowance per tensor.
    data = sum((m.d_in + m.d_out) * m.rank * _MAX_SOURCE_ITEMSIZE for m in plan.values())
    return data + (64 << 10) + 1024 * 2 * len(plan)


def _read_weights(
    path: Path, plan: dict[str, _PlannedModule], model_config: ModelConfig
) -> tuple[dict[tuple[int, str], LoRAPair], list[str]]:
    size, limit = path.stat().st_size, _max_weights_bytes(plan)
    if size > limit:
        raise AdapterImportError(
            f"{WEIGHTS_FILE} is {size} bytes, more than the {limit} bytes the configured modules and "
            "ranks can need; refusing to read it"
        )
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = list(f.keys())
            if len(keys) > 2 * len(plan) + 64:
                raise AdapterImportError(
                    f"{WEIGHTS_FILE} holds {len(keys)} tensors for {len(plan)} configured modules"
                )
            by_module = _index_keys(keys, plan, model_config)
            dtypes = {
                _check_tensor_meta(f, key, which, plan[module])
                for module, ab in by_module.items()
                for which, key in ab.items()
            }
            pairs = {
                (plan[m].layer, plan[m].target): _load_pair(f, ab["A"], ab["B"], plan[m].scale)
                for m, ab in by_module.items()
            }
    except SafetensorError as err:
        raise AdapterImportError(f"{WEIGHTS_FILE} is not a valid safetensors file: {err}") from None
    return pairs, sorted(dtypes)


def _index_keys(
    keys: list[str], plan: dict[str, _PlannedModule], model_config: ModelConfig
) -> dict[str, dict[str, str]]:
    """module key -> {"A": tensor key, "B": tensor key}; refuses keys that are not plain LoRA A/B weights."""
    by_module: dict[str, dict[str, str]] = {}
    adapter_names: set[str] = set()
    for key in sorted(keys):
        module, which, adapter = _parse_key(key)
        if module not in plan:
            raise AdapterImportError(_stray_module_reason(key, module, model_config))
        if which in by_module.setdefault(module, {}):
            raise AdapterImportError(f"{module} has more than one lora_{which} tensor")
        by_module[module][which] = key
        adapter_names.add(adapter or "")
    if len(adapter_names) > 1:
        raise AdapterImportError(
            f"tensor keys name several adapters: {sorted(n for n in adapter_names if n)}"
        )
    for module in plan:
        present = by_module.get(module, {})
        if not present:
            raise AdapterImportError(f"the config targets {module} but {WEIGHTS_FILE} has no weights for it")
        for which in ("A", "B"):
            if which not in present:
                raise AdapterImportError(f"{module} has no lora_{which} weight")
    return by_module


def _stray_module_reason(key: str, module: str, model_config: ModelConfig) -> str:
    if module in _projection_keys(model_config):
        return f"tensor {key!r} holds weights for {module}, which the adapter config does not target"
    if module in base_module_names(model_config):
        return f"tensor {key!r} holds weights for {module}: LoRA on this module is not supported yet"
    arch = model_config.architecture
    return f"tensor {key!r} holds weights for {module}, which does not exist in the {arch} base model"


def _parse_key(key: str) -> tuple[str, str, str | None]:
    """tensor key -> (base module key, "A" | "B", adapter name segment or None)."""
    for fragment, reason in _UNSUPPORTED_KEY_PARTS.items():
        if fragment in key:
            raise AdapterImportError(f"unexpected tensor {key!r}: {reason}")
    match = _LORA_KEY.fullmatch(key)
    if not key.startswith(_STATE_PREFIX) or match is None:
        raise AdapterImportError(
            f"unexpected tensor key {key!r} (expected {_STATE_PREFIX}<module>.lora_A/B.weight)"
        )
    if match.group("param") != "weight":
        raise AdapterImportError(
            f"unexpected tensor {key!r}: only lora_A/lora_B weights are supported (no bias)"
        )
    module = match.group("module").removeprefix(_STATE_PREFIX)
    return module, match.group("which"), match.group("adapter")


def _check_tensor_meta(f: Any, key: str, which: str, module: _PlannedModule) -> str:
    """Checks dtype and shape from the header alone, before any tensor data is read; returns the dtype."""
    tensor = f.get_slice(key)
    dtype = tensor.get_dtype()
    if dtype not in _FLOAT_DTYPES:
        raise AdapterImportError(f"tensor {key!r} has dtype {dtype}; LoRA weights must be floating point")
    shape = list(tensor.get_shape())
    expected = [module.rank, module.d_in] if which == "A" else [module.d_out, module.rank]
    if len(shape) != 2:
        raise AdapterImportError(f"tensor {key!r} has shape {shape}; expected {expected}")
    rank = shape[0] if which == "A" else shape[1]
    if rank != module.rank:
        raise AdapterImportError(
            f"tensor {key!r} has rank {rank} but the config (r / rank_pattern) gives rank {module.rank}"
        )
    if shape != expected:
        dim = "d_in" if which == "A" else "d_out"
        raise AdapterImportError(
            f"tensor {key!r} has shape {shape}, which does not fit the base model: expected {expected} "
            f"({dim} of {module.target} is {expected[1] if which == 'A' else expected[0]})"
        )
    return _FLOAT_DTYPES[dtype]


def _load_pair(f: Any, a_key: str, b_key: str, scale: float) -> LoRAPair:
    return LoRAPair(a=_load_float32(f, a_key), b=_load_float32(f, b_key), scale=scale)


def _load_float32(f: Any, key: str) -> torch.Tensor:
    # Own the storage: the result must not alias a memory map of a file that can change later.
    tensor = f.get_tensor(key).to(torch.float32).clone(memory_format=torch.contiguous_format)
    if not torch.isfinite(tensor).all():
        raise AdapterImportError(f"tensor {key!r} contains NaN or Inf values (in float32)")
    return tensor


# --- manifest -------------------------------------------------------------------------------------


def _manifest(
    plan: dict[str, _PlannedModule], dtypes: list[str], spec: _LoraSpec, model_config: ModelConfig
) -> dict[str, Any]:
    modules = sorted(plan.values(), key=lambda m: (m.layer, m.target))
    return {
        "format": MANIFEST_FORMAT,
        "layout_version": LAYOUT_VERSION,
        "peft_type": "LORA",
        "base_architecture": model_config.architecture,
        "use_rslora": spec.use_rslora,
        "targets": [t for t in TARGETS if any(m.target == t for m in modules)],
        "source_dtypes": dtypes,
        "max_rank": max(m.rank for m in modules),
        "modules": [
            {
                "layer": m.layer,
                "target": m.target,
                "rank": m.rank,
                "alpha": m.alpha,
                "scale": m.scale,
                "a_shape": [m.rank, m.d_in],
                "b_shape": [m.d_out, m.rank],
            }
            for m in modules
        ],
    }

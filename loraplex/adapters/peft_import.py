"""Import a PEFT LoRA adapter directory into the execution layout, refusing what cannot be served exactly.

PEFT decides which base modules an adapter adapts from `adapter_config.json` alone; the weights file
only fills them in. So the importer reads and validates the config (`peft_config`), re-derives that
module set the way PEFT 0.21 does against the module names of the Hugging Face model the base
architecture builds (`peft_targets`), then requires the weights file to hold exactly one A/B pair per
derived module, each with the shape the base and the config imply. Whatever else the config or the
file says that would make the adapter compute something other than `scale * B @ A` added to a
q/k/v/o/gate/up/down projection is refused with an `AdapterImportError` naming it; nothing is served
half-understood.

Only safetensors is read. Pickled checkpoints are never opened: unpickling can run arbitrary code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from loraplex.adapters.base_identity import BaseIdentity, check_adapter_base
from loraplex.adapters.peft_config import CONFIG_FILE, AdapterImportError, LoraSpec, parse_config, read_config
from loraplex.adapters.peft_targets import PlannedModule, base_module_names, plan_modules, projection_keys
from loraplex.config import ModelConfig
from loraplex.lora.layout import TARGETS
from loraplex.lora.weights import AdapterWeights, LoRAPair

__all__ = [
    "CONFIG_FILE",
    "LAYOUT_VERSION",
    "MANIFEST_FORMAT",
    "WEIGHTS_FILE",
    "AdapterImportError",
    "ImportedAdapter",
    "base_module_names",
    "import_peft_adapter",
]

WEIGHTS_FILE = "adapter_model.safetensors"
MANIFEST_FORMAT = "loraplex-adapter"
LAYOUT_VERSION = 1

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
_STATE_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the HF causal LM
_FLOAT_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_MAX_SOURCE_ITEMSIZE = 8  # float64, the widest dtype accepted; bounds the weights file size

# Tensor-key fragments of PEFT features that have no place in the execution layout.
_UNSUPPORTED_KEY_PARTS = {
    "lora_embedding_": "embedding LoRA weights are not supported yet",
    "lora_magnitude_vector": "DoRA magnitude vectors are not supported",
    "modules_to_save": "modules_to_save weights are not supported",
    "original_module": "modules_to_save weights are not supported",
    "trainable_tokens": "trainable token weights are not supported",
}
_LORA_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<which>[AB])(?:\.(?P<adapter>[^.]+))?\.(?P<param>[^.]+)")


@dataclass(frozen=True)
class ImportedAdapter:
    weights: AdapterWeights  # float32, CPU, contiguous
    manifest: dict[str, Any]  # JSON-serialisable description; hashed into the revision


def import_peft_adapter(
    path: str | Path, model_config: ModelConfig, max_rank: int, base: BaseIdentity | None = None
) -> ImportedAdapter:
    """Read a PEFT LoRA adapter directory and normalize it for `model_config`'s base model.
    `base`: the served base's identity, recorded in the manifest (and so in the revision).

    Raises `AdapterImportError` (a `ValueError`) naming the problem for anything that cannot be
    served exactly; never unpickles anything.
    """
    if isinstance(max_rank, bool) or not isinstance(max_rank, int) or max_rank <= 0:
        raise ValueError(f"max_rank must be a positive integer, got {max_rank!r}")
    root = Path(path)
    try:
        if base is not None and root.is_dir():  # a base or tokenizer mismatch: before any weight
            try:
                check_adapter_base(root, base)
            except ValueError as err:
                raise AdapterImportError(str(err)) from None
        imported = _import(root, model_config, max_rank)
    except AdapterImportError as err:
        raise AdapterImportError(f"cannot import PEFT adapter {root}: {err}") from None
    if base is not None:
        imported.manifest.update(base.manifest_fields())
    return imported


def _import(root: Path, model_config: ModelConfig, max_rank: int) -> ImportedAdapter:
    if not root.is_dir():
        raise AdapterImportError("not a directory")
    raw = read_config(root / CONFIG_FILE)
    spec = parse_config(raw, model_config)
    plan = plan_modules(spec, model_config)
    for key, module in plan.items():
        if module.rank > max_rank:
            raise AdapterImportError(f"rank {module.rank} of {key} exceeds max_rank {max_rank}")
    pairs, dtypes = _read_weights(_weights_file(root), plan, model_config)
    weights = AdapterWeights(pairs)
    return ImportedAdapter(weights=weights, manifest=_manifest(plan, dtypes, spec, model_config))


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


def _max_weights_bytes(plan: dict[str, PlannedModule]) -> int:
    # Every tensor at the widest accepted dtype, plus a generous header allowance per tensor.
    data = sum((m.d_in + m.d_out) * m.rank * _MAX_SOURCE_ITEMSIZE for m in plan.values())
    return data + (64 << 10) + 1024 * 2 * len(plan)


def _read_weights(
    path: Path, plan: dict[str, PlannedModule], model_config: ModelConfig
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
    keys: list[str], plan: dict[str, PlannedModule], model_config: ModelConfig
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
    if module in projection_keys(model_config):
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


def _check_tensor_meta(f: Any, key: str, which: str, module: PlannedModule) -> str:
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
    tensor: torch.Tensor = f.get_tensor(key).to(torch.float32).clone(memory_format=torch.contiguous_format)
    if not torch.isfinite(tensor).all():
        raise AdapterImportError(f"tensor {key!r} contains NaN or Inf values (in float32)")
    return tensor


# --- manifest -------------------------------------------------------------------------------------


def _manifest(
    plan: dict[str, PlannedModule], dtypes: list[str], spec: LoraSpec, model_config: ModelConfig
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

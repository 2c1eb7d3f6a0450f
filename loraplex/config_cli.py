"""Command-line flags derived from the frozen config dataclasses, so the two never drift apart."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import TYPE_CHECKING, Any

from loraplex.config import CacheConfig, EngineConfig, GraphConfig, LoRAConfig, SchedulerConfig

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

# Engine sub-configs exposed as flags: EngineConfig field -> dataclass.
_SECTIONS: dict[str, type[DataclassInstance]] = {
    "cache": CacheConfig,
    "lora": LoRAConfig,
    "scheduler": SchedulerConfig,
    "graphs": GraphConfig,
}


# What a None default means, where the flag's help would otherwise say only "derived".
_DERIVED = {("scheduler", "max_num_batched_tokens"): "6 per --max-num-seqs, at least 384"}


def _flag(section: str, name: str) -> str:
    # Unambiguous without a prefix except `lora.max_rank`, which users know as max-lora-rank.
    return "--max-lora-rank" if (section, name) == ("lora", "max_rank") else "--" + name.replace("_", "-")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (default: float32)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the shared sampling generator")
    for section, cls in _SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else None
            if hints[f.name] is bool:  # --name / --no-name (a string "False" would read as true)
                parser.add_argument(
                    _flag(section, f.name),
                    dest=f"{section}__{f.name}",
                    action=argparse.BooleanOptionalAction,
                    default=default,
                    help=f"{section} setting (default: {'on' if default else 'off'})",
                )
                continue
            parser.add_argument(
                _flag(section, f.name),
                dest=f"{section}__{f.name}",
                metavar=f.name.upper(),
                type=_scalar(hints[f.name]),
                default=default,
                help=f"{section} setting (default: "
                f"{default if default is not None else _DERIVED.get((section, f.name), 'derived')})",
            )


def engine_defaults_from_mapping(parser: argparse.ArgumentParser, values: dict[str, Any]) -> None:
    """Use a config file's engine settings (flat field names, or nested by section) as defaults,
    so flags given on the command line still win."""
    defaults: dict[str, Any] = {}
    known = {"dtype", "device", "seed"}
    flat = dict(values)
    for name in _SECTIONS:
        nested = flat.pop(name, None)
        if isinstance(nested, dict):
            flat.update(nested)
    for key, value in flat.items():
        section = next((s for s, cls in _SECTIONS.items() if key in cls.__dataclass_fields__), None)
        if key == "max_lora_rank":
            section, key = "lora", "max_rank"
        if section is not None:
            defaults[f"{section}__{key}"] = value
        elif key in known:
            defaults[key] = value
        else:
            raise ValueError(f"unknown engine setting {key!r} in the config file")
    parser.set_defaults(**defaults)


def engine_config_from_args(model_dir: str, args: argparse.Namespace) -> EngineConfig:
    sections: dict[str, Any] = {}
    for section, cls in _SECTIONS.items():
        values = {f.name: getattr(args, f"{section}__{f.name}") for f in dataclasses.fields(cls)}
        sections[section] = cls(**values)
    return EngineConfig(model_dir=model_dir, dtype=args.dtype, device=args.device, seed=args.seed, **sections)


def _scalar(hint: object) -> type:
    """The argparse type of a setting: int or float by its annotation (also inside `| None`), else str."""
    text = str(hint)
    return int if "int" in text else float if "float" in text else str
